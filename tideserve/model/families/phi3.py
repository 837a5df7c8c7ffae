"""Phi-3 / Phi-3.5 / Phi-4 (``Phi3ForCausalLM``): the Llama model class with no biases, checkpoints that
store q|k|v and gate|up fused (split into the model's shards on load), partial rotary (Phi-4-mini rotates
96 of each head's 128 values) and LongRoPE scaling (``rope_type`` "longrope", see layers/rotary.py for
how short and long factors are chosen).

GGUF: llama.cpp keeps the fused ``attn_qkv`` and ``ffn_up`` (gate rows, then up rows) tensors, converts
without its q/k row permutation (Phi-3 rotates NEOX-style, as HF does), and writes longrope's factors as
``rope_factors_long``/``rope_factors_short`` tensors (read into ``ArchConfig.rope_scaling``).

Sliding window: the 4k Phi-3-mini/medium configs carry ``sliding_window: 2047`` (no
``use_sliding_window``; the 128k models' windows exceed their context, Phi-4's is null). As transformers,
vLLM and llama.cpp do, every layer attends the last ``sliding_window`` keys (a window that reaches past the
context changes nothing and is dropped). GGUF files carry it as ``phi3.attention.sliding_window``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from tideserve.model.families import llama
from tideserve.model.registry import GGUFTensorMap, ModelFamily

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
    return {"qkv_bias": False, "o_bias": False,
            **_window(config.get("sliding_window"), config.get("max_position_embeddings"),
                      config.get("num_hidden_layers"))}


def gguf_metadata_fields(get: Callable[[str, Any], Any]) -> dict[str, Any]:
    return _window(get("{arch}.attention.sliding_window", None), get("{arch}.context_length", None),
                   get("{arch}.block_count", None))


def _window(window: Any, context: Any, layers: Any) -> dict[str, Any]:
    """The same window on every layer, or none when it reaches past the context (it would mask nothing)."""
    if not window or (context and int(window) >= int(context)):
        return {}
    return {"sliding_window": int(window), "sliding_layers": [True] * int(layers)}


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
    gguf_metadata_fields=gguf_metadata_fields,
)
