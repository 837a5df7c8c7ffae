"""Phi-3 / Phi-4 against transformers: tiny random-weight ``Phi3Config`` models, one plain (full rotary,
untied, a ``sliding_window`` past its context, as the 128k models have), one with a window of 12 that the
prompts outgrow (Phi-3-mini-4k's 2047, scaled down) and one shaped like Phi-4-mini (partial rotary
0.75: 12 of 16 values per head; LongRoPE with an original context of 32 positions; tied embeddings),
served from an HF directory and from GGUF files written here (float, and on their own blocks through the
native kernels and the one-call native decode step).

Tolerances: float32 logits within rtol 1e-4, atol 1e-5 of transformers' (the conftest batches: decodes,
fresh prefills, a chunk after a cached prefix, a prefix-cache hit across requests), greedy tokens equal;
GGUF blocks within 4% (norm) of the dequantized float reference, as tests/model/test_gguf_quantized.py.

LongRoPE: transformers uses the short factors while a sequence fits the original 32 positions and the long
ones for every position once it is longer; we use one set per model (long when the model's position
table reaches past 32, see tideserve/model/layers/rotary.py). The two agree, and are compared, where every
sequence fits (a model built with ``max_positions=32``: short) and where every sequence is longer than 32
(the loaded model, 128 positions: long); a sequence that crosses 32 while it decodes is where they differ.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar

import gguf
import numpy as np
import pytest
import torch
from gguf_blocks import QTYPE_NAMES, dequantize, finish_gguf, quantize, start_gguf
from transformers import AutoModelForCausalLM, Phi3Config

from tideserve import native
from tideserve.model.layers.linear import Linear
from tideserve.model.llama import LlamaForCausalLM
from tideserve.model.loader import load_model

ORIGINAL = 32  # the longrope model's original context: prompts below and above it
ROTARY_DIM = 12  # 0.75 of head_dim 16
WINDOW = 12  # outgrown by the prefix-hit batch and the greedy run, not by the mixed batch
COMMON: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_hidden_layers": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
VARIANTS: dict[str, Any] = {
    "phi3": lambda: Phi3Config(**COMMON, tie_word_embeddings=False, sliding_window=2047),
    "phi3-window": lambda: Phi3Config(**COMMON, tie_word_embeddings=False, sliding_window=WINDOW),
    "phi4mini-longrope": lambda: Phi3Config(
        **COMMON, tie_word_embeddings=True, sliding_window=None, partial_rotary_factor=0.75,
        original_max_position_embeddings=ORIGINAL,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(ROTARY_DIM // 2)],
                      "long_factor": [2.0 + 1.5 * i for i in range(ROTARY_DIM // 2)]}),
}
needs_native = pytest.mark.skipif(native.load_library() is None, reason="no C compiler to build the kernels")


def tiny_phi3(variant: str) -> tuple[Any, torch.nn.Module]:
    """(config, transformers model) with random weights, norms away from 1 (HF's init would hide mix-ups)."""
    config = VARIANTS[variant]()
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.1)
    return config, hf_model.eval()


def long_batches(mixed_batch: Any) -> tuple[Any, Any]:
    """conftest's batch shapes with every sequence longer than ORIGINAL (transformers' long factors at
    every position): a mixed step and a prefix-cache hit on 8 shared blocks (32 tokens)."""

    class LongMixed(mixed_batch):
        seq_lens: ClassVar[dict[str, int]] = {"A": 36, "B": 36, "C": 38}
        steps: ClassVar[list[list[tuple[str, int, int]]]] = [
            [("A", 0, 34), ("C", 0, 20)],
            [("A", 34, 35), ("B", 0, 35), ("C", 20, 37)],
            [("A", 35, 36), ("B", 35, 36), ("C", 37, 38)],
        ]

    class LongPrefixHit(mixed_batch):
        seq_lens: ClassVar[dict[str, int]] = {"A": 37, "D": 38}
        steps: ClassVar[list[list[tuple[str, int, int]]]] = [
            [("A", 0, 36)],
            [("A", 36, 37), ("D", 32, 37)],
            [("D", 37, 38)],
        ]
        shares: ClassVar[dict[int, tuple[str, str, int]]] = {1: ("A", "D", 8)}

        def __init__(self, vocab_size: int, seed: int = 2) -> None:
            super().__init__(vocab_size, seed)
            self.seqs["D"][:32] = self.seqs["A"][:32]

    return LongMixed, LongPrefixHit


def assert_matches_transformers(model: Any, hf_model: Any, batches: tuple[Any, ...], greedy_tokens: Any,
                                prompt_len: int, steps: int, backend: str) -> None:
    ours, reference = greedy_tokens
    for batch in batches:
        batch(model.arch.vocab_size).assert_matches(model, hf_model, backend=backend)
    prompt = [(7 * i + 3) % model.arch.vocab_size for i in range(prompt_len)]
    assert ours(model, prompt, steps, backend) == reference(hf_model, prompt, steps)


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Path]:
    directory = tmp_path_factory.mktemp(request.param)
    _, hf_model = tiny_phi3(request.param)
    hf_model.save_pretrained(directory)
    return request.param, hf_model, directory


@pytest.mark.parametrize("backend", ["torch", "cpu-native"])
def test_hf_checkpoint_matches_transformers(tiny, backend, mixed_batch, prefix_hit, greedy_tokens, monkeypatch):
    """Fused qkv_proj / gate_up_proj split into our shards; torch rotary (partial: the first 12 values) or
    the native rope_store kernel; plain, short and long rotary tables."""
    if backend == "cpu-native" and native.load_library() is None:
        pytest.skip("no C compiler to build the native kernel")
    if backend == "torch":
        monkeypatch.setattr(native, "load_library", lambda: None)
    name, hf_model, directory = tiny
    model = load_model(str(directory), dtype="float32").model
    arch = model.arch
    assert arch.architecture == "Phi3ForCausalLM" and not arch.qkv_bias and not arch.o_bias
    if name.startswith("phi3"):
        assert arch.rotary_dim == arch.head_dim == 16 and arch.rope_scaling is None
        assert [arch.layer_window(i) for i in range(2)] == ([WINDOW] * 2 if name == "phi3-window" else [0, 0])
        assert_matches_transformers(model, hf_model, (mixed_batch, prefix_hit), greedy_tokens, 9, 12, backend)
        return
    assert arch.rotary_dim == ROTARY_DIM and arch.tie_word_embeddings
    assert arch.rope_scaling["rope_type"] == "longrope"
    assert arch.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    # Every sequence within the original context: a model whose table ends there uses the short factors.
    short = LlamaForCausalLM(arch, max_positions=ORIGINAL)
    short.load_weights(hf_model.state_dict().items())
    assert not torch.allclose(short.rotary.cos_cache, model.rotary.cos_cache[:ORIGINAL])  # the sets differ
    assert_matches_transformers(short, hf_model, (mixed_batch, prefix_hit), greedy_tokens, 9, 12, backend)
    # Every sequence past it: the loaded model (128 positions) uses the long factors at every position.
    assert_matches_transformers(model, hf_model, long_batches(mixed_batch), greedy_tokens, 34, 5, backend)


# ------------------------------------------------------------------------------------------------ GGUF
GGUF_BLOCKS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
               "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
GGUF_GLOBALS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
# legacy formats (blocks of 32 values: rows of 64 and 96 fit); q|k|v and gate|up each stored as one tensor
BLOCKS = {"qkv_proj": "q8_0", "o_proj": "q5_1", "gate_up_proj": "q4_0", "down_proj": "q8_0",
          "embed_tokens": "q8_0", "lm_head": "q5_0"}


def write_phi3_gguf(hf_model: Any, config: Any, path: Path, qtypes: dict[str, str]) -> None:
    """As llama.cpp's converter writes Phi-3: fused attn_qkv and ffn_up, no q/k row permutation,
    rope.dimension_count, and for longrope its factors as tensors with the original context and attention
    factor as metadata. Quantized tensors replace the HF weights by their dequantized values, so the HF
    model stays the file's exact float reference."""
    writer = start_gguf(path, "phi3", config)
    if config.sliding_window:
        writer.add_sliding_window(config.sliding_window)
    rope = config.rope_parameters
    head_dim = config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
    if rope.get("rope_type") == "longrope":
        original = config.original_max_position_embeddings
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name in GGUF_GLOBALS:
                gguf_name = GGUF_GLOBALS[name]
            else:
                _, _, layer, rest = name.split(".", 3)
                module, suffix = rest.rsplit(".", 1)
                gguf_name = f"blk.{layer}.{GGUF_BLOCKS[module]}.{suffix}"
            w = param.numpy()
            qtype = qtypes.get(name.split(".")[-2], "f32") if w.ndim == 2 else "f32"
            if qtype == "f32":
                writer.add_tensor(gguf_name, w.astype(np.float32))
                continue
            data = quantize(w, qtype)
            param.copy_(torch.from_numpy(dequantize(data, qtype)))
            writer.add_tensor(gguf_name, data, raw_dtype=QTYPE_NAMES[qtype])
    finish_gguf(writer)


@needs_native
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_float_gguf_matches_transformers(variant, tmp_path, mixed_batch, prefix_hit, greedy_tokens):
    """rope.dimension_count, the longrope factor tensors and attn_factor are read back (the model's table
    of 128 positions: long factors), the fused tensors load by shard, and nothing is permuted."""
    config, hf_model = tiny_phi3(variant)
    path = tmp_path / f"{variant}.gguf"
    write_phi3_gguf(hf_model, config, path, {})
    model = load_model(str(path), dtype="float32", quantization="none").model
    arch = model.arch
    assert arch.architecture == "Phi3ForCausalLM" and arch.tie_word_embeddings == config.tie_word_embeddings
    if variant.startswith("phi3"):
        assert arch.rotary_dim == 16 and arch.rope_scaling is None
        assert arch.sliding_window == (WINDOW if variant == "phi3-window" else None)
        assert_matches_transformers(model, hf_model, (mixed_batch, prefix_hit), greedy_tokens, 9, 12, "cpu-native")
        return
    assert arch.rotary_dim == ROTARY_DIM and arch.rope_scaling["rope_type"] == "longrope"
    assert arch.rope_scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(32)))
    assert_matches_transformers(model, hf_model, long_batches(mixed_batch), greedy_tokens, 34, 5, "cpu-native")


@needs_native
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gguf_blocks_on_the_native_decode_step(variant, tmp_path, mixed_batch, prefix_hit):
    """The fused tensors' blocks split by rows into the shards, the file's bytes kept; decode-only steps run
    in the one native call (partial rotary included), equal bit for bit to the Python layer loop over the
    same kernels, and every step stays within 4% of the float reference."""
    config, hf_model = tiny_phi3(variant)
    path = tmp_path / f"{variant}-blocks.gguf"
    write_phi3_gguf(hf_model, config, path, BLOCKS)
    ref = load_model(str(path), dtype="float32", quantization="none").model
    model = load_model(str(path), quantization="gguf").model
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.qweight.qtypes == ["q8_0"]
    assert layer.mlp.gate_up_proj.qweight.qtypes == ["q4_0"]
    assert all(m.weight is None for m in model.modules() if isinstance(m, Linear))
    fast = model.native_decode
    assert fast is not None
    calls: list[bool] = []
    model.native_decode = lambda *a: calls.append(fast(*a)) or calls[-1]
    batches = (mixed_batch, prefix_hit) if variant.startswith("phi3") else long_batches(mixed_batch)
    with_native = [batch(model.arch.vocab_size).ours(model, backend="cpu-native") for batch in batches]
    # Each batch's last step is all decodes; with a window, only contexts within it (the mixed batch's 11
    # keys at most, not the prefix hit's 14) take the native call, which attends every key.
    assert calls == [False, False, True] + [False, False, variant != "phi3-window"]
    model.native_decode = None
    python_loop = [batch(model.arch.vocab_size).ours(model, backend="cpu-native") for batch in batches]
    for batch, got_steps, loop_steps in zip(batches, with_native, python_loop, strict=True):
        want_steps = batch(model.arch.vocab_size).ours(ref, backend="cpu-native")
        for got, loop, want in zip(got_steps, loop_steps, want_steps, strict=True):
            assert torch.equal(got, loop)
            assert (got - want).norm() < 0.04 * want.norm()


def test_gguf_phi3_metadata_keys_are_llama_cpps() -> None:
    """The keys read for longrope are the ones gguf-py (llama.cpp's writer) names."""
    assert gguf.Keys.Rope.SCALING_ORIG_CTX_LEN.format(arch="phi3") == "phi3.rope.scaling.original_context_length"
    assert gguf.Keys.Rope.SCALING_ATTN_FACTOR.format(arch="phi3") == "phi3.rope.scaling.attn_factor"
    assert gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_LONG] + ".weight" == "rope_factors_long.weight"
