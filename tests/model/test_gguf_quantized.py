"""GGUF files served on their own blocks (``quantization="gguf"``, what ``auto`` picks for quantized files)
and float checkpoints quantized layer by layer at load (``int4``): the blocks are the file's bytes, no
float weight is kept, and the outputs follow the float (dequantized) reference within stated bounds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_blocks import write_tiny_gguf
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from tideserve.model.layers.linear import Linear
from tideserve.model.layers.quant.weight_bytes import model_weight_bytes
from tideserve.model.layers.quant.weights import QuantWeight
from tideserve.model.loader import load_model
from tideserve.model.loader.gguf import read_blocks, unpermute_qk
from tideserve.model.loader.gguf_index import read_gguf_index
from tideserve.native import quant

pytestmark = pytest.mark.skipif(not quant.available(), reason="no C compiler to build the kernels")

COMMON: dict[str, Any] = {
    "vocab_size": 320, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "num_hidden_layers": 2,
}
# K-quants need rows of 256: every projection of these models qualifies. v differs from q and k, so the
# fused q|k|v has two formats (as llama.cpp's Q4_K_M files have).
K_QUANTS = {"q_proj": "q4_k", "k_proj": "q4_k", "v_proj": "q6_k", "o_proj": "q5_k", "gate_proj": "q4_k",
            "up_proj": "q4_k", "down_proj": "q6_k", "embed_tokens": "q8_0", "lm_head": "q6_k"}
LEGACY = {"q_proj": "q5_0", "k_proj": "q5_0", "v_proj": "q8_0", "o_proj": "q4_1", "gate_proj": "q4_0",
          "up_proj": "q5_1", "down_proj": "q4_k", "embed_tokens": "q6_k"}
# The 2- and 3-bit K-quants and the non-linear IQ4 formats (llama.cpp's Q2_K, Q3_K_M and IQ4_XS files mix these).
LOW_BIT = {"q_proj": "iq4_xs", "k_proj": "iq4_xs", "v_proj": "q3_k", "o_proj": "iq4_nl", "gate_proj": "q2_k",
           "up_proj": "q3_k", "down_proj": "iq4_xs", "embed_tokens": "iq4_nl", "lm_head": "q3_k"}
VARIANTS = {
    "llama-kquants": (lambda: LlamaConfig(**COMMON, tie_word_embeddings=False), "llama", K_QUANTS),
    "llama-lowbit": (lambda: LlamaConfig(**COMMON, tie_word_embeddings=False), "llama", LOW_BIT),
    "qwen2-legacy": (lambda: Qwen2Config(**COMMON, tie_word_embeddings=True), "qwen2", LEGACY),
    # q/k norms in the native decode step; head_dim 128, not hidden / heads (64); q, k, v and o biases
    "qwen3-kquants": (lambda: Qwen3Config(**COMMON, head_dim=128, attention_bias=True, tie_word_embeddings=True),
                      "qwen3", K_QUANTS),
}


def tiny_gguf(variant: str, path: Path) -> tuple[Path, Any]:
    """(the file, the transformers model holding its weights dequantized: the file's exact float reference)."""
    make_config, arch, qtypes = VARIANTS[variant]
    config = make_config()
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.08)
    file = path / f"tiny-{variant}.gguf"
    write_tiny_gguf(hf_model, config, file, arch, qtypes)
    return file, hf_model.eval()


def logits(model: torch.nn.Module, batch: Any) -> list[torch.Tensor]:
    """Each step's logits of a conftest batch (``mixed_batch`` or ``prefix_hit``) on the native kernels."""
    return batch(model.arch.vocab_size).ours(model, backend="cpu-native")


def top1(model: torch.nn.Module, paged_cache: Any, tokens: list[int]) -> list[int]:
    """The model's first-ranked next token at every position of ``tokens`` (one prefill)."""
    cache = paged_cache(model.arch, num_blocks=32, block_size=4, backend="cpu-native")
    ids, positions, meta = cache.step([("r", tokens)])
    return model.compute_logits(model(ids, positions, cache.kv_caches, meta)).argmax(-1).tolist()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gguf_blocks_follow_the_dequantized_reference(variant, tmp_path, mixed_batch, prefix_hit, paged_cache,
                                                      greedy_tokens):
    path, hf_model = tiny_gguf(variant, tmp_path)
    ref = load_model(str(path), dtype="float32", quantization="none").model
    mixed_batch(ref.arch.vocab_size).assert_matches(ref, hf_model, backend="cpu-native")  # the reference's own
    loaded = load_model(str(path), dtype="auto", quantization="gguf")
    model = loaded.model
    assert loaded.quantization == "gguf" and loaded.dtype == torch.float32
    _, _, qtypes = VARIANTS[variant]
    qkv = model.model.layers[0].self_attn.qkv_proj.qweight
    assert qkv.qtypes == [qtypes["q_proj"], qtypes["v_proj"]]
    assert model.model.layers[1].mlp.down_proj.qweight.qtypes == [qtypes["down_proj"]]
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.weight is None and isinstance(m.qweight, QuantWeight) for m in linears)
    assert model.model.embed_tokens.weight is None and model.lm_head_q is not None
    assert model_weight_bytes(model) < 0.3 * model_weight_bytes(ref)
    fast = model.native_decode
    assert fast is not None
    native_steps: list[bool] = []  # whether each step ran in the one native call
    model.native_decode = lambda *a: native_steps.append(fast(*a)) or native_steps[-1]

    # Logits of every step (prefills, chunked prefill, decodes; a prefix-cache hit) stay within 4% of the
    # float reference's (2-3% measured on AVX2); the difference is the kernels' rounding of activations to
    # 8 bits per block (bfloat16 on AMX).
    for batch in (mixed_batch, prefix_hit):
        for got, want in zip(logits(model, batch), logits(ref, batch), strict=True):
            assert (got - want).norm() < 0.04 * want.norm()
    # Greedy decoding through the paged cache: the first 4 tokens are the reference's (and transformers'),
    # and teacher-forced on the reference's 24 greedy tokens, the quantized model ranks the same token first
    # at >= 80% of them (random tiny models have near-ties at the top, where an activation's rounding can
    # flip the choice).
    greedy, hf_greedy = greedy_tokens
    prompt = list(range(5, 17))
    want = greedy(ref, prompt, 24, "cpu-native")
    assert want == hf_greedy(hf_model, prompt, 24)
    assert greedy(model, prompt, 4, "cpu-native") == want[:4]
    assert native_steps.count(True) == 2 + 3  # the decode-only steps: each batch's last, greedy's 3
    ours, reference = top1(model, paged_cache, prompt + want), top1(ref, paged_cache, prompt + want)
    agreement = sum(a == b for a, b in zip(ours, reference))
    assert agreement >= 0.8 * (len(prompt) + len(want)), agreement


def test_embedded_q4_1_file_is_served_on_its_own_bytes(smollm2_gguf_path):
    """The default model under the default quantization: every matrix is the file's blocks, byte for byte
    (llama's q/k rows back in HF order), the tied LM head is the embedding table itself, nothing float."""
    loaded = load_model(str(smollm2_gguf_path), quantization="auto")
    assert loaded.quantization == "gguf"
    model = loaded.model
    tensors = {t.name: t for t in read_gguf_index(str(smollm2_gguf_path)).tensors}
    down = model.model.layers[3].mlp.down_proj.qweight
    assert down.qtypes == ["q4_1"]
    assert torch.equal(down.file_segments()[0][1], read_blocks(tensors["blk.3.ffn_down.weight"]))
    qkv = model.model.layers[3].self_attn.qkv_proj.qweight.file_segments()[0][1]
    q_rows = unpermute_qk(read_blocks(tensors["blk.3.attn_q.weight"]),
                          model.arch.num_attention_heads)
    assert torch.equal(qkv[: q_rows.shape[0]], q_rows)
    table = model.model.embed_tokens.qweight
    assert table.qtypes == ["q8_0"] and model.lm_head_q is table
    assert torch.equal(table.file_segments()[0][1], read_blocks(tensors["token_embd.weight"]))
    assert all(m.weight is None for m in model.modules() if isinstance(m, Linear))
    assert model_weight_bytes(model) < 1.02 * smollm2_gguf_path.stat().st_size


def test_int4_quantizes_an_hf_checkpoint_layer_by_layer(tmp_path, mixed_batch):
    from safetensors.torch import save_file

    config = LlamaConfig(**COMMON, tie_word_embeddings=False)
    torch.manual_seed(1)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.normal_(0.0, 0.08)
    directory = tmp_path / "tiny-hf"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config.to_dict()))
    save_file({k: v.contiguous() for k, v in hf_model.state_dict().items()}, str(directory / "model.safetensors"))

    ref = load_model(str(directory), dtype="float32", quantization="none").model
    loaded = load_model(str(directory), quantization="int4")
    model = loaded.model
    assert loaded.quantization == "int4"
    assert all(m.weight is None and m.qweight.qtypes == ["q4_1"] for m in model.modules() if isinstance(m, Linear))
    assert model.lm_head_q.qtypes == ["q8_0"] and model.lm_head.weight is None
    for got, want in zip(logits(model, mixed_batch), logits(ref, mixed_batch), strict=True):
        # 4-bit weights rounded from random Gaussian floats (a worst case for 16 levels), two layers deep
        assert (got - want).norm() < 0.15 * want.norm()
    # auto leaves a float checkpoint in float; gguf needs a GGUF file.
    assert load_model(str(directory), dtype="float32", quantization="auto").quantization == "none"
    with pytest.raises(ValueError, match="keeps a GGUF file's blocks"):
        load_model(str(directory), quantization="gguf")
