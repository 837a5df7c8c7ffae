"""``EngineArgs``: every engine setting as one flat keyword list (vLLM's ``vllm.engine.arg_utils``).

Its fields are generated from the settings declared on the config dataclasses (tideserve/settings.py),
so a new knob is declared once, on its config, and appears here, on the command line, in
``LLM(**kwargs)`` and in docs/configuration.md. Only the two object-valued fields below, which no
command line can spell, are written here. Plain Python (no torch): the CLI checks its flags with it
before anything heavy is imported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tideserve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tideserve.core.kv_cache.elastic import ElasticConfig
from tideserve.settings import args_fields, build_config, check_names, settings_fields

if TYPE_CHECKING:
    from tideserve.core.kv_cache.memory import MemoryProbe

# The configs whose settings EngineArgs carries, in the order the CLI lists them: each argparse group's
# flags follow this order, then each dataclass's field order.
ENGINE_CONFIGS: tuple[type, ...] = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, ElasticConfig)
ENGINE_SETTINGS = tuple(settings_fields(*ENGINE_CONFIGS))

_EngineSettings = dataclasses.make_dataclass("_EngineSettings", args_fields(ENGINE_SETTINGS))
_EngineSettings.__module__ = __name__


@dataclass
class EngineArgs(_EngineSettings):
    """One field per engine setting (``EngineArgs(model=..., dtype=..., max_num_seqs=...)``; see
    ``fields(EngineArgs)`` or docs/configuration.md), plus two objects for tests and embedders."""

    memory_probe: MemoryProbe | None = None  # a test double answers for the machine
    elastic: ElasticConfig | None = None  # watermarks and delays of the elastic pool

    @classmethod
    def coerce(cls, args: EngineArgs | Mapping[str, Any]) -> EngineArgs:
        """``args`` itself, or EngineArgs from a dict of its fields (vLLM scripts pass either); unknown keys
        are a ValueError that lists them, the closest known names, and the known ones."""
        if isinstance(args, EngineArgs):
            return args
        if not isinstance(args, Mapping):
            raise ValueError(f"engine args must be an EngineArgs or a dict of its fields, got {type(args).__name__}.")
        check_names(args, cls.field_names())
        return cls(**args)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def parallel_config(self) -> ParallelConfig:
        return build_config(ParallelConfig, ENGINE_SETTINGS, self)

    def elastic_config(self) -> ElasticConfig:
        return build_config(ElasticConfig, ENGINE_SETTINGS, self, base=self.elastic or ElasticConfig())

    def configs(self) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
        self.parallel_config()  # first: a multi-device layout is the first thing to fix
        return tuple(build_config(c, ENGINE_SETTINGS, self) for c in (ModelConfig, CacheConfig, SchedulerConfig))
