"""The native decode-attention kernel, on every instruction-set path this machine has, against its scalar
reference path, float64 attention over each request's gathered keys, and the torch path it replaces."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tideserve import native
from tideserve.model.attention import BatchLayout, CpuNativeBackend, TorchSDPABackend
from tideserve.worker.kv_store import as_copyable

needs_kernel = pytest.mark.skipif(native.load_library() is None, reason="no C compiler to build the kernel")


def make_case(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
              max_context: int, seed: int = 0, dtype: torch.dtype = torch.float32,
              kv_dtype: torch.dtype = torch.float32):
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
    qkv = torch.randn(num_seqs, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    return (qkv[:, :num_heads], k_cache.to(kv_dtype), v_cache.to(kv_dtype), tables,
            torch.tensor(lens, dtype=torch.int64))


def reference(q, k_cache, v_cache, tables, lens, scale):
    """In float64 over the same (widened) values."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape)
    for i, n in enumerate(lens.tolist()):
        keys = k_cache[tables[i]].flatten(0, 1)[:n].repeat_interleave(num_heads // num_kv_heads, dim=1)
        values = v_cache[tables[i]].flatten(0, 1)[:n].repeat_interleave(num_heads // num_kv_heads, dim=1)
        weights = (torch.einsum("hd,thd->ht", q[i].double(), keys.double()) * scale).softmax(-1)
        out[i] = torch.einsum("ht,thd->hd", weights, values.double()).float()
    return out


def run_kernel(q, k_cache, v_cache, tables, lens, scale, num_threads=None):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    assert native.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, out, num_threads=num_threads)
    return out


# bfloat16 outputs are rounded once, at the end: within half a bf16 ulp of the exact result, and two paths
# whose float32 sums differ in the last bits may round one ulp apart; one ulp is at most 2^-7 relative.
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 2e-6}, torch.bfloat16: {"rtol": 2**-7, "atol": 1e-5}}

SHAPES = [  # num_seqs, heads, kv heads, head_dim, block size, longest context, threads (None: torch's)
    (1, 9, 3, 64, 16, 300, 4),     # SmolLM2's heads, one request: its context split across 4 threads, merged
    (2, 9, 3, 64, 16, 1000, 8),    # two long requests split into parts of unequal length (the other is 1 token)
    (3, 4, 4, 32, 4, 40, None),    # multi-head attention
    (20, 8, 2, 16, 8, 130, None),  # many requests, one task each; head_dim 16 (AVX2 runs the scalar loops)
    (5, 6, 1, 64, 1, 50, None),    # multi-query, block size 1
    (4, 8, 2, 128, 16, 70, 2),     # head_dim 128, block size 16
    (3, 10, 5, 80, 16, 45, None),  # head_dim 80: AVX-512 one vector of values at a time
    (3, 9, 3, 64, 64, 200, 2),     # block size 64: each head's keys in chunks of 16, with prefetch between
    (4, 9, 3, 64, 24, 100, 2),     # block size 24: a chunk of 16 keys, then one of 8
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["q-f32", "q-bf16"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn],
                         ids=["kv-f32", "kv-bf16", "kv-fp8"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:6])) + f"-t{s[6]}")
def test_every_path_matches_the_scalar_reference_and_float64(isa, on_scalar, shape, kv_dtype, dtype):
    """bfloat16 and e4m3 inputs widen exactly, so every path must match float64 attention over the same values,
    and the scalar path's result (the order of float32 sums is all that differs)."""
    *dims, threads = shape
    q, k_cache, v_cache, tables, lens = make_case(*dims, dtype=dtype, kv_dtype=kv_dtype)
    scale = q.shape[-1] ** -0.5
    out = run_kernel(q, k_cache, v_cache, tables, lens, scale, threads)
    assert out.dtype == dtype
    want = reference(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    torch.testing.assert_close(out.float(), want, **TOLERANCE[dtype])
    scalar = on_scalar(run_kernel, q, k_cache, v_cache, tables, lens, scale, threads)
    torch.testing.assert_close(out.float(), scalar.float(), **TOLERANCE[dtype])


def decode_layout(tables: torch.Tensor, lens: torch.Tensor, block_size: int) -> BatchLayout:
    """The step these tables and lengths describe: one decode per request (its last token is new)."""
    n = len(lens)
    return BatchLayout(tables.numpy(), lens.numpy() - 1, np.ones(n, dtype=np.int64), n, block_size)


def backend_attention(backend, q, k_cache, v_cache, tables, lens, scale):
    """What the backend's forward gives for that step, through the backend's own builder (K/V already stored)."""
    meta = backend.build_metadata(decode_layout(tables, lens, k_cache.shape[1]))
    empty = torch.empty(0, k_cache.shape[2], k_cache.shape[3], dtype=q.dtype)
    return backend.forward(q, empty, empty, k_cache, v_cache, meta, scale, kv_stored=True)


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["kv-f32", "kv-bf16"])
def test_bfloat16_is_at_least_as_accurate_as_the_torch_path(kv_dtype):
    """What the engine ran before on bf16 models (the torch backend: gathered blocks, bf16 SDPA) against the
    cpu-native backend: both near float64 attention, the kernel no further from it."""
    q, k_cache, v_cache, tables, lens = make_case(8, 9, 3, 64, 16, 200, seed=11, dtype=torch.bfloat16,
                                                  kv_dtype=kv_dtype)
    ours = backend_attention(CpuNativeBackend("cpu", torch.bfloat16, kv_dtype, 9, 3, 64), q, k_cache, v_cache,
                             tables, lens, 0.125)
    theirs = backend_attention(TorchSDPABackend(), q, k_cache, v_cache, tables, lens, 0.125)
    want = reference(q.float(), k_cache.float(), v_cache.float(), tables, lens, 0.125)
    ours_err, theirs_err = (ours.float() - want).abs().max(), (theirs.float() - want).abs().max()
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert ours_err <= theirs_err and theirs_err < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peaked_scores_stay_exact(isa, dtype):
    """Scores in the hundreds: the softmax must subtract the maximum, not overflow."""
    q, k_cache, v_cache, tables, lens = make_case(6, 4, 2, 32, 4, 60, seed=3, dtype=dtype, kv_dtype=dtype)
    q = q * 40
    out = run_kernel(q, k_cache, v_cache, tables, lens, 1.0)
    assert torch.isfinite(out).all()
    want = reference(q.float(), k_cache.float(), v_cache.float(), tables, lens, 1.0)
    torch.testing.assert_close(out.float(), want, rtol=1e-4 if dtype == torch.float32 else 2**-7, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_garbage_past_the_context_is_never_read(isa, kv_dtype):
    q, k_cache, v_cache, tables, lens = make_case(4, 4, 2, 16, 4, 30, seed=5, kv_dtype=kv_dtype)
    want = reference(q, k_cache.float(), v_cache.float(), tables, lens, 0.25)
    for cache in (k_cache, v_cache):  # NaN in every slot no request's context covers
        keep = torch.zeros(cache.shape[:2], dtype=torch.bool)
        for i, n in enumerate(lens.tolist()):
            for t in range(n):
                keep[tables[i, t // cache.shape[1]], t % cache.shape[1]] = True
        as_copyable(cache)[~keep] = as_copyable(torch.tensor([float("nan")]).to(cache.dtype))
    torch.testing.assert_close(run_kernel(q, k_cache, v_cache, tables, lens, 0.25), want, rtol=1e-5, atol=2e-6)


def test_every_fp8_code_widens_exactly(isa):
    """One key per request: attention returns that token's value row itself, so each of the 254 finite e4m3
    codes (subnormals and -0 included) must come back as torch's float32 of it, on every path."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[codes & 0x7f == 0x7f] = 0  # the two NaN codes are never stored (stores saturate at +-448)
    head_dim = 32  # the AVX2 and AVX-512 loops both take it
    n = 256 // head_dim
    values = codes.view(n, 1, 1, head_dim).view(torch.float8_e4m3fn)  # [blocks, block_size 1, KVH 1, D]
    keys = torch.zeros_like(values)
    q = torch.randn(n, 1, head_dim)
    tables = torch.arange(n).view(n, 1)
    out = run_kernel(q, keys, values, tables, torch.ones(n, dtype=torch.int64), 0.25)
    torch.testing.assert_close(out.flatten(), values.float().flatten(), rtol=0, atol=0)


@needs_kernel
def test_declines_what_it_cannot_run():
    q, k_cache, v_cache, tables, lens = make_case(3, 4, 2, 16, 4, 20)
    out = torch.zeros(q.shape)
    assert not native.paged_decode_attention(q.double(), k_cache, v_cache, tables, lens, 0.25, out)
    assert not native.paged_decode_attention(q, k_cache.transpose(0, 1), v_cache, tables, lens, 0.25, out)
    assert not native.paged_decode_attention(q, k_cache, v_cache, tables.int(), lens, 0.25, out)
    assert not native.paged_decode_attention(q, k_cache.half(), v_cache.half(), tables, lens, 0.25, out)
    assert not native.paged_decode_attention(q, k_cache.bfloat16(), v_cache, tables, lens, 0.25, out)
    assert not native.paged_decode_attention(q.bfloat16(), k_cache, v_cache, tables, lens, 0.25, out)  # q != out
    assert not native.paged_decode_attention(q.half(), k_cache, v_cache, tables, lens, 0.25, out.half())
    assert (out == 0).all()
    assert CpuNativeBackend.supported("cpu", torch.bfloat16, torch.bfloat16, 9, 3, 64)
    assert CpuNativeBackend.supported("cpu", torch.bfloat16, torch.float32, 9, 3, 64)
    assert CpuNativeBackend.supported("cpu", torch.float32, torch.float8_e4m3fn, 9, 3, 64)
    assert not CpuNativeBackend.supported("cpu", torch.float32, torch.float8_e5m2, 9, 3, 64)
    assert not CpuNativeBackend.supported("cpu", torch.float16, torch.float16, 9, 3, 64)
    assert not CpuNativeBackend.supported("cpu", torch.float32, torch.float16, 9, 3, 64)
    assert not CpuNativeBackend.supported("meta", torch.float32, torch.float32, 9, 3, 64)
    assert not CpuNativeBackend.supported("cpu", torch.float32, torch.float32, 9, 4, 64)  # heads do not group


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn],
                         ids=["kv-f32", "kv-bf16", "kv-fp8"])
def test_both_cpu_backends_read_the_same_step_from_their_own_builders(kv_dtype):
    """The same step (unsorted contexts, so the torch builder pads one group) through each backend's own
    builder: the cpu-native backend's raw tables and lengths, and the torch backend's padded, masked group."""
    q, k_cache, v_cache, tables, lens = make_case(5, 4, 2, 16, 4, 25, seed=7, kv_dtype=kv_dtype)
    want = reference(q, k_cache.float(), v_cache.float(), tables, lens, 0.25)
    torch_out = backend_attention(TorchSDPABackend(), q, k_cache, v_cache, tables, lens, 0.25)
    torch.testing.assert_close(torch_out, want, rtol=1e-5, atol=2e-6)
    if native.load_library() is not None:
        backend = CpuNativeBackend("cpu", torch.float32, kv_dtype, 4, 2, 16)
        torch.testing.assert_close(backend_attention(backend, q, k_cache, v_cache, tables, lens, 0.25), want,
                                   rtol=1e-5, atol=2e-6)


@pytest.mark.slow
def test_build_leaves_one_library_and_no_temporaries(tmp_path):
    compiler = native.find_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    target = tmp_path / "kernel.so"
    # The build's files are under test, not its code: unoptimized, it compiles in a fifth of the time.
    native._build(compiler, target, ["-O0"])
    assert target.is_file() and not [p for p in tmp_path.iterdir() if p != target]  # no leftovers
