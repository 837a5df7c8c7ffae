"""Gemma 2: ``tideserve.model.gemma.GemmaForCausalLM``, sliding-window and global layers alternating,
soft-capped attention scores and logits, no q/k norms.

What Gemma 2 and Gemma 3 share is read here (gemma3.py builds on it): four RMSNorms per layer, each
multiplying by (1 + w), a GeGLU MLP, embeddings scaled by sqrt(hidden_size), an attention scale of
``query_pre_attn_scalar ** -0.5``, tied embeddings by default. llama.cpp's converter adds the 1 to every
norm weight (so GGUF files store 1 + w) and does not permute Gemma's q/k rows.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from tideserve.model.families import llama
from tideserve.model.registry import GGUFTensorMap, ModelFamily

GGUF_TENSORS = GGUFTensorMap(
    global_names=llama.GGUF_TENSORS.global_names,
    block_names={
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
)

GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def sliding_layers(config: Mapping[str, Any], pattern: int) -> list[bool]:
    """Whether each layer slides: config.json's ``layer_types``, else every layer but each ``pattern``-th
    (``sliding_window_pattern`` where the config has it; Gemma 2 alternates, Gemma 3 has five to one)."""
    types = config.get("layer_types")
    if types:
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise ValueError(f"config.json layer_types {', '.join(unknown)} are not supported")
        return [t == "sliding_attention" for t in types]
    pattern = int(config.get("sliding_window_pattern") or pattern)
    return [bool((i + 1) % pattern) for i in range(int(config["num_hidden_layers"]))]


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def common_hf_fields(config: Mapping[str, Any], pattern: int) -> dict[str, Any]:
    """The fields Gemma 2 and 3 read alike from config.json."""
    if config.get("use_bidirectional_attention"):
        raise ValueError("config.json use_bidirectional_attention=true (an encoder) is not supported")
    activation = config.get("hidden_activation") or config.get("hidden_act") or GELU_TANH[0]
    if activation not in GELU_TANH:
        raise ValueError(f"Gemma hidden_activation {activation!r} is not supported (only {GELU_TANH[0]})")
    window = config.get("sliding_window")
    bias = bool(config.get("attention_bias", False))
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    return {
        "qkv_bias": bias, "o_bias": bias,
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", True)),
        "sliding_window": int(window) if window else None,
        "sliding_layers": sliding_layers(config, pattern) if window else None,
        "query_pre_attn_scalar": float(config.get("query_pre_attn_scalar") or head_dim),
        "final_logit_softcapping": _optional_float(config.get("final_logit_softcapping")),
        "norm_weight_offset": 1.0,
    }


def hf_config_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    return {**common_hf_fields(config, 2),
            "attn_logit_softcapping": _optional_float(config.get("attn_logit_softcapping"))}


def gguf_config_fields(tensors: Collection[str]) -> dict[str, Any]:
    """Tied embeddings and biases are seen in the tensors; the norms hold 1 + w already (offset 0)."""
    return {
        "tie_word_embeddings": "output.weight" not in tensors,
        "qkv_bias": "blk.0.attn_q.bias" in tensors,
        "o_bias": "blk.0.attn_output.bias" in tensors,
        "norm_weight_offset": 0.0,
    }


def common_gguf_metadata(get: Callable[[str, Any], Any], pattern: int, layers_of_27b: int) -> dict[str, Any]:
    """llama.cpp keeps no sliding pattern or query_pre_attn_scalar in Gemma files: as it does, layers slide
    but every ``pattern``-th (unless the file says otherwise), and the scalar is head_dim, but
    hidden / heads for the 27B models (told apart by their layer count)."""
    layers = int(get("{arch}.block_count", 0))
    window = get("{arch}.attention.sliding_window", None)
    file_pattern = get("{arch}.attention.sliding_window_pattern", None)
    if isinstance(file_pattern, (list, tuple)):  # per layer, as newer converters write it
        sliding = [bool(x) for x in file_pattern]
    else:
        every = int(file_pattern or pattern)
        sliding = [bool((i + 1) % every) for i in range(layers)]
    hidden, heads = int(get("{arch}.embedding_length", 0)), int(get("{arch}.attention.head_count", 1))
    head_dim = int(get("{arch}.attention.key_length", hidden // heads))
    return {
        "sliding_window": int(window) if window else None,
        "sliding_layers": sliding if window else None,
        "query_pre_attn_scalar": float(hidden // heads if layers == layers_of_27b else head_dim),
        "final_logit_softcapping": _optional_float(get("{arch}.final_logit_softcapping", None)),
    }


def gguf_metadata_fields(get: Callable[[str, Any], Any]) -> dict[str, Any]:
    return {**common_gguf_metadata(get, 2, 46),
            "attn_logit_softcapping": _optional_float(get("{arch}.attn_logit_softcapping", None))}


FAMILY = ModelFamily(
    name="gemma2",
    model_class="tideserve.model.gemma:GemmaForCausalLM",
    hf_architectures=("Gemma2ForCausalLM",),
    gguf_architectures={"gemma2": "Gemma2ForCausalLM"},
    model_types={"gemma2": "Gemma2ForCausalLM"},
    gguf_tensors=GGUF_TENSORS,
    hf_config_fields=hf_config_fields,
    gguf_config_fields=gguf_config_fields,
    gguf_metadata_fields=gguf_metadata_fields,
)
