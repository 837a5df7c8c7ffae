"""Embeddings from the served model: how a prompt's final hidden states become one vector.

vLLM serves embeddings from a separate "pooling" runner; here the same engine that generates also pools,
so one process answers ``/v1/embeddings`` beside the completion endpoints. A pooling request is a prompt
that is prefilled and never decoded: its final hidden states (after the model's last norm) are reduced
to one vector by the pooling type, then optionally scaled to unit length.

- ``LAST`` (the default, as vLLM's ``embed`` task for decoder-only models): the last prompt token's state,
  the only one that has attended to the whole prompt.
- ``MEAN``: the average over every prompt token (these requests skip the prefix cache, whose hits would
  leave the cached positions' states uncomputed).
- ``CLS``: the first token's state (encoder-style models; kept for vLLM's option set).

Plain Python (no torch): the configs import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tideserve.settings import config_from_json

POOLING_TYPES = ("LAST", "MEAN", "CLS")


def _check_type(value: Any, name: str) -> str:
    if not isinstance(value, str) or value.upper() not in POOLING_TYPES:
        raise ValueError(f"{name} must be one of {', '.join(POOLING_TYPES)}, got {value!r}.")
    return value.upper()


def _check_bool(value: Any, name: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}.")


@dataclass
class PoolerConfig:
    """The server's default pooling (``--pooler-config``); requests may change ``normalize``."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        self.pooling_type = _check_type(self.pooling_type, "pooler_config.pooling_type")
        _check_bool(self.normalize, "pooler_config.normalize")


def parse_pooler_config(value: Any) -> PoolerConfig | None:
    """A PoolerConfig from JSON text (the flag), a dict (Python) or one already built; None (the defaults)
    stays None."""
    return config_from_json(value, PoolerConfig, "pooler_config", '{"pooling_type": "MEAN", "normalize": true}')


@dataclass
class PoolingParams:
    """One embedding request's pooling (vLLM's ``PoolingParams``). None fields take the engine's
    ``pooler_config``; ``dimensions`` (OpenAI's) must be the model's hidden size or None, since a
    decoder's hidden state is not trained to be cut short (no matryoshka representation)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            self.pooling_type = _check_type(self.pooling_type, "pooling_type")
        if self.normalize is not None:
            _check_bool(self.normalize, "normalize")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}.")

    def resolved(self, default: PoolerConfig | None, hidden_size: int) -> PoolingParams:
        """Every field set: the request's values, else the engine's (``default``; None: PoolerConfig's).
        Raises for dimensions the model does not have."""
        default = default or PoolerConfig()
        if self.dimensions is not None and self.dimensions != hidden_size:
            raise ValueError(f"dimensions={self.dimensions} is not supported: this model's embeddings have "
                             f"{hidden_size} dimensions, and it is not a matryoshka model, so they cannot be "
                             "shortened without losing what they encode.")
        return PoolingParams(self.pooling_type or default.pooling_type,
                             default.normalize if self.normalize is None else self.normalize, hidden_size)

    @property
    def needs_every_prompt_position(self) -> bool:
        """MEAN and CLS read positions a prefix-cache hit would skip; LAST's position always runs."""
        return self.pooling_type != "LAST"
