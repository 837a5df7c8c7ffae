"""Qwen2 / Qwen2.5: the Llama model class and tensor names, with a bias on q, k and v (never on o), and
GGUF files converted without llama.cpp's q/k row permutation (so nothing is permuted back)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tideserve.model.families.llama import GGUF_TENSORS, gguf_config_fields
from tideserve.model.registry import ModelFamily


def hf_config_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen2 always has q/k/v biases and no o bias, whatever ``attention_bias`` says."""
    return {"qkv_bias": True, "o_bias": False}


FAMILY = ModelFamily(
    name="qwen2",
    model_class="tideserve.model.llama:LlamaForCausalLM",
    hf_architectures=("Qwen2ForCausalLM", "Qwen2Model"),  # Qwen2Model: an embedding model's checkpoint
    gguf_architectures={"qwen2": "Qwen2ForCausalLM"},
    model_types={"qwen2": "Qwen2ForCausalLM"},
    gguf_tensors=GGUF_TENSORS,
    hf_config_fields=hf_config_fields,
    gguf_config_fields=gguf_config_fields,
)
