"""Gemma 3 (text) and Gemma 2 against transformers: tiny random-weight checkpoints with both layer kinds, a
sliding window of 8 that the batches' contexts outgrow, head_dim != hidden / heads, a query_pre_attn_scalar
that is not head_dim, linear rope scaling on Gemma 3's global layers only, and soft-capping strong enough to
change Gemma 2's scores and logits. Loaded from the HF directory and from a float GGUF file written as
llama.cpp would (norm weights stored as 1 + w), on the torch and CPU-native attention backends: logits over
a mixed prefill/decode batch and a prefix-cache hit whose cached prefix crosses the window, and greedy
tokens from a prompt longer than the window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf_blocks import QTYPE_NAMES, dequantize, finish_gguf, quantize, start_gguf
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig

from tideserve import native
from tideserve.model.arch_config import ArchConfig
from tideserve.model.attention import TritonBackend, backend_for_model, selector
from tideserve.model.gemma import GemmaForCausalLM
from tideserve.model.layers.quant.weights import QuantWeight
from tideserve.model.loader import load_model
from tideserve.native import quant

COMMON: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
    "sliding_window": 8, "query_pre_attn_scalar": 24, "num_hidden_layers": 4,
}
# Gemma 3's five sliding layers to one global, as llama.cpp assumes for its files (which do not list them)
GEMMA3: dict[str, Any] = {**COMMON, "num_hidden_layers": 6}

VARIANTS: dict[str, Any] = {
    "gemma3": lambda: Gemma3TextConfig(
        **GEMMA3, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}),
    "gemma3-untied-capped": lambda: Gemma3TextConfig(
        **GEMMA3, tie_word_embeddings=False, final_logit_softcapping=1.0),
    "gemma2": lambda: Gemma2Config(**COMMON, attn_logit_softcapping=1.0, final_logit_softcapping=1.0),
}
GGUF_ARCH = {"Gemma3ForCausalLM": "gemma3", "Gemma2ForCausalLM": "gemma2"}
GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
GGUF_BLOCK_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _tiny_hf(config: Any) -> torch.nn.Module:
    """Random weights; norm weights around 0 (Gemma's norms multiply by 1 + w)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.1)
    return model.eval()


def write_gemma_gguf(hf_model: Any, config: Any, path: Path, qtypes: dict[str, str] | None = None) -> None:
    """A GGUF file as llama.cpp's converter writes Gemma: norm weights + 1, q/k rows as they are, no sliding
    pattern or query_pre_attn_scalar in the metadata (the loader assumes llama.cpp's). 2-D tensors are
    float32, or in ``qtypes[module suffix]`` blocks: then the HF model's weights become the blocks' values,
    so it stays the file's exact float reference."""
    arch = GGUF_ARCH[config.architectures[0]] if config.architectures else GGUF_ARCH[type(hf_model).__name__]
    writer = start_gguf(path, arch, config, bos=2, eos=1)
    writer.add_sliding_window(config.sliding_window)
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch == "gemma2" and config.attn_logit_softcapping:
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    for name, param in hf_model.named_parameters():
        w = param.detach().numpy().astype(np.float32)
        if name.endswith("norm.weight"):
            w = w + 1.0
        if name in GGUF_NAMES:
            gguf_name = GGUF_NAMES[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, param_name = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{GGUF_BLOCK_NAMES[module]}.{param_name}"
        qtype = (qtypes or {}).get(name.split(".")[-2], "f32") if w.ndim == 2 else "f32"
        if qtype == "f32":
            writer.add_tensor(gguf_name, w)
            continue
        data = quantize(w, qtype)
        with torch.no_grad():
            param.copy_(torch.from_numpy(dequantize(data, qtype)))
        writer.add_tensor(gguf_name, data, raw_dtype=QTYPE_NAMES[qtype])
    finish_gguf(writer)


@pytest.fixture(scope="module", params=[(v, fmt) for v in VARIANTS for fmt in ("hf", "gguf")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, str]:
    variant, fmt = request.param
    directory = tmp_path_factory.mktemp(variant)
    config = VARIANTS[variant]()
    if fmt == "gguf":  # llama.cpp's files have no query_pre_attn_scalar: it takes head_dim
        config.query_pre_attn_scalar = config.head_dim
    hf_model = _tiny_hf(config)
    if fmt == "hf":
        hf_model.save_pretrained(directory)
        return variant, hf_model, str(directory)
    path = directory / f"tiny-{variant}.gguf"
    write_gemma_gguf(hf_model, hf_model.config, path)
    return variant, hf_model, str(path)


def _load(path: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> GemmaForCausalLM:
    if backend == "cpu-native" and native.load_library() is None:
        pytest.skip("no C compiler to build the native kernels")
    if backend == "torch":
        monkeypatch.setattr(native, "load_library", lambda: None)
    model = load_model(path, dtype="float32").model
    assert isinstance(model, GemmaForCausalLM)
    return model


def test_config(tiny: tuple[str, Any, str]) -> None:
    """Both formats give the same ArchConfig but for the norms' stored offset and query_pre_attn_scalar."""
    variant, hf_model, path = tiny
    a = load_model(path, dtype="float32").arch
    config = hf_model.config
    gemma3 = variant.startswith("gemma3")
    # GGUF files carry no query_pre_attn_scalar: as llama.cpp, head_dim (so the GGUF tests set it so)
    assert a.sliding_window == 8 and a.head_dim == 32
    assert a.query_pre_attn_scalar == (32 if path.endswith(".gguf") else 24)
    assert a.sliding_layers == [t == "sliding_attention" for t in config.layer_types]
    assert a.qk_norm == gemma3 and a.tie_word_embeddings == config.tie_word_embeddings
    assert a.rope_local_theta == (10000.0 if gemma3 else None)
    assert (a.rope_scaling or {}).get("factor") == (2.0 if variant == "gemma3" else None)  # global layers only
    assert a.norm_weight_offset == (0.0 if path.endswith(".gguf") else 1.0)
    assert a.final_logit_softcapping == config.final_logit_softcapping
    assert a.attn_logit_softcapping == (None if gemma3 else 1.0)


@pytest.mark.parametrize("backend", ["torch", "cpu-native"])
def test_logits_match_transformers(tiny: tuple[str, Any, str], backend: str, mixed_batch: Any, prefix_hit: Any,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """rtol 1e-4, atol 1e-5 over the mixed batch (contexts up to 11 keys, window 8) and the prefix hit (a
    chunk at positions 8-12 over a shared 8-token prefix: its window starts inside the prefix)."""
    _, hf_model, path = tiny
    model = _load(path, backend, monkeypatch)
    mixed_batch(model.arch.vocab_size).assert_matches(model, hf_model, backend=backend)
    prefix_hit(model.arch.vocab_size).assert_matches(model, hf_model, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "cpu-native"])
def test_greedy_tokens_match_transformers(tiny: tuple[str, Any, str], backend: str, greedy_tokens: Any,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A 20-token prompt (longer than the window) and 12 decodes: transformers' tokens."""
    _, hf_model, path = tiny
    model = _load(path, backend, monkeypatch)
    ours, reference = greedy_tokens
    prompt = [(7 * i + 3) % model.arch.vocab_size for i in range(20)]
    assert ours(model, prompt, 12, backend) == reference(hf_model, prompt, 12)


# As llama.cpp's Q4_K_M Gemma 3 files: q, k, gate and up in Q5_0, v in Q8_0, o in Q4_K, down in Q6_K, the
# (tied) embedding table in Q8_0. K-quants need rows of 256: hidden 256, head_dim 128 (4 heads: q is 512 wide).
QUANT_CONFIG: dict[str, Any] = {**GEMMA3, "hidden_size": 256, "intermediate_size": 512, "head_dim": 128,
                                "query_pre_attn_scalar": 128}
Q4_K_M = {"q_proj": "q5_0", "k_proj": "q5_0", "v_proj": "q8_0", "o_proj": "q4_k", "gate_proj": "q5_0",
          "up_proj": "q5_0", "down_proj": "q6_k", "embed_tokens": "q8_0"}


@pytest.mark.skipif(not quant.available(), reason="no C compiler to build the kernels")
def test_gemma3_on_its_gguf_blocks(tmp_path: Path, mixed_batch: Any, prefix_hit: Any, greedy_tokens: Any) -> None:
    """A block-quantized Gemma 3 file served on its blocks (the native kernels, float32 compute, the Python
    layer loop: the native decode step refuses Gemma) follows the file's float reference: every step's
    logits within 4% (the kernels round activations to 8 bits per block, as for the Llama families), the
    float reference itself equal to transformers, and the first greedy tokens the same."""
    hf_model = _tiny_hf(Gemma3TextConfig(**QUANT_CONFIG))
    path = tmp_path / "tiny-gemma3-q4_k_m.gguf"
    write_gemma_gguf(hf_model, hf_model.config, path, Q4_K_M)
    ref = load_model(str(path), dtype="float32", quantization="none").model
    mixed_batch(ref.arch.vocab_size).assert_matches(ref, hf_model, backend="cpu-native")
    model = load_model(str(path), dtype="auto", quantization="gguf").model
    assert isinstance(model, GemmaForCausalLM) and model.native_decode is None
    assert model.model.layers[0].self_attn.qkv_proj.qweight.qtypes == ["q5_0", "q8_0"]
    assert isinstance(model.model.layers[5].mlp.down_proj.qweight, QuantWeight)
    assert model.model.embed_tokens.weight is None and model.lm_head_q is not None
    for batch in (mixed_batch, prefix_hit):
        b = batch(ref.arch.vocab_size)
        for got, want in zip(b.ours(model, backend="cpu-native"), b.ours(ref, backend="cpu-native"), strict=True):
            assert (got - want).norm() < 0.04 * want.norm()
    ours, reference = greedy_tokens
    prompt = [(7 * i + 3) % ref.arch.vocab_size for i in range(20)]
    want = ours(ref, prompt, 8, "cpu-native")
    assert want == reference(hf_model, prompt, 8)
    assert ours(model, prompt, 4, "cpu-native") == want[:4]


@pytest.mark.parametrize("backend", ["torch", "cpu-native"])
def test_engine_chunked_prefill_and_prefix_cache(backend: str, tmp_path: Path, shared_model: Any,
                                                 greedy_tokens: Any) -> None:
    """Through the engine (scheduler, runner, block manager): 40-token prompts cut into 16-token chunks,
    then a prompt whose first 32 tokens are a cached prefix (blocks of 8, window 8): transformers' greedy
    tokens."""
    if backend == "cpu-native" and native.load_library() is None:
        pytest.skip("no C compiler to build the native kernels")
    from tideserve import LLM, SamplingParams

    hf_model = _tiny_hf(Gemma3TextConfig(**GEMMA3))
    hf_model.save_pretrained(tmp_path)
    tokenizer = shared_model(dtype="float32", quantization="none")[1]  # prompts are token ids
    llm = LLM.from_loaded(load_model(str(tmp_path), dtype="float32"), tokenizer, dtype="float32",
                          attention_backend=backend, max_num_batched_tokens=16, block_size=8,
                          enable_prefix_caching=True, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    first = [(5 * i + 1) % 256 for i in range(40)]
    second = first[:35] + [3, 1, 4, 1, 5]
    _, reference = greedy_tokens
    for prompt, cached in ((first, 0), (second, 32)):
        out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
        assert out.num_cached_tokens == cached
        assert list(out.outputs[0].token_ids) == reference(hf_model, prompt, 10)


def test_the_triton_backend_serves_windowed_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton kernels take the window and the soft-cap (tests/model/attention/triton/), so a Gemma model
    gets the Triton backend when asked for by name and where auto picks it (CUDA), never a substitute."""
    model = GemmaForCausalLM(ArchConfig.from_hf_config(Gemma2Config(**COMMON).to_dict()))
    assert model.arch.sliding_window and model.arch.attn_logit_softcapping
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets the backend be built on the CPU
    if not TritonBackend.available():
        pytest.skip("triton is not installed")
    assert isinstance(backend_for_model("triton", model, torch.float32, "cpu"), TritonBackend)
    monkeypatch.setattr(selector, "select_attention_backend", lambda *_: TritonBackend("cpu"))
    assert isinstance(backend_for_model("auto", model, torch.float32, "cpu"), TritonBackend)
