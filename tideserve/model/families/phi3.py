"""Phi-3 / Phi-3.5 / Phi-4 (``Phi3ForCausalLM``): the Llama model class with no biases, checkpoints that
store q|k|v and gate|up fused (split into the model's shards on load), partial rotary (Phi-4-mini rotates
96 of each head's 128 values) and LongRoPE scaling (``rope_type`` "longrope", see layers/rotary.py for
how short and long factors are chosen).

GGUF: llama.cpp keeps the fused ``attn_qkv`` and ``ffn_up`` (gate rows, then up rows) tensors, converts
without its q/k row permutation (Phi-3 rotates NEOX-style, as HF does), and writes longrope's factors as
``rope_factors_long``/``rope_factors_short`` tensors (read into ``ArchConfig.rope_scaling``).

Sliding window: the 4k Phi-3-mini/medium configs carry ``sliding_window: 2047`` (no
``use_sliding_window``; the 128k models' windows exceed their context, Phi-4's is null). It is not applied
here: attention spans the whole context, where transformers, vLLM and llama.cpp mask keys more than 2047
positions back. Sequences up to the window are unaffected, so ``max_model_len`` <= 2047 serves these
models exactly; a warning says so at load. (Phi-3's window is the same for every layer, so applying it
needs only a windowed attention mask, not per-layer cache layouts.)
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

from tideserve.model.families import llama
from tideserve.model.registry import GGUFTensorMap, ModelFamily

logger = logging.getLogger(__name__)

GGUF_TENSORS = GGUFTensorMap(
    global_names=llama.GGUF_TENSORS.global_names,
    block_names={
        **llama.GGUF_TENSORS.block_names,
        "attn_qkv": "self_attn.qkv_proj",  # [q + 2 kv, hidden], loaded by shard
        "ffn_up": "mlp.gate_up_proj",  # Phi-3 has no ffn_gate: its ffn_up holds gate, then up
    },
    skipped=frozenset({"rope_factors_long.weight", "rope_factors_short.weight"}),  # into rope_scaling
)


def hf_config_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """Phi-3 has no biases; a config asking for one is a model this family does not describe."""
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("Phi-3 checkpoints with attention or MLP biases are not supported")
    window = config.get("sliding_window")
    if window and window < int(config.get("max_position_embeddings", 0)):
        logger.warning("config.json sliding_window=%d is not applied: beyond %d tokens attention spans the whole "
                       "context, unlike the model's training; max_model_len <= %d keeps results exact",
                       window, window, window)
    return {"qkv_bias": False, "o_bias": False}


def gguf_config_fields(tensors: Collection[str]) -> dict[str, Any]:
    return {"tie_word_embeddings": "output.weight" not in tensors}


FAMILY = ModelFamily(
    name="phi3",
    model_class="tideserve.model.llama:LlamaForCausalLM",
    hf_architectures=("Phi3ForCausalLM",),
    gguf_architectures={"phi3": "Phi3ForCausalLM"},
    model_types={"phi3": "Phi3ForCausalLM"},
    gguf_tensors=GGUF_TENSORS,
    hf_config_fields=hf_config_fields,
    gguf_config_fields=gguf_config_fields,
)
