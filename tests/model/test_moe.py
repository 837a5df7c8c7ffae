"""Mixtures of experts (Mixtral, Qwen3-MoE; model/moe.py) beyond the HF checkpoints of test_llama_vs_hf.py:
transformers 5's fused 3-D expert parameters, GGUF files with stacked expert tensors (float, and served on
their own blocks through the native kernels), and --quantization int8/int4 of the experts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_blocks import write_tiny_gguf
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from tideserve.model.arch_config import ArchConfig
from tideserve.model.layers.linear import Linear
from tideserve.model.layers.quant.transform import quantize_model
from tideserve.model.layers.quant.weights import Int8Weight, QuantWeight
from tideserve.model.llama import LlamaForCausalLM
from tideserve.model.loader import load_model
from tideserve.model.loader.gguf import read_blocks
from tideserve.model.loader.gguf_index import read_gguf_index
from tideserve.model.moe import SparseMoeBlock
from tideserve.native import quant

COMMON: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 128, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "num_hidden_layers": 2,
}
# name -> (config, GGUF general.architecture): llama.cpp writes Mixtral as a llama file
VARIANTS = {
    "mixtral": (lambda: MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                                      tie_word_embeddings=False, sliding_window=None), "llama"),
    "qwen3moe": (lambda: Qwen3MoeConfig(**COMMON, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=64, mlp_only_layers=[0], norm_topk_prob=True,
                                        tie_word_embeddings=True), "qwen3moe"),
}
# one block format per projection (experts included), so that one file covers several kernels
QTYPES = {"q_proj": "q8_0", "k_proj": "q8_0", "v_proj": "q8_0", "o_proj": "q8_0", "gate_proj": "q8_0",
          "up_proj": "q8_0", "down_proj": "q8_0", "ffn_gate_exps": "q4_0", "ffn_up_exps": "q8_0",
          "ffn_down_exps": "q4_1"}


def hf_tiny(variant: str) -> Any:
    """Random weights with non-trivial norms (HF inits them to 1)."""
    make_config, _ = VARIANTS[variant]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(), attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.1)
    return model.eval()


def moe_blocks(model: torch.nn.Module) -> list[SparseMoeBlock]:
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_expert_parameters_load(variant: str, mixed_batch: Any) -> None:
    """transformers 5 keeps each layer's experts as 3-D ``experts.gate_up_proj`` / ``experts.down_proj``
    (its in-memory state dict): they are split per expert on load and give transformers' logits."""
    hf_model = hf_tiny(variant)
    state = hf_model.state_dict()
    assert any(name.endswith("experts.gate_up_proj") and t.dim() == 3 for name, t in state.items())
    model = LlamaForCausalLM(ArchConfig.from_hf_config(hf_model.config.to_dict()))
    model.load_weights(state.items())
    mixed_batch(model.arch.vocab_size).assert_matches(model, hf_model)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gguf_matches_transformers(variant: str, tmp_path: Path, mixed_batch: Any, prefix_hit: Any,
                                   greedy_tokens: Any) -> None:
    """A GGUF file with stacked expert tensors (block-quantized), dequantized to float32: transformers'
    logits (rtol 1e-4, atol 1e-5) over the mixed batch and a prefix-cache hit, and its greedy tokens."""
    hf_model = hf_tiny(variant)
    _, arch = VARIANTS[variant]
    path = tmp_path / f"tiny-{variant}.gguf"
    write_tiny_gguf(hf_model, hf_model.config, path, arch, QTYPES)  # hf_model now holds the file's values

    loaded = load_model(str(path), dtype="float32", quantization="none")
    a = loaded.arch
    assert a.architecture == ("MixtralForCausalLM" if variant == "mixtral" else "Qwen3MoeForCausalLM")
    assert (a.num_experts, a.num_experts_per_tok, a.norm_topk_prob) == (4, 2, True)
    assert a.moe_intermediate_size == (128 if variant == "mixtral" else 64)
    assert a.dense_layers == (() if variant == "mixtral" else (0,))  # qwen3moe: layer 0 has no router tensor
    mixed_batch(a.vocab_size).assert_matches(loaded.model, hf_model)
    prefix_hit(a.vocab_size).assert_matches(loaded.model, hf_model)
    ours, reference = greedy_tokens
    prompt = [(5 * i + 1) % a.vocab_size for i in range(9)]
    assert ours(loaded.model, prompt, 12) == reference(hf_model, prompt, 12)


@pytest.mark.skipif(not quant.available(), reason="no C compiler to build the kernels")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gguf_experts_served_on_their_own_blocks(variant: str, tmp_path: Path, mixed_batch: Any, prefix_hit: Any,
                                                 paged_cache: Any) -> None:
    """quantization="gguf": each expert is its slice of the file's stacked blocks, byte for byte, multiplied
    by the native kernels; the router stays float; the native decode step (dense MLPs only) is refused, so
    decode steps take the Python path."""
    hf_model = hf_tiny(variant)
    _, arch = VARIANTS[variant]
    path = tmp_path / f"tiny-{variant}.gguf"
    write_tiny_gguf(hf_model, hf_model.config, path, arch, QTYPES)
    ref = load_model(str(path), dtype="float32", quantization="none").model
    model = load_model(str(path), dtype="auto", quantization="gguf").model
    assert model.native_decode is None
    assert all(m.weight is None and isinstance(m.qweight, QuantWeight) for m in model.modules()
               if isinstance(m, Linear))
    tensors = {t.name: t for t in read_gguf_index(str(path)).tensors}
    block = moe_blocks(model)[-1]
    layer = model.arch.num_hidden_layers - 1
    down = read_blocks(tensors[f"blk.{layer}.ffn_down_exps.weight"])
    rows = block.experts[2].down_proj.qweight.out_features
    assert block.experts[2].down_proj.qweight.qtypes == ["q4_1"]
    assert torch.equal(block.experts[2].down_proj.qweight.file_segments()[0][1], down[2 * rows:3 * rows])
    assert block.experts[0].gate_up_proj.qweight.qtypes == ["q4_0", "q8_0"]
    assert block.gate.weight.dtype == torch.float32

    # Each logit row within 5% of the float reference's (2-3% measured: the kernels round activations to 8
    # bits per block), at 90% of the rows of every step (prefills and decodes, mixed and with a
    # prefix-cache hit): a token whose 2nd and 3rd routing probabilities nearly tie may reach another
    # expert once its activations are rounded (one of 40 rows does in the mixtral variant, 25% off).
    errors = []
    for batch in (mixed_batch, prefix_hit):
        b = batch(model.arch.vocab_size)
        for got, want in zip(b.ours(model, backend="cpu-native"), b.ours(ref, backend="cpu-native"), strict=True):
            errors.append((got - want).norm(dim=-1) / want.norm(dim=-1))
    errors = torch.cat(errors)
    assert (errors < 0.05).float().mean() >= 0.9 and errors.median() < 0.04, errors
    # Teacher-forced, the first-ranked token agrees at >= 80% of the positions
    tokens = [(7 * i + 3) % model.arch.vocab_size for i in range(32)]
    top = []
    for m in (model, ref):
        cache = paged_cache(m.arch, num_blocks=32, block_size=4, backend="cpu-native")
        ids, positions, meta = cache.step([("r", tokens)])
        top.append(m.compute_logits(m(ids, positions, cache.kv_caches, meta)).argmax(-1))
    assert (top[0] == top[1]).float().mean() >= 0.8


def save_hf(hf_model: Any, directory: Path) -> Path:
    directory.mkdir()
    hf_model.save_pretrained(directory)
    return directory


@pytest.mark.skipif(not quant.available(), reason="no C compiler to build the kernels")
def test_int4_and_int8_quantize_the_experts_but_not_the_router(tmp_path: Path, mixed_batch: Any) -> None:
    """--quantization int4 (at load) and int8 (after it) quantize every expert like any linear layer; the
    router stays float (a quantized router would move tokens between experts)."""
    hf_model = hf_tiny("qwen3moe")
    directory = save_hf(hf_model, tmp_path / "tiny-qwen3moe")
    ref = load_model(str(directory), dtype="float32", quantization="none").model
    int4 = load_model(str(directory), quantization="int4").model
    int8, _ = quantize_model(ref, "int8", torch.device("cpu"))
    # Bounds on each step's logits: 4-bit weights rounded from random Gaussian floats (a worst case for 16
    # levels), two layers deep, are 15-47% off per row, as a dense Qwen3 of these shapes is; int8 about 5%.
    for model, kind, bound in ((int4, QuantWeight, 0.4), (int8, Int8Weight, 0.08)):
        experts = [m for block in moe_blocks(model) for m in block.experts.modules() if isinstance(m, Linear)]
        assert len(experts) == 4 * 2 and all(m.weight is None and isinstance(m.qweight, kind) for m in experts)
        assert all(block.gate.weight.dtype == torch.float32 for block in moe_blocks(model))
        batch = mixed_batch(model.arch.vocab_size)
        for got, want in zip(batch.ours(model), batch.ours(ref), strict=True):
            assert (got - want).norm() < bound * want.norm()


def test_tensor_parallel_needs_an_expert_mlp_per_rank() -> None:
    from tideserve.model.tensor_parallel import check_tensor_parallel

    config = json.loads(Qwen3MoeConfig(**{**COMMON, "num_attention_heads": 4}, head_dim=32, num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=1).to_json_string())
    arch = ArchConfig.from_hf_config(config)
    check_tensor_parallel(arch, 1, "none")
    with pytest.raises(ValueError, match="expert MLP size"):
        check_tensor_parallel(arch, 2, "none")


def test_a_checkpoint_without_an_expert_is_refused() -> None:
    hf_model = hf_tiny("mixtral")
    model = LlamaForCausalLM(ArchConfig.from_hf_config(hf_model.config.to_dict()))
    weights = [(n, t) for n, t in hf_model.state_dict().items() if "layers.1.mlp.experts.down_proj" not in n]
    with pytest.raises(ValueError, match=r"missing 4 tensors: model\.layers\.1\.mlp\.experts\.0\.down_proj"):
        model.load_weights(weights)
