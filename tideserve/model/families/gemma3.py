"""Gemma 3 (text): Gemma 2's layers (families/gemma2.py) with per-head q/k norms, five sliding-window
layers to each global one, the sliding layers on their own unscaled rotary base (``rope_local_base_freq``,
10000) and the global ones on ``rope_theta`` with its scaling; no attention soft-capping (transformers'
Gemma 3 attention never applies ``attn_logit_softcapping``)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from tideserve.model.families import gemma2
from tideserve.model.registry import ModelFamily

LOCAL_THETA = 10000.0  # rope_local_base_freq's default, and what llama.cpp assumes for Gemma 3 files


def hf_config_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    params = config.get("rope_parameters")
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    theta = (local or {}).get("rope_theta") or config.get("rope_local_base_freq") or LOCAL_THETA
    if local and local.get("rope_type", "default") != "default":
        raise ValueError(f"Gemma 3 sliding-layer rope_type {local['rope_type']!r} is not supported")
    return {**gemma2.common_hf_fields(config, 6), "qk_norm": True, "rope_local_theta": float(theta)}


def gguf_config_fields(tensors: Collection[str]) -> dict[str, Any]:
    return {**gemma2.gguf_config_fields(tensors), "qk_norm": True}


def gguf_metadata_fields(get: Callable[[str, Any], Any]) -> dict[str, Any]:
    return {**gemma2.common_gguf_metadata(get, 6, 62),
            "rope_local_theta": float(get("{arch}.rope.freq_base_swa", LOCAL_THETA))}


FAMILY = ModelFamily(
    name="gemma3",
    model_class="tideserve.model.gemma:GemmaForCausalLM",
    hf_architectures=("Gemma3ForCausalLM",),
    gguf_architectures={"gemma3": "Gemma3ForCausalLM"},
    model_types={"gemma3_text": "Gemma3ForCausalLM"},
    gguf_tensors=gemma2.GGUF_TENSORS,
    hf_config_fields=hf_config_fields,
    gguf_config_fields=gguf_config_fields,
    gguf_metadata_fields=gguf_metadata_fields,
)
