"""The native decode-attention kernel against plain torch attention over each request's gathered keys."""

from __future__ import annotations

import random

import pytest
import torch

from tideserve import native
from tideserve.model.layers.attention import AttentionMetadata, paged_attention

needs_kernel = pytest.mark.skipif(native.load_library() is None, reason="no C compiler to build the kernel")


def make_case(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
              max_context: int, seed: int = 0):
    """Shuffled blocks (paging is real), every context length from 1 up, q strided as the model's is."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    lens = [1, block_size, block_size + 1, max_context] + [rng.randint(1, max_context) for _ in range(num_seqs)]
    lens = lens[:num_seqs]
    width = -(-max(lens) // block_size)
    num_blocks = num_seqs * width + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = torch.zeros(num_seqs, width, dtype=torch.int64)
    for i, n in enumerate(lens):
        for j in range(-(-n // block_size)):
            tables[i, j] = free.pop()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    qkv = torch.randn(num_seqs, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    return qkv[:, :num_heads], k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int64)


def reference(q, k_cache, v_cache, tables, lens, scale):
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape)
    for i, n in enumerate(lens.tolist()):
        keys = k_cache[tables[i]].flatten(0, 1)[:n].repeat_interleave(num_heads // num_kv_heads, dim=1)
        values = v_cache[tables[i]].flatten(0, 1)[:n].repeat_interleave(num_heads // num_kv_heads, dim=1)
        weights = (torch.einsum("hd,thd->ht", q[i].double(), keys.double()) * scale).softmax(-1)
        out[i] = torch.einsum("ht,thd->hd", weights, values.double()).float()
    return out


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [
    (1, 9, 3, 64, 16, 300),   # SmolLM2's heads, one request: its context split into parts, merged
    (2, 9, 3, 64, 16, 1000),  # two long requests: parts of unequal length (the other is 1 token)
    (3, 4, 4, 32, 4, 40),     # multi-head attention
    (20, 8, 2, 16, 8, 130),   # many requests: one task per request
    (5, 6, 1, 64, 1, 50),     # multi-query, block size 1
])
def test_matches_torch_attention(shape, kv_dtype):
    """bfloat16 caches are widened exactly, so both dtypes must match the reference over the same values."""
    q, k_cache, v_cache, tables, lens = make_case(*shape)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    scale = q.shape[-1] ** -0.5
    out = torch.full(q.shape, float("nan"))
    assert native.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, out)
    want = reference(q, k_cache.float(), v_cache.float(), tables, lens, scale)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=2e-6)


@needs_kernel
def test_peaked_scores_stay_exact():
    """Scores in the hundreds: the softmax must subtract the maximum, not overflow."""
    q, k_cache, v_cache, tables, lens = make_case(6, 4, 2, 32, 4, 60, seed=3)
    q = q * 40
    out = torch.empty(q.shape)
    assert native.paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0, out)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, tables, lens, 1.0), rtol=1e-4, atol=1e-5)


@needs_kernel
def test_garbage_past_the_context_is_never_read():
    q, k_cache, v_cache, tables, lens = make_case(4, 4, 2, 16, 4, 30, seed=5)
    want = reference(q, k_cache, v_cache, tables, lens, 0.25)
    for cache in (k_cache, v_cache):  # NaN in every slot no request's context covers
        keep = torch.zeros(cache.shape[:2], dtype=torch.bool)
        for i, n in enumerate(lens.tolist()):
            for t in range(n):
                keep[tables[i, t // cache.shape[1]], t % cache.shape[1]] = True
        cache[~keep] = float("nan")
    out = torch.empty(q.shape)
    assert native.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, out)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=2e-6)


def test_declines_what_it_cannot_run():
    q, k_cache, v_cache, tables, lens = make_case(3, 4, 2, 16, 4, 20)
    out = torch.zeros(q.shape)
    assert not native.paged_decode_attention(q.double(), k_cache, v_cache, tables, lens, 0.25, out)
    assert not native.paged_decode_attention(q, k_cache.transpose(0, 1), v_cache, tables, lens, 0.25, out)
    assert not native.paged_decode_attention(q, k_cache, v_cache, tables.int(), lens, 0.25, out)
    assert not native.paged_decode_attention(q, k_cache.half(), v_cache.half(), tables, lens, 0.25, out)
    assert not native.paged_decode_attention(q, k_cache.bfloat16(), v_cache, tables, lens, 0.25, out)
    assert (out == 0).all()
    assert not native.decode_attention_supported("cpu", torch.bfloat16, torch.bfloat16)
    assert not native.decode_attention_supported("cpu", torch.float32, torch.float16)
    assert not native.decode_attention_supported("meta", torch.float32, torch.float32)


def test_torch_fallback_reads_the_same_metadata(monkeypatch):
    """When the kernel turns a call down, paged_attention pads one group from the same tables and lengths."""
    q, k_cache, v_cache, tables, lens = make_case(5, 4, 2, 16, 4, 25, seed=7)
    n = q.shape[0]
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64), num_decode_tokens=n,
                             decode_block_tables=tables, decode_context_lens=lens)
    monkeypatch.setattr(native, "paged_decode_attention", lambda *a: False)
    empty = torch.empty(0, 2, 16)
    got = paged_attention(q, empty, empty, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, tables, lens, 0.25), rtol=1e-5, atol=2e-6)


def test_build_leaves_one_library_and_no_temporaries(tmp_path):
    compiler = native.find_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    target = tmp_path / "kernel.so"
    native._build(compiler, target)
    assert target.is_file() and not [p for p in tmp_path.iterdir() if p != target]  # no leftovers
