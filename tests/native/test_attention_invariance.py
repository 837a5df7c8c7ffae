"""Attention gives a query the same bits however its step was cut: a token at position p attending keys
0 .. p of its sequence comes out bit-identical from a whole-prompt prefill, a prefill of the tail after a
cached prefix of any length, a chunked prefill of any chunk size, a decode step, and whatever other
sequences share the call or how many threads run it. Checked on every instruction-set path this machine
has, in attention's invariant mode (what batch invariance turns on: attn_rows.h's AVX2 forms, or on an
AVX-512 BF16 CPU with a bfloat16 cache and head_dim a multiple of 32 the vdpbf16ps form in both kernels), with
torch.equal, not a tolerance."""

from __future__ import annotations

import random

import pytest
import torch

from tideserve import native

SEQ_LEN = 200  # covers positions that are and are not multiples of 32 and of the block sizes
# split points: tile and part edges, one off them, and odd places
SPLITS = (1, 2, 7, 16, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 150, 191, 192, 199)
CHUNKS = (1, 5, 16, 33, 64, 97)


class Pool:
    """One sequence of SEQ_LEN tokens (the one checked) and some unrelated ones, in shuffled blocks of a
    paged cache; q [tokens, H, D] holds every sequence's queries, the checked one's first."""

    def __init__(self, num_heads, num_kv_heads, head_dim, block_size, dtype, kv_dtype, others=(37, 130, 5)):
        gen = torch.Generator().manual_seed(1234)
        rng = random.Random(1234)
        self.lens = [SEQ_LEN, *others]
        self.block_size = block_size
        width = -(-max(self.lens) // block_size)
        num_blocks = len(self.lens) * width + 3
        free = list(range(num_blocks))
        rng.shuffle(free)
        self.tables = torch.zeros(len(self.lens), width, dtype=torch.int64)
        for i, n in enumerate(self.lens):
            for j in range(-(-n // block_size)):
                self.tables[i, j] = free.pop()
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gen).mul(2).to(kv_dtype)
        self.v_cache = torch.randn(shape, generator=gen).to(kv_dtype)
        self.q = torch.randn(sum(self.lens), num_heads, head_dim, generator=gen).to(dtype)
        self.starts = [sum(self.lens[:i]) for i in range(len(self.lens))]
        self.scale = head_dim**-0.5

    def prefill(self, spans, threads=None):
        """spans: (sequence, first position, count); returns out rows of the spans' queries, in span order."""
        kvh, dim = self.k_cache.shape[2], self.k_cache.shape[3]
        rows = torch.cat([torch.arange(self.starts[s] + c, self.starts[s] + c + n) for s, c, n in spans])
        q = self.q[rows].contiguous()
        lens = torch.tensor([n for _, _, n in spans], dtype=torch.int64)
        starts = torch.cumsum(lens, 0) - lens
        computed = torch.tensor([c for _, c, _ in spans], dtype=torch.int64)
        tables = self.tables[[s for s, _, _ in spans]].contiguous()
        out = torch.full(q.shape, float("nan"), dtype=q.dtype)
        assert native.paged_prefill_attention(q, self.k_cache.view(-1, kvh, dim), self.v_cache.view(-1, kvh, dim),
                                              tables, self.block_size, starts, lens, computed, self.scale, out,
                                              num_threads=threads)
        return out

    def decode(self, steps, threads=None):
        """steps: (sequence, position); one query per step over keys 0 .. position."""
        q = self.q[[self.starts[s] + p for s, p in steps]].contiguous()
        tables = self.tables[[s for s, _ in steps]].contiguous()
        context = torch.tensor([p + 1 for _, p in steps], dtype=torch.int64)
        out = torch.full(q.shape, float("nan"), dtype=q.dtype)
        assert native.paged_decode_attention(q, self.k_cache, self.v_cache, tables, context, self.scale, out,
                                             num_threads=threads)
        return out


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.equal(got, want):
        diff = (got.float() - want.float()).abs()
        rows = sorted({int(i) for i in (diff > 0).any(-1).any(-1).nonzero().flatten()})
        raise AssertionError(f"{what}: {len(rows)} of {got.shape[0]} query rows differ (first at {rows[:6]}), "
                             f"by up to {diff.max().item():.3g}")


CASES = [  # heads, kv heads, head_dim, block size
    (8, 2, 64, 16),   # grouped-query, groups of four
    (9, 3, 64, 16),   # SmolLM2's heads: groups of three
    (6, 2, 128, 32),  # head_dim 128, blocks of a whole key tile
    (4, 4, 64, 8),    # multi-head, blocks smaller than a key tile
]
DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)]


@pytest.fixture(scope="module")
def pools():
    built = {}

    def get(case, dtypes):
        key = (case, dtypes)
        if key not in built:
            built[key] = Pool(*case, *dtypes)
        return built[key]

    return get


@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"q-{str(d[0])[6:]}-kv-{str(d[1])[6:]}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_every_way_to_cut_a_step_gives_the_same_bits(isa, pools, case, dtypes):
    native.set_attention_invariant(True)  # turned off again by conftest's best_path
    pool = pools(case, dtypes)
    full = pool.prefill([(0, 0, SEQ_LEN)])
    assert not full.isnan().any()
    # a shorter prompt: its queries see the same keys
    assert_same_bits(pool.prefill([(0, 0, 77)]), full[:77], "a prompt of 77 tokens")
    # the uncached tail after a cached prefix, alone and among other sequences' spans
    for c in SPLITS:
        assert_same_bits(pool.prefill([(0, c, SEQ_LEN - c)]), full[c:], f"the tail after a prefix of {c}")
    mixed = pool.prefill([(1, 0, 37), (0, 65, SEQ_LEN - 65), (2, 100, 30), (3, 0, 5)], threads=2)
    assert_same_bits(mixed[37:37 + SEQ_LEN - 65], full[65:], "a tail among other spans")
    # chunked prefill
    for size in CHUNKS:
        parts = [pool.prefill([(0, c, min(size, SEQ_LEN - c))]) for c in range(0, SEQ_LEN, size)]
        assert_same_bits(torch.cat(parts), full, f"chunks of {size}")
    # decode steps, one query at a time, alone and in batches of other sequences' steps, on 1 and 2 threads
    alone = torch.cat([pool.decode([(0, p)], threads=1) for p in range(SEQ_LEN)])
    assert_same_bits(alone, full, "decode steps alone on one thread")
    split = torch.cat([pool.decode([(0, p)], threads=2) for p in range(0, SEQ_LEN, 3)])
    assert_same_bits(split, full[::3], "decode steps alone on two threads")
    batched = torch.cat([pool.decode([(1, 36), (0, p), (2, 129), (3, 4)], threads=2)[1:2]
                         for p in range(0, SEQ_LEN, 7)])
    assert_same_bits(batched, full[::7], "decode steps in a batch")
    many = pool.decode([(0, p) for p in range(SEQ_LEN)] + [(2, 129)] * 8, threads=2)[:SEQ_LEN]
    assert_same_bits(many, full, "a batch of every decode step")
