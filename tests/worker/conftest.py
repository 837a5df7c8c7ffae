"""Tiny random-weight Llama, Qwen2, Qwen3, Phi-3, Mixtral and Qwen3-MoE checkpoints for the tensor-parallel
tests, saved by transformers (so a rank process can load them from disk), and the embedded model's tokenizer
to drive them by token ids."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

COMMON: dict[str, Any] = {"hidden_size": 96, "intermediate_size": 98, "max_position_embeddings": 256,
                          "rms_norm_eps": 1e-5, "num_hidden_layers": 2}
TINY: dict[str, Callable[[], Any]] = {}


def _configs() -> dict[str, Callable[[], Any]]:
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    return {
        # 4 KV heads: 2 per rank; an odd vocabulary and MLP size: the last rank's slices are shorter
        "llama-kv4-untied": lambda: LlamaConfig(**COMMON, vocab_size=131, num_attention_heads=8,
                                                num_key_value_heads=4, tie_word_embeddings=False),
        # 1 KV head on 2 ranks: replicated, each rank keeps half of its query heads
        "llama-kv1-tied": lambda: LlamaConfig(**COMMON, vocab_size=128, num_attention_heads=6,
                                              num_key_value_heads=1, tie_word_embeddings=True),
        # 3 KV heads on 2 ranks (as SmolLM2-135M): whole KV groups, 2 + 1; q/k/v biases
        "qwen2-kv3-bias": lambda: Qwen2Config(**COMMON, vocab_size=130, num_attention_heads=6,
                                              num_key_value_heads=3, tie_word_embeddings=False),
        # per-head q/k norms, whole on every rank; head_dim 32, not hidden / heads (24); q/k/v/o biases
        "qwen3-kv2-bias": lambda: Qwen3Config(**COMMON, vocab_size=129, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=32, attention_bias=True, tie_word_embeddings=False),
        # fused qkv / gate_up checkpoints split by shard, then by rank; partial rotary (12 of 24) with longrope
        "phi3-kv2-longrope": lambda: Phi3Config(
            **COMMON, vocab_size=127, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=None, partial_rotary_factor=0.5,
            original_max_position_embeddings=32,
            rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(6)],
                          "long_factor": [2.0 + 1.5 * i for i in range(6)]}),
        # experts: every expert's MLP split across the ranks (98 per expert: 49 + 49), the router whole
        "mixtral-e4-top2": lambda: MixtralConfig(**COMMON, vocab_size=128, num_attention_heads=4,
                                                 num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
        # a dense first layer beside a sparse one; an odd expert MLP size (33: 17 + 16); no renormalisation
        "qwen3moe-dense0": lambda: Qwen3MoeConfig(**COMMON, vocab_size=129, num_attention_heads=4,
                                                  num_key_value_heads=2, head_dim=32, num_experts=4,
                                                  num_experts_per_tok=2, moe_intermediate_size=33,
                                                  mlp_only_layers=[0], norm_topk_prob=False),
        # Gemma 3: its own layers, sliding windows (8) that the prompts outgrow, the soft-capped logits
        "gemma3-kv2-window": lambda: Gemma3TextConfig(**COMMON, vocab_size=129, num_attention_heads=4,
                                                      num_key_value_heads=2, head_dim=32, sliding_window=8,
                                                      final_logit_softcapping=5.0),
    }


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Callable[[str], Path]:
    """``tiny_checkpoint(name) -> directory`` of a saved random model (names: see ``_configs``)."""
    from transformers import AutoModelForCausalLM

    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            config = _configs()[name]()
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in pname else p.normal_(0.0, 0.15)
            directory = tmp_path_factory.mktemp(name)
            model.save_pretrained(directory)
            made[name] = directory
        return made[name]

    return make


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path):
    from tideserve.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(str(smollm2_gguf_path))
