"""Qwen3 (dense): the Llama model class with an RMSNorm over each q and k head before rotary (``qk_norm``),
an explicit ``head_dim`` (often not hidden_size / heads), and Llama's ``attention_bias`` (q, k, v and o
alike). llama.cpp converts Qwen3 as Qwen2, without its q/k row permutation, so nothing is permuted back.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from tideserve.model.families import llama
from tideserve.model.registry import GGUFTensorMap, ModelFamily

GGUF_TENSORS = GGUFTensorMap(
    global_names=llama.GGUF_TENSORS.global_names,
    block_names={**llama.GGUF_TENSORS.block_names,
                 "attn_q_norm": "self_attn.q_norm",
                 "attn_k_norm": "self_attn.k_norm"},
    skipped=llama.GGUF_TENSORS.skipped,
)


def hf_config_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """Every Qwen3 layer has q/k norms; ``attention_bias`` is Llama's (q, k, v and o)."""
    return {**llama.hf_config_fields(config), "qk_norm": True}


def gguf_config_fields(tensors: Collection[str]) -> dict[str, Any]:
    """As Llama's; a file without the norms then fails to load, naming the missing tensors."""
    return {**llama.gguf_config_fields(tensors), "qk_norm": True}


FAMILY = ModelFamily(
    name="qwen3",
    model_class="tideserve.model.llama:LlamaForCausalLM",
    hf_architectures=("Qwen3ForCausalLM", "Qwen3Model"),  # Qwen3Model: an embedding model's checkpoint
    gguf_architectures={"qwen3": "Qwen3ForCausalLM"},
    model_types={"qwen3": "Qwen3ForCausalLM"},
    gguf_tensors=GGUF_TENSORS,
    hf_config_fields=hf_config_fields,
    gguf_config_fields=gguf_config_fields,
)
