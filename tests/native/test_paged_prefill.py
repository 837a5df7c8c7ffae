"""The native prefill-attention kernel, on every instruction-set path this machine has, against float64
causal attention over each chunk's keys and against its scalar reference path; and the CPU backend that
calls it against the torch backend, over batches of fresh prompts and chunks after a cached prefix."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tideserve import native
from tideserve.model.attention import BatchLayout, CpuNativeBackend, TorchSDPABackend

needs_kernel = pytest.mark.skipif(native.load_library() is None, reason="no C compiler to build the kernel")


def make_case(spans: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
              seed: int = 0, dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype = torch.float32):
    """Chunks of (cached prefix, new tokens), in shuffled blocks of a cache holding every chunk's keys; q is
    a strided view of fused rows, as the model's is."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    width = max(-(-(c + n) // block_size) for c, n in spans)
    num_blocks = len(spans) * width + 2
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = torch.zeros(len(spans), width, dtype=torch.int64)
    for i, (c, n) in enumerate(spans):
        for j in range(-(-(c + n) // block_size)):
            tables[i, j] = free.pop()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen).to(kv_dtype), torch.randn(shape, generator=gen).to(kv_dtype)
    tokens = sum(n for _, n in spans)
    qkv = torch.randn(tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    computed = torch.tensor([c for c, _ in spans], dtype=torch.int64)
    lens = torch.tensor([n for _, n in spans], dtype=torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    return qkv[:, :num_heads], k_cache, v_cache, tables, starts, lens, computed


def reference(q, k_cache, v_cache, tables, starts, lens, computed, scale):
    """float64 attention of each chunk's queries over its first computed + i + 1 keys."""
    num_heads, num_kv_heads, bs = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    out = torch.full(q.shape, float("nan"))
    for s in range(len(lens)):
        c, n, a = int(computed[s]), int(lens[s]), int(starts[s])
        keys = k_cache[tables[s]].flatten(0, 1)[: c + n].double().repeat_interleave(num_heads // num_kv_heads, 1)
        values = v_cache[tables[s]].flatten(0, 1)[: c + n].double().repeat_interleave(num_heads // num_kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q[a:a + n].double(), keys) * scale
        allowed = torch.arange(c + n)[None, :] <= c + torch.arange(n)[:, None]
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[a:a + n] = torch.einsum("hqk,khd->qhd", weights, values).float()
    assert bs == k_cache.shape[1]
    return out


def run_kernel(q, k_cache, v_cache, tables, starts, lens, computed, scale, num_threads=None):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    kvh, dim = k_cache.shape[2], k_cache.shape[3]
    assert native.paged_prefill_attention(q, k_cache.view(-1, kvh, dim), v_cache.view(-1, kvh, dim), tables,
                                          k_cache.shape[1], starts, lens, computed, scale, out,
                                          num_threads=num_threads)
    return out


TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 3e-6}, torch.bfloat16: {"rtol": 2**-7, "atol": 1e-5}}
# The bfloat16 forms (bfloat16 caches, head_dim a multiple of 32: AMX tiles, and vdpbf16ps on AVX-512 BF16
# CPUs) round queries and probabilities to bfloat16 for their products: errors of a bfloat16 rounding of
# the output's scale (measured: mean 2.5e-4, max 0.009 on these cases' outputs of mean magnitude 0.13; a
# wrong pairing or tile order is off by 0.1 and more).
AMX_TOLERANCE = {"rtol": 2**-7, "atol": 1.5e-2}


def amx_form(isa: str, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether prefill attention takes a bfloat16 form at level ``isa``."""
    return isa in ("avx512bf16", "amx") and kv_dtype == torch.bfloat16 and head_dim % 32 == 0


def tolerance(isa: str, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> dict[str, float]:
    return AMX_TOLERANCE if amx_form(isa, kv_dtype, head_dim) else TOLERANCE[dtype]

CASES = [  # chunks (cached, new), heads, kv heads, head_dim, block size, threads (None: torch's)
    ([(0, 305)], 9, 3, 64, 16, None),                         # SmolLM2's heads, one fresh prompt
    ([(0, 1 + 32), (40, 31), (0, 2), (17, 64)], 9, 3, 64, 16, 3),  # key tiles' edges, prefixes, short chunks
    ([(0, 45), (3, 7)], 4, 4, 32, 4, None),                  # multi-head attention
    ([(5, 20), (0, 9)], 8, 2, 16, 8, 2),                     # head_dim 16, one vector's pair of rows
    ([(0, 50), (70, 3)], 6, 1, 64, 1, None),                 # multi-query, block size 1
    ([(0, 40)], 8, 2, 128, 16, 2),                           # head_dim 128
    ([(0, 21), (9, 13)], 10, 5, 24, 16, None),               # head_dim 24: not a multiple of 8, scalar loops
    ([(0, 3), (33, 1), (0, 70)], 40, 1, 64, 16, None),       # a group of 40 heads: one token per work item
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["q-f32", "q-bf16"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn],
                         ids=["kv-f32", "kv-bf16", "kv-fp8"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{len(c[0])}chunks-" + "x".join(map(str, c[1:5])))
def test_every_path_matches_float64_and_the_scalar_reference(isa, on_scalar, case, kv_dtype, dtype):
    """Causal over each chunk's cached prefix and its own tokens, grouped heads sharing their KV head, on
    every path: float64 attention over the same (widened) values, and the scalar path's result."""
    spans, *dims, threads = case
    q, k_cache, v_cache, tables, starts, lens, computed = make_case(spans, *dims, dtype=dtype, kv_dtype=kv_dtype)
    scale = q.shape[-1] ** -0.5
    out = run_kernel(q, k_cache, v_cache, tables, starts, lens, computed, scale, threads)
    assert out.dtype == dtype
    want = reference(q.float(), k_cache.float(), v_cache.float(), tables, starts, lens, computed, scale)
    tol = tolerance(isa, dtype, kv_dtype, q.shape[-1])
    torch.testing.assert_close(out.float(), want, **tol)
    scalar = on_scalar(run_kernel, q, k_cache, v_cache, tables, starts, lens, computed, scale, threads)
    torch.testing.assert_close(out.float(), scalar.float(), **tol)


@needs_kernel
@pytest.mark.parametrize("level", ["avx512bf16", "amx"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn],
                         ids=["kv-f32", "kv-bf16", "kv-fp8"])
def test_the_bf16_forms_run_over_a_bf16_cache_only(kv_dtype, level, request):
    """At the avx512bf16 level (vdpbf16ps) and the amx level (tiles) a bfloat16 cache takes a bfloat16 form
    (float32 queries rounded to bfloat16: not the AVX-512 form's numbers, and closer to float64 attention
    over the rounded queries than to the unrounded ones); float32 and fp8 caches keep the AVX-512 form's
    float32 arithmetic bit for bit."""
    if native.load_library() is None or level not in native.supported_isas():
        pytest.skip(f"this CPU or build has no {level} path")
    request.addfinalizer(lambda: native.set_isa("auto"))
    q, k_cache, v_cache, tables, starts, lens, computed = make_case([(0, 305), (40, 31)], 9, 3, 64, 16, seed=5,
                                                                    kv_dtype=kv_dtype)
    scale = 0.125
    outs = {}
    for name in ("avx512", level):
        assert native.set_isa(name) == name
        outs[name] = run_kernel(q, k_cache, v_cache, tables, starts, lens, computed, scale)
    assert native.prefill_uses_tiles(kv_dtype, 64) == (kv_dtype == torch.bfloat16)
    if kv_dtype != torch.bfloat16:
        assert torch.equal(outs[level], outs["avx512"])
        return
    assert not torch.equal(outs[level], outs["avx512"])
    exact = reference(q, k_cache.float(), v_cache.float(), tables, starts, lens, computed, scale)
    rounded = reference(q.bfloat16().float(), k_cache.float(), v_cache.float(), tables, starts, lens, computed, scale)
    assert (outs[level] - rounded).abs().mean() < (outs[level] - exact).abs().mean()
    torch.testing.assert_close(outs[level], rounded, rtol=2**-7, atol=1e-2)


@needs_kernel
@pytest.mark.parametrize("level", ["avx512bf16", "amx"])
def test_the_bf16_forms_give_the_same_bits_with_keys_packed_once_or_gathered_per_item(level, request):
    """A call of a bfloat16 form packs every chunk's keys and values once, then its work items read them;
    past the packing's size limit each item gathers its own. Both read the same values in the same tiles:
    the same bits, over partial key tiles, cached prefixes, chunks of one token and several thread counts.
    The count of packing calls must move with the packing on and stay put with it off."""
    if native.load_library() is None or level not in native.supported_isas():
        pytest.skip(f"this CPU or build has no {level} path")
    request.addfinalizer(lambda: native.set_isa("auto"))
    assert native.set_isa(level) == level
    cases = [([(0, 305), (40, 31), (0, 1), (17, 64)], 9, 3, 64, 16), ([(5, 20), (0, 97)], 8, 2, 32, 8),
             ([(33, 40)], 4, 1, 128, 32), ([(0, 3), (33, 1), (0, 70)], 40, 1, 64, 16)]
    for seed, (spans, *dims) in enumerate(cases):
        for dtype in (torch.float32, torch.bfloat16):
            q, k_cache, v_cache, tables, starts, lens, computed = make_case(spans, *dims, seed=seed, dtype=dtype,
                                                                            kv_dtype=torch.bfloat16)
            args = (q, k_cache, v_cache, tables, starts, lens, computed, q.shape[-1] ** -0.5)
            for threads in (1, 2, 3):
                before = native.prefill_packed_calls()
                packed = run_kernel(*args, num_threads=threads)
                assert native.prefill_packed_calls() == before + 1
                with native.prefill_items_gather_their_keys():
                    gathered = run_kernel(*args, num_threads=threads)
                assert native.prefill_packed_calls() == before + 1
                assert torch.equal(packed.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                   gathered.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
                want = reference(q.float(), k_cache.float(), v_cache.float(), *args[3:])
                torch.testing.assert_close(packed.float(), want, **AMX_TOLERANCE)


@needs_kernel
def test_keys_are_read_from_the_steps_own_rows_with_block_size_one():
    """Fresh prompts over a cache of another dtype read their keys from the fused qkv rows (strided):
    each row id in the table is a slot of block size 1."""
    gen = torch.Generator().manual_seed(3)
    lens = [37, 1, 66]
    qkv = torch.randn(sum(lens), 9 + 2 * 3, 64, generator=gen)
    q, k, v = qkv[:, :9], qkv[:, 9:12], qkv[:, 12:]
    starts = torch.tensor([0, 37, 38])
    width = max(lens)
    tables = starts[:, None] + torch.arange(width)[None, :]
    out = torch.full(q.shape, float("nan"))
    assert native.paged_prefill_attention(q, k, v, tables, 1, starts, torch.tensor(lens),
                                          torch.zeros(3, dtype=torch.int64), 0.125, out)
    for a, n in zip(starts.tolist(), lens):
        kk, vv = k[a:a + n].repeat_interleave(3, 1), v[a:a + n].repeat_interleave(3, 1)
        want = torch.nn.functional.scaled_dot_product_attention(q[a:a + n].transpose(0, 1), kk.transpose(0, 1),
                                                                vv.transpose(0, 1), is_causal=True, scale=0.125)
        torch.testing.assert_close(out[a:a + n], want.transpose(0, 1), rtol=1e-5, atol=3e-6)


@needs_kernel
def test_inputs_outside_the_contract_are_refused_untouched():
    q, k_cache, v_cache, tables, starts, lens, computed = make_case([(0, 5)], 4, 2, 16, 4)
    out = torch.full(q.shape, 7.0)
    keys, values = k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
    assert not native.paged_prefill_attention(q, keys, values.to(torch.bfloat16), tables, 4, starts, lens, computed,
                                              0.25, out)  # K and V of different dtypes
    assert not native.paged_prefill_attention(q, keys, values, tables.int(), 4, starts, lens, computed, 0.25, out)
    assert not native.paged_prefill_attention(q, keys, values, tables, 4, starts, lens, computed, 0.25,
                                              out.to(torch.bfloat16))  # q and out of different dtypes
    assert torch.all(out == 7.0)


def mixed_layout(spans: list[tuple[int, int]], tables: torch.Tensor, block_size: int) -> BatchLayout:
    return BatchLayout(tables.numpy(), np.array([c for c, _ in spans], dtype=np.int64),
                       np.array([n for _, n in spans], dtype=np.int64), 0, block_size)


@needs_kernel
@pytest.mark.parametrize("dtype, kv_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                             (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float8_e4m3fn)],
                         ids=["f32-kv-f32", "f32-kv-bf16", "bf16-kv-bf16", "f32-kv-fp8"])
def test_the_cpu_backend_attends_prefills_as_the_torch_backend_does(dtype, kv_dtype, monkeypatch):
    """Through each backend's own builder and forward (the K/V stored first): fresh prompts and chunks after
    a cached prefix. The kernel reads every key from the cache, fresh prompts' too (as their later steps
    read them), so over a cache of another dtype it agrees with float64 attention over the cache's values,
    where torch's SDPA path attends fresh prompts over their own rows. The kernel itself ran, one call over
    the cache; torch's SDPA never."""
    calls: list[int] = []
    bind = native.bind_paged_prefill

    def recording_bind(*bind_args):
        kernel = bind(*bind_args)
        return lambda q, k, *args: calls.append(k.shape[0]) or kernel(q, k, *args)

    monkeypatch.setattr(native, "bind_paged_prefill", recording_bind)
    spans = [(0, 40), (24, 9), (0, 3), (5, 60)]
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    _, k_cache, v_cache, tables, *_ = make_case(spans, heads, kv_heads, dim, bs, seed=5, kv_dtype=kv_dtype)
    gen = torch.Generator().manual_seed(6)
    tokens = sum(n for _, n in spans)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    layout = mixed_layout(spans, tables, bs)
    results = []
    for backend in (CpuNativeBackend("cpu", dtype, kv_dtype, heads, kv_heads, dim), TorchSDPABackend()):
        kc, vc = k_cache.clone(), v_cache.clone()
        results.append(backend.forward(q, k, v, kc, vc, backend.build_metadata(layout), dim ** -0.5))
    ours, theirs = results
    assert ours.dtype == theirs.dtype == dtype
    # slots the kernel was given: the whole cache
    tiles = native.prefill_uses_tiles(kv_dtype, dim)
    assert tiles == amx_form(native.isa() or "scalar", kv_dtype, dim)
    assert calls == [k_cache.shape[0] * bs]
    starts = torch.tensor(layout.query_start_loc[:-1])
    if tiles:
        torch.testing.assert_close(ours.float(), theirs.float(), **AMX_TOLERANCE)
    elif dtype == torch.float32 and kv_dtype == torch.float32:
        torch.testing.assert_close(ours, theirs, **TOLERANCE[dtype])
    elif dtype == torch.float32:
        want = reference(q, kc.float(), vc.float(), tables, starts, torch.tensor(layout.query_lens),
                         torch.tensor(layout.num_computed), dim ** -0.5)
        torch.testing.assert_close(ours, want, **TOLERANCE[dtype])
    else:  # torch's bfloat16 SDPA rounds its intermediates: the kernel (float32 inside) must be no further off
        want = reference(q.float(), kc.float(), vc.float(), tables, starts, torch.tensor(layout.query_lens),
                         torch.tensor(layout.num_computed), dim ** -0.5)
        ours_err, theirs_err = (ours.float() - want).abs().max(), (theirs.float() - want).abs().max()
        assert ours_err <= theirs_err and theirs_err < 0.05
