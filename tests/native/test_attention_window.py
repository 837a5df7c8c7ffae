"""Sliding-window and soft-capped attention in the native kernels (Gemma's layers): a query at position p
attends keys p - window + 1 .. p only, each score s capped to c * tanh(s / c).

Checked against a float64 reference, and for the property attn_rows.h promises for every attention: a
token's output has the same bits however its step was cut (whole prompt, a tail after a cached prefix of
any length, chunks, decode steps alone, split across threads, or in a batch), with windows that start
inside a key tile, on a tile or part edge, and that span several parts. In attention's invariant mode
(native.set_attention_invariant, which batch invariance turns on) on every path; with it off, above AVX2
the fastest forms of prefill and decode round differently by design, and there they must agree within the
reference's tolerance instead. A bfloat16 cache with head_dim 64 takes the vdpbf16ps forms on AVX-512 BF16
CPUs, whose queries and probabilities are rounded to bfloat16."""

from __future__ import annotations

import random

import pytest
import torch

from tideserve import native

SEQ_LEN = 200
WINDOWS = (1, 5, 32, 33, 40, 64, 100)
SPLITS = (1, 31, 32, 33, 64, 65, 129, 199)
CHUNKS = (1, 7, 33, 64)
CASES = [  # heads, kv heads, head_dim, block size, cache dtype: the AVX2 form, the scalar one (head_dim % 8 != 0),
    (8, 2, 64, 16, "float32"),  # and the vdpbf16ps form (bfloat16, head_dim % 32 == 0) on AVX-512 BF16 CPUs
    (6, 3, 36, 8, "float32"),
    (9, 3, 64, 8, "bfloat16"),
]


class Pool:
    """SEQ_LEN tokens of one sequence (the checked one) and a short unrelated one, in shuffled blocks."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, kv_dtype: str) -> None:
        gen = torch.Generator().manual_seed(7)
        self.lens = [SEQ_LEN, 40]
        self.block_size = block_size
        width = -(-SEQ_LEN // block_size)
        num_blocks = 2 * width + 1
        free = list(range(num_blocks))
        random.Random(7).shuffle(free)
        self.tables = torch.tensor([[free.pop() for _ in range(width)] for _ in self.lens], dtype=torch.int64)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gen).mul(2).to(getattr(torch, kv_dtype))
        self.v_cache = torch.randn(shape, generator=gen).to(getattr(torch, kv_dtype))
        self.q = torch.randn(sum(self.lens), num_heads, head_dim, generator=gen)
        self.starts = [0, SEQ_LEN]
        self.scale = head_dim ** -0.5

    def prefill(self, spans, window, softcap, threads=None):
        """spans: (sequence, first position, count); out rows of their queries, in span order."""
        kvh, dim = self.k_cache.shape[2], self.k_cache.shape[3]
        rows = torch.cat([torch.arange(self.starts[s] + c, self.starts[s] + c + n) for s, c, n in spans])
        q = self.q[rows].contiguous()
        lens = torch.tensor([n for _, _, n in spans], dtype=torch.int64)
        out = torch.full(q.shape, float("nan"))
        assert native.paged_prefill_attention(
            q, self.k_cache.view(-1, kvh, dim), self.v_cache.view(-1, kvh, dim), self.tables[[s for s, _, _ in spans]],
            self.block_size, torch.cumsum(lens, 0) - lens, lens, torch.tensor([c for _, c, _ in spans]),
            self.scale, out, num_threads=threads, window=window, softcap=softcap)
        return out

    def decode(self, steps, window, softcap, threads=None):
        """steps: (sequence, position): one query each over keys up to its position."""
        q = self.q[[self.starts[s] + p for s, p in steps]].contiguous()
        context = torch.tensor([p + 1 for _, p in steps], dtype=torch.int64)
        out = torch.full(q.shape, float("nan"))
        assert native.paged_decode_attention(q, self.k_cache, self.v_cache, self.tables[[s for s, _ in steps]],
                                             context, self.scale, out, num_threads=threads, window=window,
                                             softcap=softcap)
        return out

    def reference(self, window, softcap):
        """float64 attention of sequence 0's queries: keys in (p - window, p], capped scores."""
        bs, kvh = self.block_size, self.k_cache.shape[2]
        slots = (self.tables[0, :, None] * bs + torch.arange(bs)).reshape(-1)[:SEQ_LEN]
        k = self.k_cache.view(-1, kvh, self.k_cache.shape[3])[slots].double().transpose(0, 1)
        v = self.v_cache.view(-1, kvh, self.v_cache.shape[3])[slots].double().transpose(0, 1)
        q = self.q[:SEQ_LEN].double().transpose(0, 1)
        group = q.shape[0] // kvh
        s = q @ k.repeat_interleave(group, 0).transpose(1, 2) * self.scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        pos = torch.arange(SEQ_LEN)
        keep = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
        p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
        return (p @ v.repeat_interleave(group, 0)).transpose(0, 1).float()


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.equal(got, want):
        diff = (got - want).abs()
        rows = sorted({int(i) for i in (diff > 0).any(-1).any(-1).nonzero().flatten()})
        raise AssertionError(f"{what}: {len(rows)} query rows differ (first at {rows[:6]}), by up to "
                             f"{diff.max().item():.3g}")


@pytest.fixture(scope="module")
def pools():
    built: dict[tuple[int, ...], Pool] = {}
    return lambda case: built.setdefault(case, Pool(*case))


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "fastest"])
@pytest.mark.parametrize("softcap", [0.0, 2.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_windowed_attention_is_exact_and_cut_invariant(isa, pools, case, window, softcap, invariant):
    pool = pools(case)
    native.set_attention_invariant(invariant)  # turned off again by conftest's best_path
    levels = native.ISA_LEVELS
    # bfloat16 queries and probabilities (the vdpbf16ps form) against a float64 reference
    rounded = case[4] == "bfloat16" and case[2] % 32 == 0 and levels.index(isa) >= levels.index("avx512bf16")
    tolerance = 2e-2 if rounded else 1e-5
    if not invariant and levels.index(isa) > levels.index("avx2"):
        def assert_same_bits(got, want, what):  # noqa: ARG001 - the promise of the invariant mode only
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    else:
        assert_same_bits = assert_bitwise
    full = pool.prefill([(0, 0, SEQ_LEN)], window, softcap)
    torch.testing.assert_close(full, pool.reference(window, softcap), rtol=tolerance, atol=tolerance)
    if window < SEQ_LEN - 1:  # the window changes the result (else this would test nothing)
        assert not torch.allclose(full, pool.prefill([(0, 0, SEQ_LEN)], 0, softcap), atol=1e-3)
    for c in SPLITS:
        assert_same_bits(pool.prefill([(0, c, SEQ_LEN - c)], window, softcap), full[c:], f"the tail after {c}")
    mixed = pool.prefill([(1, 0, 40), (0, 65, SEQ_LEN - 65)], window, softcap, threads=2)
    assert_same_bits(mixed[40:], full[65:], "a tail beside another span")
    for size in CHUNKS:
        parts = [pool.prefill([(0, c, min(size, SEQ_LEN - c))], window, softcap) for c in range(0, SEQ_LEN, size)]
        assert_same_bits(torch.cat(parts), full, f"chunks of {size}")
    alone = pool.decode([(0, p) for p in range(SEQ_LEN)], window, softcap, threads=1)
    assert_same_bits(alone, full, "decode steps on one thread")
    split = torch.cat([pool.decode([(0, p)], window, softcap, threads=2) for p in range(0, SEQ_LEN, 3)])
    assert_same_bits(split, full[::3], "decode steps, each split over two threads")
    batched = torch.cat([pool.decode([(1, 39), (0, p)], window, softcap, threads=2)[1:]
                         for p in range(0, SEQ_LEN, 7)])
    assert_same_bits(batched, full[::7], "decode steps in a batch")


def test_a_window_past_the_context_is_no_window(pools):
    """window >= every context: the plain causal result, bit for bit."""
    pool = pools(CASES[0])
    assert_bitwise(pool.prefill([(0, 0, SEQ_LEN)], SEQ_LEN, 0.0), pool.prefill([(0, 0, SEQ_LEN)], 0, 0.0),
                   "window of the whole context")
