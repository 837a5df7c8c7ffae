"""Llama family: Llama 2/3, Mistral, SmolLM/SmolLM2 (``tideserve.model.llama.LlamaForCausalLM``).

llama.cpp's converter permutes the rows of Q and K for these architectures (to its interleaved rotary
layout); our rotary is HF's rotate-half layout, so the loader permutes them back.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from tideserve.model.registry import GGUFTensorMap, ModelFamily

# llama.cpp's tensor names -> HF Llama checkpoint names (Qwen2 files use the same ones)
GGUF_TENSORS = GGUFTensorMap(
    global_names={
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    },
    block_names={
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    },
    skipped=frozenset({"rope_freqs.weight"}),  # the llama3 rope factors, read into ArchConfig.rope_scaling
)


def hf_config_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """Llama's ``attention_bias`` puts a bias on q, k, v and o alike."""
    bias = bool(config.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias}


def gguf_config_fields(tensors: Collection[str]) -> dict[str, Any]:
    """Biases and tied embeddings are seen in a GGUF file's tensors, not its metadata."""
    return {
        "tie_word_embeddings": "output.weight" not in tensors,
        "qkv_bias": "blk.0.attn_q.bias" in tensors,
        "o_bias": "blk.0.attn_output.bias" in tensors,
    }


def llama_file_fields(tensors: Collection[str]) -> dict[str, Any]:
    """A ``llama`` file's fields; one with stacked expert tensors is Mixtral, which llama.cpp writes as a
    ``llama`` file (families/mixtral.py reads its tensors)."""
    fields = gguf_config_fields(tensors)
    if any(name.endswith(".ffn_gate_exps.weight") for name in tensors):
        fields["architecture"] = "MixtralForCausalLM"
    return fields


FAMILY = ModelFamily(
    name="llama",
    model_class="tideserve.model.llama:LlamaForCausalLM",
    # LlamaModel / MistralModel: embedding models' checkpoints (the transformer without its LM head).
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM", "LlamaModel", "MistralModel"),
    gguf_architectures={"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"},
    model_types={"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"},
    gguf_tensors=GGUF_TENSORS,
    gguf_unpermute={"self_attn.q_proj.weight": "num_attention_heads",
                    "self_attn.k_proj.weight": "num_key_value_heads"},
    hf_config_fields=hf_config_fields,
    gguf_config_fields=llama_file_fields,
)
