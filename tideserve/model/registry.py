"""Model families: every architecture name we accept -> the ``ModelFamily`` that declares it.

A family is one declaration in ``tideserve/model/families/<name>.py`` (a module-level ``FAMILY``): its HF
and GGUF architecture names, its model class, how a GGUF file's tensor names map onto the checkpoint
names that class loads, which q/k rows llama.cpp permuted, and the ``ArchConfig`` fields that differ by
family. Every module of that package is read on the first lookup, so adding a family is adding one file;
tests can ``register_family`` their own.

This module and the declarations are torch-free and model classes are imported only when a model is
built, so ``arch_config`` can read a family while parsing a config without an import cycle.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


@dataclass(frozen=True)
class GGUFTensorMap:
    """GGUF tensor names -> the checkpoint (HF) names the family's ``load_weights`` takes.

    ``global_names`` maps whole names; ``block_names`` maps the ``<key>`` of ``blk.N.<key>.weight|bias``
    to the module path under ``{block_prefix}.N``; ``skipped`` names tensors that are no module's weight
    (e.g. ``rope_freqs.weight``, read into ``ArchConfig.rope_scaling``).
    """

    global_names: Mapping[str, str]
    block_names: Mapping[str, str]
    block_prefix: str = "model.layers"
    skipped: frozenset[str] = frozenset()

    def hf_name(self, gguf_name: str) -> str | None:
        """The checkpoint name of a GGUF tensor, or None when the map does not know it."""
        if gguf_name in self.global_names:
            return self.global_names[gguf_name]
        m = _BLOCK_RE.match(gguf_name)
        if m and m.group(2) in self.block_names:
            return f"{self.block_prefix}.{m.group(1)}.{self.block_names[m.group(2)]}.{m.group(3)}"
        return None


def _no_fields(_: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class ModelFamily:
    """Everything that differs from one model family to the next, declared once.

    - ``model_class``: ``"module:Class"``, imported when a model is built (never at registration).
    - ``hf_architectures``: config.json ``architectures`` entries; ``model_types``: config.json
      ``model_type`` -> HF architecture, for configs without ``architectures``.
    - ``gguf_architectures``: GGUF ``general.architecture`` -> HF architecture.
    - ``gguf_tensors``: the GGUF tensor-name map (None: the family has no GGUF files).
    - ``gguf_unpermute``: checkpoint-name suffix -> the ``ArchConfig`` head count its rows are grouped
      by, for the 2-D tensors whose rows llama.cpp's converter permuted (its interleaved rotary layout;
      ours is HF's rotate-half), so the loader permutes them back.
    - ``hf_config_fields(config.json dict)`` and ``gguf_config_fields(GGUF tensor names)``: the
      ``ArchConfig`` fields this family derives its own way (biases, tied embeddings); the keys every
      family shares are read by ``ArchConfig`` itself.
    - ``gguf_metadata_fields(get)``: fields from the family's own GGUF metadata keys, ``get(key, default)``
      with ``{arch}`` in ``key`` standing for the file's architecture (sliding windows, soft-capping).
    """

    name: str
    model_class: str
    hf_architectures: tuple[str, ...]
    gguf_architectures: Mapping[str, str] = field(default_factory=dict)
    model_types: Mapping[str, str] = field(default_factory=dict)
    gguf_tensors: GGUFTensorMap | None = None
    gguf_unpermute: Mapping[str, str] = field(default_factory=dict)
    hf_config_fields: Callable[[Mapping[str, Any]], dict[str, Any]] = _no_fields
    gguf_config_fields: Callable[[Collection[str]], dict[str, Any]] = _no_fields
    gguf_metadata_fields: Callable[[Callable[[str, Any], Any]], dict[str, Any]] = _no_fields

    def __post_init__(self) -> None:
        module, sep, cls = self.model_class.partition(":")
        if not (module and sep and cls):
            raise ValueError(f"ModelFamily {self.name!r}: model_class={self.model_class!r} must be 'module:Class'")
        stray = sorted(set(self.gguf_architectures.values()) - set(self.hf_architectures))
        stray += sorted(set(self.model_types.values()) - set(self.hf_architectures))
        if stray:
            raise ValueError(f"ModelFamily {self.name!r}: {', '.join(stray)} not in hf_architectures")

    def load_model_class(self) -> type[nn.Module]:
        module, _, cls = self.model_class.partition(":")
        return getattr(importlib.import_module(module), cls)


_FAMILIES: dict[str, ModelFamily] = {}
_BY_HF: dict[str, ModelFamily] = {}
_BY_GGUF: dict[str, ModelFamily] = {}
_lock = threading.RLock()
_builtins_loaded = False


def _load_builtins() -> None:
    """Register the ``FAMILY`` of every module in ``tideserve.model.families`` (once)."""
    global _builtins_loaded
    if _builtins_loaded:
        return
    with _lock:
        if _builtins_loaded:
            return
        _builtins_loaded = True
        package = importlib.import_module("tideserve.model.families")
        for info in pkgutil.iter_modules(package.__path__):
            family = getattr(importlib.import_module(f"{package.__name__}.{info.name}"), "FAMILY", None)
            if isinstance(family, ModelFamily):
                _register(family)


def _register(family: ModelFamily) -> None:
    taken = [n for n in family.hf_architectures if n in _BY_HF]
    taken += [n for n in family.gguf_architectures if n in _BY_GGUF]
    if family.name in _FAMILIES or taken:
        owner = _FAMILIES.get(family.name) or _BY_HF.get(taken[0]) or _BY_GGUF[taken[0]]
        raise ValueError(f"model family {family.name!r}: {', '.join(taken) or 'its name'} already "
                         f"registered by family {owner.name!r}")
    _FAMILIES[family.name] = family
    _BY_HF.update(dict.fromkeys(family.hf_architectures, family))
    _BY_GGUF.update(dict.fromkeys(family.gguf_architectures, family))


def register_family(family: ModelFamily) -> ModelFamily:
    """Add a family (built-in ones are in ``tideserve/model/families/``); a name another family already
    claims raises ValueError."""
    _load_builtins()
    with _lock:
        _register(family)
    return family


def unregister_family(name: str) -> None:
    """Remove a family registered with ``register_family`` (tests clean up with it)."""
    _load_builtins()
    with _lock:
        family = _FAMILIES.pop(name)
        for n in family.hf_architectures:
            _BY_HF.pop(n, None)
        for n in family.gguf_architectures:
            _BY_GGUF.pop(n, None)


def model_families() -> list[ModelFamily]:
    _load_builtins()
    return list(_FAMILIES.values())


def supported_architectures() -> list[str]:
    """Every architecture name we accept, HF names first, then GGUF names."""
    _load_builtins()
    return sorted(_BY_HF) + sorted(_BY_GGUF)


def _unsupported(kind: str, name: str) -> ValueError:
    return ValueError(
        f"unsupported {kind} {name!r}; supported HF architectures: {', '.join(sorted(_BY_HF))}; "
        f"supported GGUF architectures: {', '.join(sorted(_BY_GGUF))}"
    )


def family_for(architecture: str) -> ModelFamily:
    """The family of an HF or GGUF architecture name; unknown names raise ValueError listing the known."""
    _load_builtins()
    family = _BY_HF.get(architecture) or _BY_GGUF.get(architecture)
    if family is None:
        raise _unsupported("architecture", architecture)
    return family


def hf_architecture_for_gguf(gguf_arch: str) -> str:
    """Map a GGUF ``general.architecture`` value (e.g. ``"llama"``) to its HF name."""
    _load_builtins()
    family = _BY_GGUF.get(gguf_arch)
    if family is None:
        raise _unsupported("GGUF general.architecture", gguf_arch)
    return family.gguf_architectures[gguf_arch]


def hf_architecture_for_model_type(model_type: str) -> str | None:
    """The HF architecture of a config.json ``model_type`` (for configs without ``architectures``)."""
    for family in model_families():
        if model_type in family.model_types:
            return family.model_types[model_type]
    return None


def resolve_model_class(architecture: str) -> type[nn.Module]:
    """Return the model class for an HF or GGUF architecture name; unknown names raise ValueError."""
    return family_for(architecture).load_model_class()
