"""Architecture name -> model class.

Two naming schemes reach us: HF ``config.json`` ``architectures`` entries and GGUF ``general.architecture``.
Both resolve to one HF-style name, and that name to a class. Classes are imported lazily so that
``arch_config`` can use this module without an import cycle.
"""

from __future__ import annotations

import importlib

from torch import nn

# HF architecture name -> (module, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("tideserve.model.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("tideserve.model.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("tideserve.model.llama", "LlamaForCausalLM"),
}

# GGUF general.architecture -> HF architecture name
_GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def supported_architectures() -> list[str]:
    """Every architecture name we accept, HF names first, then GGUF names."""
    return sorted(_MODELS) + sorted(_GGUF_ARCHITECTURES)


def _unsupported(kind: str, name: str) -> ValueError:
    return ValueError(
        f"unsupported {kind} {name!r}; supported HF architectures: {', '.join(sorted(_MODELS))}; "
        f"supported GGUF architectures: {', '.join(sorted(_GGUF_ARCHITECTURES))}"
    )


def hf_architecture_for_gguf(gguf_arch: str) -> str:
    """Map a GGUF ``general.architecture`` value (e.g. ``"llama"``) to its HF name."""
    try:
        return _GGUF_ARCHITECTURES[gguf_arch]
    except KeyError:
        raise _unsupported("GGUF general.architecture", gguf_arch) from None


def resolve_model_class(architecture: str) -> type[nn.Module]:
    """Return the model class for an HF or GGUF architecture name; unknown names raise ValueError."""
    hf_name = _GGUF_ARCHITECTURES.get(architecture, architecture)
    try:
        module_name, class_name = _MODELS[hf_name]
    except KeyError:
        raise _unsupported("architecture", architecture) from None
    return getattr(importlib.import_module(module_name), class_name)
