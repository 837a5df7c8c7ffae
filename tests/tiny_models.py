"""Tiny random-weight Llama, Qwen2 and Qwen3 models built in the tests (no files, no network)."""

from __future__ import annotations

import torch

from tideserve.model.arch_config import ArchConfig
from tideserve.model.llama import LlamaForCausalLM


def tiny_llama(qwen2: bool = False, num_layers: int = 2, scale: float = 0.3) -> LlamaForCausalLM:
    """4 query heads over 2 KV heads of 16; Qwen2 has q/k/v biases and an untied LM head. Weights are
    seeded by the kind, so every call builds the same model."""
    arch = ArchConfig(architecture="Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM", vocab_size=96,
                      hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
                      rope_theta=10000.0, tie_word_embeddings=not qwen2, qkv_bias=qwen2)
    model = LlamaForCausalLM(arch)
    g = torch.Generator().manual_seed(int(qwen2))
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def tiny_qwen3(bias: bool = False, num_layers: int = 2, scale: float = 0.3) -> LlamaForCausalLM:
    """Qwen3's per-head q/k norms over 4 query heads and 2 KV heads of 32, a width that is not
    hidden_size / heads (64 / 4), so a size computed from the hidden size shows; an untied LM head;
    ``bias``: attention_bias (q, k, v and o). Seeded by ``bias``, so every call builds the same model."""
    arch = ArchConfig(architecture="Qwen3ForCausalLM", vocab_size=96, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                      tie_word_embeddings=False, qkv_bias=bias, o_bias=bias, qk_norm=True)
    model = LlamaForCausalLM(arch)
    g = torch.Generator().manual_seed(2 + int(bias))
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g) * scale
        p.data.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    return model
