"""The KV cache dtype "auto": the model's dtype, except a GGUF's own blocks (float32 compute) wherever the
native kernels run, where the cache is bfloat16 (half the bytes a decode step reads), whether or not the
CPU has fast bfloat16 arithmetic (AVX2's kernels widen it with a shift)."""

from __future__ import annotations

import pytest
import torch

from tideserve import native
from tideserve.platform import cpu as cpu_platform

SMALL = {"max_model_len": 256, "num_blocks": 32}


@pytest.mark.parametrize("fast_bf16", [True, False], ids=["bf16-cpu", "avx2-only-cpu"])
def test_gguf_blocks_get_a_bf16_cache_wherever_the_kernels_run(make_llm, monkeypatch, fast_bf16):
    monkeypatch.setattr(cpu_platform, "_cpu_has_fast_bf16", lambda: fast_bf16)
    llm = make_llm(**SMALL)  # the embedded Q4_1 file, dtype and quantization auto
    if llm.engine.quantization == "gguf":
        want = torch.bfloat16 if native.load_library() is not None else torch.float32
        assert llm.engine.dtype == torch.float32 and llm.engine.kv_dtype == want
    else:  # no native kernels: auto dequantizes, and the cache follows the model
        assert llm.engine.kv_dtype == llm.engine.dtype
    out = llm.generate("The capital of France is", None)[0]
    assert out.outputs[0].token_ids


def test_an_explicit_cache_dtype_or_model_dtype_wins(make_llm):
    assert make_llm(**SMALL, kv_cache_dtype="float32").engine.kv_dtype == torch.float32
    llm = make_llm(**SMALL, dtype="float32")  # dequantized: the float reference, cache in the model's dtype
    assert llm.engine.quantization == "none" and llm.engine.kv_dtype == torch.float32
