"""GGUF loading on files we write ourselves: every quantization the gguf package can produce, llama's Q/K
row permutation (undone by the loader) and qwen2's and qwen3's absence of it, qwen3's q/k norm tensors,
metadata -> ArchConfig."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_blocks import finish_gguf, gguf_name, llama_cpp_permute, start_gguf
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from tideserve.model.loader import load_model
from tideserve.model.loader.gguf import dequantize_tensor, hf_name, unpermute_qk
from tideserve.model.loader.gguf_index import read_gguf_index

COMMON: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "num_hidden_layers": 2,
}

# one quantization per projection so that a single file covers them all
QTYPES = {
    "embed_tokens": Q.Q8_0, "q_proj": Q.Q8_0, "k_proj": Q.Q4_0, "v_proj": Q.Q5_0, "o_proj": Q.Q4_1,
    "gate_proj": Q.Q5_1, "up_proj": Q.BF16, "down_proj": Q.F16, "lm_head": Q.Q8_0,
}
def write_gguf(hf_model: Any, config: Any, path: Path, arch: str) -> None:
    """Export like llama.cpp would; the HF model's weights are replaced by their dequantized values so
    both sides compute with identical numbers."""
    writer = start_gguf(path, arch, config)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            w = param.numpy()
            if w.ndim == 1:
                writer.add_tensor(gguf_name(name), w.astype(np.float32))
                continue
            qtype = QTYPES[name.split(".")[-2]]
            param.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)))
            w = param.numpy()
            if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
                w = llama_cpp_permute(w, heads)
            data = gguf.quants.quantize(w, qtype)
            writer.add_tensor(gguf_name(name), data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    finish_gguf(writer)


# name -> (config, GGUF general.architecture)
VARIANTS = {
    "llama": (lambda: LlamaConfig(**COMMON, tie_word_embeddings=False,
                                  rope_scaling={"rope_type": "linear", "factor": 2.0}), "llama"),
    "qwen2": (lambda: Qwen2Config(**COMMON, tie_word_embeddings=True), "qwen2"),
    # head_dim 32 (not hidden / heads), told by qwen3.attention.key_length
    "qwen3-bias": (lambda: Qwen3Config(**COMMON, head_dim=32, attention_bias=True, tie_word_embeddings=False),
                   "qwen3"),
    "qwen3-tied": (lambda: Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True), "qwen3"),
}
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gguf_matches_transformers(variant: str, tmp_path: Path, mixed_batch: Any, prefix_hit: Any,
                                   greedy_tokens: Any) -> None:
    """The file's weights dequantized to float32: transformers' logits (rtol 1e-4, atol 1e-5) over the
    mixed batch and a prefix-cache hit, and its greedy tokens."""
    make_config, arch = VARIANTS[variant]
    config = make_config()
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    hf_model.eval()
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.1)
    path = tmp_path / f"tiny-{variant}.Q8_0.gguf"
    write_gguf(hf_model, config, path, arch)

    loaded = load_model(str(path), dtype="float32")
    assert loaded.name == f"tiny-{variant}.Q8_0" and loaded.path == str(path)
    a = loaded.arch
    attention_bias = getattr(config, "attention_bias", False)
    assert a.architecture == HF_ARCHITECTURES[arch]
    assert (a.hidden_size, a.intermediate_size, a.num_hidden_layers, a.vocab_size) == (64, 96, 2, 256)
    assert (a.num_attention_heads, a.num_key_value_heads) == (4, 2)
    assert a.head_dim == (32 if arch == "qwen3" else 16) and a.qk_norm == (arch == "qwen3")
    assert a.qkv_bias == (arch == "qwen2" or attention_bias) and a.o_bias == (arch != "qwen2" and attention_bias)
    assert a.tie_word_embeddings == config.tie_word_embeddings
    assert a.bos_token_id == 1 and a.eos_token_ids == [2] and a.max_position_embeddings == 128
    assert a.rope_scaling == ({"rope_type": "linear", "factor": 2.0} if arch == "llama" else None)
    mixed_batch(a.vocab_size).assert_matches(loaded.model, hf_model)
    prefix_hit(a.vocab_size).assert_matches(loaded.model, hf_model)
    ours, reference = greedy_tokens
    prompt = [(5 * i + 1) % a.vocab_size for i in range(9)]
    assert ours(loaded.model, prompt, 12) == reference(hf_model, prompt, 12)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.F16, Q.BF16])
def test_dequantize_round_trip(qtype: Q, tmp_path: Path) -> None:
    """A tensor quantized with the gguf package comes back in [out, in] shape within the format's error."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    path = tmp_path / "one.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    data = gguf.quants.quantize(w, qtype)
    writer.add_tensor("blk.0.attn_q.weight", data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = read_gguf_index(str(path)).tensors
    got = dequantize_tensor(tensor)
    assert got.shape == (8, 64) and got.dtype == torch.float32
    tol = {Q.Q8_0: 0.02, Q.Q4_0: 0.3, Q.Q4_1: 0.3, Q.Q5_0: 0.15, Q.F16: 2e-3, Q.BF16: 2e-2}[qtype]
    assert (got - torch.from_numpy(w)).abs().max() < tol


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(6 * 16 * 3, dtype=np.float32).reshape(6 * 16, 3)
    for heads in (6, 2):
        permuted = torch.from_numpy(llama_cpp_permute(w, heads))
        assert not torch.equal(permuted, torch.from_numpy(w))
        assert torch.equal(unpermute_qk(permuted, heads), torch.from_numpy(w))


def test_unknown_tensor_name_is_an_error() -> None:
    assert hf_name("blk.3.ffn_up.weight") == "model.layers.3.mlp.up_proj.weight"
    with pytest.raises(ValueError, match=r"blk\.0\.attn_qkv\.weight"):
        hf_name("blk.0.attn_qkv.weight")


def test_a_part_of_a_split_file_is_named_as_such(tmp_path: Path) -> None:
    """llama.cpp's gguf-split writes parts that each hold some tensors: the error says what the file is."""
    path = tmp_path / "model-00001-of-00002.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint16("split.no", 0)
    writer.add_uint16("split.count", 2)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="part 1 of a GGUF split into 2 files; merge them"):
        load_model(str(path), quantization="none")
