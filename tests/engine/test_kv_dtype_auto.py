"""The KV cache dtype "auto": the model's dtype, except a GGUF's own blocks (float32 compute) on a CPU with
fast bfloat16, where the cache is bfloat16 (half the bytes large batches read per step)."""

from __future__ import annotations

import torch

from tideserve import native
from tideserve.model.loader import resolve_dtype

SMALL = {"max_model_len": 256, "num_blocks": 32}


def test_gguf_blocks_get_a_bf16_cache_where_bf16_is_fast(make_llm):
    llm = make_llm(**SMALL)  # the embedded Q4_1 file, dtype and quantization auto
    fast_bf16 = resolve_dtype("auto", "cpu") == torch.bfloat16
    if llm.engine.quantization == "gguf":
        want = torch.bfloat16 if fast_bf16 and native.load_library() is not None else torch.float32
        assert llm.engine.dtype == torch.float32 and llm.engine.kv_dtype == want
    else:  # no native kernels: auto dequantizes, and the cache follows the model
        assert llm.engine.kv_dtype == llm.engine.dtype
    out = llm.generate("The capital of France is", None)[0]
    assert out.outputs[0].token_ids


def test_an_explicit_cache_dtype_or_model_dtype_wins(make_llm):
    assert make_llm(**SMALL, kv_cache_dtype="float32").engine.kv_dtype == torch.float32
    llm = make_llm(**SMALL, dtype="float32")  # dequantized: the float reference, cache in the model's dtype
    assert llm.engine.quantization == "none" and llm.engine.kv_dtype == torch.float32
