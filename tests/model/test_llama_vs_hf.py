"""Tiny random-weight checkpoints saved by transformers, loaded through ``load_model``: our logits over a
paged cache must match transformers' full-sequence logits for batches mixing decodes, fresh prefills and
a prefill chunk that follows a prefix cached in an earlier step (the request's own, or another request's
blocks: a prefix-cache hit), and our greedy tokens must be transformers'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from tideserve import native
from tideserve.model.arch_config import ArchConfig
from tideserve.model.llama import LlamaForCausalLM
from tideserve.model.loader import load_model

COMMON: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
}

VARIANTS: dict[str, Any] = {
    "llama-untied-sharded": lambda: LlamaConfig(**COMMON, num_hidden_layers=3, tie_word_embeddings=False),
    "llama3-rope-tied": lambda: LlamaConfig(
        **COMMON, num_hidden_layers=2, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}),
    "llama-linear-rope-bias": lambda: LlamaConfig(
        **COMMON, num_hidden_layers=2, attention_bias=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2-bias": lambda: Qwen2Config(**COMMON, num_hidden_layers=2, tie_word_embeddings=False),
    "qwen2-tied": lambda: Qwen2Config(**COMMON, num_hidden_layers=2, tie_word_embeddings=True),
    "mistral-head-dim": lambda: MistralConfig(**COMMON, num_hidden_layers=2, head_dim=32,
                                              sliding_window=None),
    # Qwen3: per-head q/k norms; head_dim 32, not hidden / heads (16); attention_bias on q, k, v and o
    "qwen3-bias": lambda: Qwen3Config(**COMMON, num_hidden_layers=2, head_dim=32, attention_bias=True,
                                      tie_word_embeddings=False),
    "qwen3-tied": lambda: Qwen3Config(**COMMON, num_hidden_layers=2, head_dim=32, tie_word_embeddings=True),
    # mixtures of experts (model/moe.py): 4 experts, top 2. Mixtral renormalises the top-2 weights.
    "mixtral": lambda: MixtralConfig(**COMMON, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=None),
    # Qwen3-MoE: layer 0 dense (mlp_only_layers, intermediate_size 96), layer 1 experts of 32; both ways of
    # norm_topk_prob
    "qwen3moe-dense0-norm": lambda: Qwen3MoeConfig(
        **COMMON, num_hidden_layers=2, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        mlp_only_layers=[0], norm_topk_prob=True),
    "qwen3moe-unnormalised-tied": lambda: Qwen3MoeConfig(
        **COMMON, num_hidden_layers=2, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=False, tie_word_embeddings=True),
}


def _save_tiny(config: Any, directory: Path, shard: bool) -> torch.nn.Module:
    """Random weights with non-trivial norms and biases (HF inits them to 1 and 0, hiding mix-ups)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(directory, max_shard_size="100KB" if shard else "50GB")
    return model.eval()


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Path]:
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = _save_tiny(VARIANTS[request.param](), directory, shard="sharded" in request.param)
    return request.param, hf_model, directory


@pytest.mark.parametrize("backend", ["torch", "cpu-native"])
def test_logits_match_transformers_mixed_batch(tiny: tuple[str, Any, Path], mixed_batch: Any, backend: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything through torch (a model loaded without the native kernels: torch norms; the torch attention
    backend's gathered, masked decode groups), and through the native kernels (norms bound at load; the
    cpu-native backend's rotary with the cache store and in-place decode attention)."""
    if backend == "cpu-native" and native.load_library() is None:
        pytest.skip("no C compiler to build the native kernel")
    if backend == "torch":
        monkeypatch.setattr(native, "load_library", lambda: None)
    name, hf_model, directory = tiny
    loaded = load_model(str(directory), dtype="float32")
    assert loaded.dtype == torch.float32 and loaded.name == directory.name and loaded.path == str(directory)
    if "sharded" in name:
        assert (directory / "model.safetensors.index.json").is_file()
    assert loaded.arch.tie_word_embeddings == name.endswith("-tied")
    assert (loaded.model.model.norm._kernels is None) == (backend == "torch")
    if name.startswith("qwen3"):
        a = loaded.arch
        assert a.qk_norm and a.head_dim == 32 and a.qkv_bias == a.o_bias == ("bias" in name)
    if name.startswith(("mixtral", "qwen3moe")):
        a = loaded.arch
        assert (a.num_experts, a.num_experts_per_tok) == (4, 2) and a.norm_topk_prob == ("unnormalised" not in name)
        assert a.dense_layers == ((0,) if "dense0" in name else ())
        assert a.moe_intermediate_size == (96 if name == "mixtral" else 32)
    mixed_batch(loaded.arch.vocab_size).assert_matches(loaded.model, hf_model, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "cpu-native"])
def test_prefix_hit_and_greedy_tokens_match_transformers(tiny: tuple[str, Any, Path], prefix_hit: Any,
                                                         greedy_tokens: Any, backend: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A request starting on another's cached blocks gets transformers' logits (rtol 1e-4, atol 1e-5), and
    12 greedy tokens (a prefill, then decodes through the paged cache) are transformers'."""
    if backend == "cpu-native" and native.load_library() is None:
        pytest.skip("no C compiler to build the native kernel")
    if backend == "torch":
        monkeypatch.setattr(native, "load_library", lambda: None)
    _, hf_model, directory = tiny
    model = load_model(str(directory), dtype="float32").model
    prefix_hit(model.arch.vocab_size).assert_matches(model, hf_model, backend=backend)
    ours, reference = greedy_tokens
    prompt = [(7 * i + 3) % model.arch.vocab_size for i in range(9)]
    assert ours(model, prompt, 12, backend) == reference(hf_model, prompt, 12)


def test_a_qwen3_checkpoint_without_its_qk_norms_is_refused() -> None:
    config = Qwen3Config(**COMMON, num_hidden_layers=1, head_dim=32)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = LlamaForCausalLM(ArchConfig.from_hf_config(config.to_dict()))
    weights = [(n, t) for n, t in hf_model.state_dict().items() if "k_norm" not in n]
    with pytest.raises(ValueError, match=r"missing 1 tensors: model\.layers\.0\.self_attn\.k_norm\.weight"):
        model.load_weights(weights)


def test_bfloat16_close_to_float32(tiny: tuple[str, Any, Path], mixed_batch: Any) -> None:
    """bf16 weights, activations and KV cache stay near the float32 result (a smoke test of the casts).

    With experts, a token whose 2nd and 3rd routing probabilities nearly tie (0.0002 apart in one of the
    mixtral variant's tokens) can reach another expert in bf16, and the rows that attend to it follow; so
    there only most rows are held to the bound (a wrong cast would move every row)."""
    _, hf_model, directory = tiny
    model = load_model(str(directory), dtype="bfloat16").model
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    batch = mixed_batch(model.arch.vocab_size)
    rows_close = []
    for got, want in zip(batch.ours(model, torch.bfloat16), batch.reference(hf_model), strict=True):
        assert got.dtype == torch.float32
        if not model.arch.num_experts:
            assert (got - want).abs().max() < 0.1 * want.abs().max()
        rows_close += ((got - want).abs().amax(-1) < 0.1 * want.abs().amax(-1)).tolist()
    assert sum(rows_close) >= 0.7 * len(rows_close)
