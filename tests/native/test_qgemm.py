"""The quantized linear kernels (qgemm.c) on every GGUF format they take and every ISA path this CPU has:
- the scalar path computes exactly the arithmetic it documents (activations rounded to 8 bits per block
  of 32, integer dot products, each block's scales), written here in float64;
- each SIMD row path (AVX2, AVX-512 VNNI), the matrix-vector kernel and the integer tiles (each in AVX2's
  byte products and in VNNI's) give the scalar path's numbers, and the AMX tile path the float product with
  bfloat16-rounded inputs;
- all of them are the float product of the gguf package's own dequantization, up to the input rounding.
Paths the CPU lacks are skipped with their name."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from gguf_blocks import dequantize, quantize, quantized_pair, random_blocks

from tideserve.model.layers.quant.blocks import dequantize_blocks, quantize_blocks
from tideserve.model.layers.quant.weights import QuantWeight
from tideserve.native import quant

pytestmark = pytest.mark.skipif(not quant.available(), reason="no C compiler to build the kernels")

FORMATS = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"]
# the formats AVX2's matrix-vector kernel takes
GEMV_FORMATS = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q6_k", "iq4_nl", "iq4_xs"]
ROW_PATHS = ["avx2", "avx512"]
INT_PATHS = ["avx2", "avx512"]  # the integer tiles and matrix-vector kernel: AVX2's byte products, or VNNI's
X8_FORMATS = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q6_k"]  # the formats with an interleaved layout


def need(path: str) -> None:
    if quant.ISA_NAMES.index(quant.cpu_isa()) < quant.ISA_NAMES.index(path):
        pytest.skip(f"this CPU has no {path} path (best: {quant.cpu_isa()})")


def weight(qtype: str, n: int = 80, k: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = np.random.default_rng(seed)
    w = (gen.standard_normal((n, k)) * np.linspace(0.05, 2.0, k)).astype(np.float32)
    return quantized_pair(torch.from_numpy(w), qtype)


def reference_scalar(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The row kernels' arithmetic in float64: x rounded to int8 per block of 32 (half to even, as
    lrintf), then exact products with the weight's values."""
    blocks = x.double().reshape(x.shape[0], -1, 32)
    scale = (blocks.float().abs().amax(dim=-1) / 127).double()
    inv = torch.where(scale > 0, 1 / scale.float().double(), torch.zeros((), dtype=torch.float64))
    codes = (blocks.float() * inv.float()[..., None]).round().double()
    xq = (codes * scale[..., None]).reshape(x.shape)
    return xq @ values.double().T


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 6, 40])
def test_scalar_path_is_the_documented_arithmetic(qtype, rows):
    data, values = weight(qtype)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)) * 2
    mat = quant.make_qmat([(qtype, data)], 512, None)
    with quant.forced_isa("scalar") as path:
        assert path == "scalar"
        out = quant.qmatmul(x, mat)
    want = reference_scalar(x, values)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-3 * float(want.abs().max()))
    # ... which is the float product up to the 8-bit rounding of x.
    exact = x.double() @ values.double().T
    assert (out.double() - exact).norm() < 0.01 * exact.norm()


@pytest.mark.parametrize("path", ["scalar", "avx2-rows", "avx2-gemv", "avx2-tiles", "avx512", "avx512-gemv",
                                  "avx512-tiles"])
@pytest.mark.parametrize("qtype", FORMATS)
def test_random_blocks_are_the_documented_arithmetic(path, qtype, request):
    """Blocks of random bytes (every code, packed scale, sign and high bit a format can hold, where a fitted
    weight meets few of them: Q3_K's negative scales, IQ4_XS's, Q8_0's -128) through every integer path: the
    product of gguf's own dequantization with x rounded to 8 bits per block, to float32 rounding (relative
    1e-4, absolute 1e-4 of the largest output)."""
    isa = path.split("-")[0]
    need(isa)
    previous = quant.set_tile_min_rows(1 if path.endswith("tiles") else 1 << 30)
    request.addfinalizer(lambda: quant.set_tile_min_rows(previous))
    gemv = quant.set_gemv(path.endswith("gemv"))
    request.addfinalizer(lambda: quant.set_gemv(gemv))
    data = random_blocks(40, 512, qtype, seed=9)
    values = torch.from_numpy(dequantize(data, qtype))
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(10)) * 2
    with quant.forced_isa(isa):
        got = quant.qmatmul(x, quant.make_qmat([(qtype, torch.from_numpy(data))], 512, None))
    want = reference_scalar(x, values)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.fixture
def row_kernels(request):
    """The row kernels for every batch size and format (no tiles, no matrix-vector kernel)."""
    previous = quant.set_tile_min_rows(1 << 30)
    request.addfinalizer(lambda: quant.set_tile_min_rows(previous))
    gemv = quant.set_gemv(False)
    request.addfinalizer(lambda: quant.set_gemv(gemv))
    assert quant.kernel_for(4096) == "rows" and quant.kernel_for(1, "q8_0") == "rows"


@pytest.mark.parametrize("path", ROW_PATHS)
@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 4, 7])
def test_simd_row_paths_equal_the_scalar_path(path, qtype, rows, row_kernels):
    need(path)
    data, _ = weight(qtype, seed=1)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(7)) * 3
    bias = torch.randn(80)
    mat = quant.make_qmat([(qtype, data)], 512, bias)
    with quant.forced_isa("scalar"):
        want = quant.qmatmul(x, mat)
    with quant.forced_isa(path) as used:
        assert used == path
        got = quant.qmatmul(x, mat)
    # Same integer dot products; only the float summation order differs.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * float(want.abs().max()))


def assert_matches_the_scalar_path(qtype: str, rows: int, seed: int, layout: str = "rows") -> None:
    """A [rows, 512] x [512, 100] product with a bias on the kernel in effect against the scalar path over
    the file's rows (the weight itself in ``layout``)."""
    data, _ = weight(qtype, n=100, seed=seed)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(seed + 1)) * 3
    bias = torch.randn(100)  # kept alive here: the QMat holds its pointer
    stored = data if layout == "rows" else quant.relayout(qtype, data, 512, layout)
    got = quant.qmatmul(x, quant.make_qmat([(qtype, stored)], 512, bias, [layout]))
    with quant.forced_isa("scalar"):
        want = quant.qmatmul(x, quant.make_qmat([(qtype, data)], 512, bias))
    # Same integer dot products; only the float summation order differs.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * float(want.abs().max()))


@contextlib.contextmanager
def integer_kernel(kind: str, path: str):
    """Every product through the integer tiles (kind "tiles") or the matrix-vector kernel ("gemv": the
    formats it takes; the others take the row kernels) of ``path``, whatever the batch size."""
    need(path)
    previous = quant.set_tile_min_rows(1 if kind == "tiles" else 1 << 30)
    gemv = quant.set_gemv(kind == "gemv")
    try:
        with quant.forced_isa(path):
            if kind == "tiles":
                assert quant.kernel_for(1) == f"{path}-tiles"
            else:
                assert all(quant.kernel_for(rows, qtype) == f"{path}-gemv"
                           for qtype in GEMV_FORMATS for rows in (1, 70))
                assert quant.kernel_for(1, "q5_k") == "rows"
            yield
    finally:
        quant.set_tile_min_rows(previous)
        quant.set_gemv(gemv)


@pytest.fixture(params=INT_PATHS)
def int_tiles(request):
    with integer_kernel("tiles", request.param):
        yield request.param


@pytest.fixture
def small_tile_chunks():
    """Chunks of rows the tiles sweep set to 128 KiB of activations (under 190 rows of 512 values), so 403
    rows take three chunks whatever this CPU's L2 makes the default."""
    previous = quant.set_tile_chunk_bytes(128 * 1024)
    yield
    quant.set_tile_chunk_bytes(previous)


def test_a_quantized_weight_keeps_the_memory_it_points_into():
    """The struct the kernels read holds the weight and bias by address; built from temporaries that the
    caller drops (and whose memory the next allocations would reuse), it still multiplies the same."""
    import gc

    data, _ = weight("q4_1", n=64, k=256, seed=11)
    bias = torch.randn(64)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(12))
    want = quant.qmatmul(x, quant.make_qmat([("q4_1", data)], 256, bias))
    mat = quant.make_qmat([("q4_1", data.clone())], 256, bias.clone())
    gc.collect()
    litter = [torch.full_like(data, 0xFF) for _ in range(8)] + [torch.full_like(bias, float("nan")) for _ in range(8)]
    assert torch.equal(quant.qmatmul(x, mat), want)
    del litter


def test_every_path_quantizes_x_to_the_same_bits(isa):
    """A matmul's input is rounded to 8 bits per block of 32 (scale = the block's largest magnitude / 127,
    codes rounded to nearest even, each 16-value half's code sum times the scale) bit for bit alike on
    every path, and as numpy computes it in float32; a zero block, values at a rounding tie and the
    block's extreme included."""
    x = torch.randn(37, 576, generator=torch.Generator().manual_seed(3)) * 3
    x[0, :32] = 0.0  # a zero block: scale 0, codes 0
    x[1, :32] = torch.arange(32) - 15.5  # amax 15.5: x / (15.5 / 127) lands on ties (.5) for some values
    x[2, 64:96] *= 1e6  # large magnitudes
    q, scale, sums = quant.quantize_rows(x)
    xb = x.numpy().reshape(37, -1, 32)
    d = (np.abs(xb).max(axis=2) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    codes = np.rint(xb * inv[..., None]).astype(np.int32)
    half_sums = codes.reshape(37, -1, 2, 16).sum(axis=3).astype(np.float32) * d[..., None]
    assert np.array_equal(q.numpy().reshape(37, -1, 32), codes.astype(np.int8))
    assert np.array_equal(scale.numpy().reshape(37, -1), d)
    assert np.array_equal(sums.numpy().reshape(37, -1, 2), half_sums)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize_rows(torch.zeros(2, 40))


@pytest.mark.parametrize(("qtype", "layout"), [*((q, "rows") for q in FORMATS), *((q, "x8") for q in X8_FORMATS)])
@pytest.mark.parametrize("rows", [1, 3, 5, 6, 8, 15, 16, 37, 70, 403])
def test_integer_tiles_equal_the_scalar_path(qtype, layout, rows, int_tiles, small_tile_chunks):
    """Panels of 16 weight rows (100 rows: the last panel is partly empty, half of it an interleaved group
    in the x8 layout), micro tiles of 4 rows of x on AVX2 and of 6 rows by two panels on AVX-512 (every
    remainder of rows, 1 to 5, and a thread's odd panel alone), every format's int16 chain and Q6_K's
    per-half scales; 403 rows take several chunks of rows the panels sweep, each panel decoded once per
    chunk."""
    assert_matches_the_scalar_path(qtype, rows, seed=2, layout=layout)


@pytest.mark.parametrize("qtype", ["q4_1", "q6_k", "q8_0"])
def test_integer_tiles_give_the_same_product_for_every_chunk_of_rows(qtype, int_tiles):
    """The chunk of rows only orders the work (a panel decoded once per chunk): one chunk of 600 rows, the
    default sized from L2, and chunks of 8 rows give the same bits."""
    data, _ = weight(qtype, n=100, seed=6)
    x = torch.randn(600, 512, generator=torch.Generator().manual_seed(7)) * 3
    mat = quant.make_qmat([(qtype, data)], 512, None)
    default = quant.qmatmul(x, mat)
    got = {}
    for chunk in (1 << 30, 8 * (512 + 12 * 16)):
        previous = quant.set_tile_chunk_bytes(chunk)
        try:
            assert quant.tile_chunk_bytes() == chunk
            got[chunk] = quant.qmatmul(x, mat)
        finally:
            quant.set_tile_chunk_bytes(previous)
    for product in got.values():
        assert torch.equal(product, default)


def test_the_tiles_chunk_of_rows_is_half_the_l2():
    """Without an override the chunk is half the core's L2 as the C library reports it (64 KiB to 2 MiB),
    or 128 KiB where it reports none; an override of 0 restores it."""
    if not quant.available():
        pytest.skip("no native kernels")
    import ctypes

    l2 = ctypes.CDLL(None).sysconf(191)  # glibc's _SC_LEVEL2_CACHE_SIZE (Python's os.sysconf lacks the name)
    want = min(max(l2 // 2, 64 * 1024), 2 * 1024 * 1024) if l2 > 0 else 128 * 1024
    previous = quant.set_tile_chunk_bytes(0)
    try:
        assert quant.tile_chunk_bytes() == want
        quant.set_tile_chunk_bytes(12345)
        assert quant.tile_chunk_bytes() == 12345
        quant.set_tile_chunk_bytes(0)
        assert quant.tile_chunk_bytes() == want
    finally:
        quant.set_tile_chunk_bytes(previous)


@pytest.fixture(params=INT_PATHS)
def int_gemv(request):
    with integer_kernel("gemv", request.param):
        yield request.param


@pytest.mark.parametrize(("qtype", "layout"), [*((q, "rows") for q in GEMV_FORMATS),
                                               *((q, "x8") for q in X8_FORMATS)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_gemv_equals_the_scalar_path(qtype, layout, rows, int_gemv):
    """Groups of 8 weight rows (100 rows: 12 groups, and 4 left to the row kernels), 1-3 rows of x per
    pass (7: passes of 3, 3 and 1), with a bias, over the file's rows and the interleaved layout."""
    assert_matches_the_scalar_path(qtype, rows, seed=4, layout=layout)


def test_gemv_next_to_row_kernels_in_one_layer(int_gemv):
    """A fused layer of Q5_0 | Q8_0 | Q6_K | Q5_K shards (45, 19, 24 and 16 rows: every shard but the last
    ends in a partial group, and Q5_K has no matrix-vector kernel) writes each shard's columns, with SwiGLU
    on the way in."""
    gen = torch.Generator().manual_seed(6)
    kinds = (("q5_0", 45), ("q8_0", 19), ("q6_k", 24), ("q5_k", 16))
    shards = [quantized_pair(torch.randn(n, 256, generator=gen), qtype) for qtype, n in kinds]
    w = QuantWeight([(qtype, data) for (qtype, _), (data, _) in zip(kinds, shards)], 256)
    gate_up = torch.randn(3, 600, generator=gen)[:, :512]  # rows 600 apart
    got = w(gate_up, swiglu=True)
    with quant.forced_isa("scalar"):
        want = w(gate_up, swiglu=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * float(want.abs().max()))
    activated = torch.nn.functional.silu(gate_up[:, :256]) * gate_up[:, 256:]
    exact = activated @ torch.cat([values for _, values in shards]).T
    assert (got - exact).norm() < 0.01 * exact.norm()


@pytest.mark.parametrize(("kernel", "qtype", "layout"), [*(("tiles", q, "rows") for q in FORMATS),
                                                         *(("gemv", q, "rows") for q in GEMV_FORMATS),
                                                         *((k, q, "x8") for k in ("tiles", "gemv")
                                                           for q in X8_FORMATS)])
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("path", INT_PATHS)
def test_extreme_codes_do_not_overflow(path, kernel, qtype, layout, sign):
    """AVX2's int16 sums of vpmaddubsw are added for as many steps as the format's largest code allows
    (VNNI adds in int32): a weight at its largest codes (one low value per block, the rest high) against x
    at +-127 everywhere comes close to that bound on every format, and Q8_0's -128 reads as |w| = 128."""
    with integer_kernel(kernel, path):
        extreme_codes_case(qtype, layout, sign)


def extreme_codes_case(qtype: str, layout: str, sign: float) -> None:
    w = torch.ones(32, 256)
    w[:, ::32] = -1.0
    data, values = quantized_pair(w, qtype)
    if qtype == "q8_0":  # one code of each block set to -128 (the value -128 d: exact for the reference)
        blocks = data.view(torch.uint8).reshape(32, 8, 34).clone()
        blocks[:, :, 3] = 0x80
        data = blocks.reshape(data.shape).view(data.dtype)
    x = torch.full((20, 256), sign)
    stored = data if layout == "rows" else quant.relayout(qtype, data, 256, layout)
    got = quant.qmatmul(x, quant.make_qmat([(qtype, stored)], 256, None, [layout]))
    with quant.forced_isa("scalar"):
        want = quant.qmatmul(x, quant.make_qmat([(qtype, data)], 256, None))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-4)
    if qtype != "q8_0":
        torch.testing.assert_close(got, x @ values.T, rtol=1e-3, atol=1e-3 * float(want.abs().max()))


@pytest.mark.parametrize("qtype", X8_FORMATS)
@pytest.mark.parametrize("n", [3, 8, 13, 40])
def test_the_interleaved_layout_round_trips(qtype, n):
    """x8 reorders each whole group of 8 rows (Q5's fifth bits too) and leaves the rest: back to the file's
    rows it is the same bytes."""
    data, _ = weight(qtype, n=n, k=256, seed=n)
    x8 = quant.relayout(qtype, data, 256, "x8")
    assert torch.equal(quant.relayout(qtype, x8, 256, "rows"), data)
    grouped = n // 8 * 8
    assert torch.equal(x8[grouped:], data[grouped:])
    assert grouped == 0 or not torch.equal(x8[:grouped], data[:grouped])
    if qtype not in ("q5_0", "q5_1"):  # the same bytes moved (Q5's fifth bits also move within their word)
        assert torch.equal(x8[:grouped].flatten().sort().values, data[:grouped].flatten().sort().values)
    with pytest.raises(ValueError, match="q5_k has no interleaved layout"):
        quant.relayout("q5_k", weight("q5_k", n=8, k=256)[0], 256, "x8")


@pytest.mark.parametrize("qtype", ["q4_k", "q6_k"])
def test_a_large_weight_is_interleaved_group_by_group(qtype):
    """Past 1 MiB the groups are interleaved in parallel: the result is each 8-row slice's own layout."""
    data, _ = weight(qtype, n=1027, k=2048, seed=5)
    assert data.numel() >= 1 << 20
    x8 = quant.relayout(qtype, data, 2048, "x8")
    pieces = [quant.relayout(qtype, data[g:g + 8].contiguous(), 2048, "x8") for g in range(0, 1024, 8)]
    assert torch.equal(x8, torch.cat([*pieces, data[1024:]]))
    assert torch.equal(quant.relayout(qtype, x8, 2048, "rows"), data)


@pytest.mark.parametrize("path", ["scalar", "avx2-rows", "avx2-gemv", "avx2-tiles", "avx512", "avx512-gemv",
                                  "avx512-tiles", "amx"])
@pytest.mark.parametrize("qtype", X8_FORMATS)
def test_every_path_reads_the_interleaved_layout_as_the_file_rows(path, qtype, request):
    """On every path the x8 layout gives bit for bit what the file's rows give (the paths that do not read it
    directly copy its rows back), for 1 to 20 rows of x and 29 weight rows (3 groups and a tail)."""
    isa = path.split("-")[0]
    need(isa)
    previous = quant.set_tile_min_rows(1 if path.endswith("tiles") or path == "amx" else 1 << 30)
    request.addfinalizer(lambda: quant.set_tile_min_rows(previous))
    gemv = quant.set_gemv(path.endswith("gemv"))
    request.addfinalizer(lambda: quant.set_gemv(gemv))
    data, _ = weight(qtype, n=29, k=256, seed=3)
    x8 = quant.relayout(qtype, data, 256, "x8")
    bias = torch.randn(29)
    file_rows = quant.make_qmat([(qtype, data)], 256, bias)
    interleaved = quant.make_qmat([(qtype, x8)], 256, bias, ["x8"])
    with quant.forced_isa(isa):
        for rows in (1, 2, 5, 8, 20):
            x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)) * 2
            assert torch.equal(quant.qmatmul(x, interleaved), quant.qmatmul(x, file_rows)), rows
        ids = torch.tensor([0, 7, 8, 23, 24, 28, 5])
        assert torch.equal(quant.dequant_rows(qtype, x8, 256, ids, "x8"), quant.dequant_rows(qtype, data, 256, ids))


@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512", "amx"])
def test_a_quantized_weight_keeps_the_layout_this_cpu_reads_fastest(path):
    """On AVX2 and AVX-512 VNNI (without AMX, whose tiles read rows as stored) the legacy formats, Q8_0,
    Q4_K and Q6_K are interleaved at load and Q5_K stays as stored; either way file_segments, deepcopy,
    embed and dequantize see the file's rows."""
    import copy

    need(path)
    gen = torch.Generator().manual_seed(11)
    kinds = (("q5_0", 45), ("q4_k", 16), ("q5_k", 8), ("q6_k", 24))
    shards = [quantized_pair(torch.randn(n, 256, generator=gen), qtype) for qtype, n in kinds]
    with quant.forced_isa(path) as isa:
        w = QuantWeight([(qtype, data) for (qtype, _), (data, _) in zip(kinds, shards)], 256)
        x = torch.randn(3, 256, generator=gen)
        got = w(x)
    want = ["x8", "x8", "rows", "x8"] if isa in ("avx2", "avx512") else ["rows"] * 4
    assert w.layouts == want
    for (qtype, data), ((kind, _), (blocks, _)) in zip(w.file_segments(), zip(kinds, shards)):
        assert qtype == kind and torch.equal(data, blocks)
    values = torch.cat([v for _, v in shards])
    torch.testing.assert_close(w.dequantize(), values, rtol=0, atol=0)
    twin = copy.deepcopy(w)
    assert twin.layouts == w.layouts
    with quant.forced_isa(isa):
        assert torch.equal(twin(x), got)
    table = QuantWeight([("q6_k", shards[3][0])], 256)
    ids = torch.tensor([[0, 18], [9, 23]])
    torch.testing.assert_close(table.embed(ids), shards[3][1][ids], rtol=0, atol=0)


def test_batch_sizes_pick_the_measured_kernel():
    """Below the tiles' threshold the row kernels, from it the tiles (on AVX2, AVX-512 VNNI and AMX CPUs).
    On AVX2, every format but Q5_K takes the matrix-vector kernel below the tiles, which start at 13 rows (4
    over Q5_K, 8 over Q3_K and IQ4_NL, 12 over Q4_K and IQ4_XS, 16 over Q2_K and Q6_K, 24 over Q8_0); with
    it off, the tiles start at 4 rows (12 over Q8_0). VNNI's tiles start earlier: at 8 rows (4 over Q5_K, 10
    over Q4_K, 16 over Q6_K, 12 over Q8_0). AMX CPUs take that AVX-512 plan below 12 rows and the AMX tiles
    from there. The override moves the threshold and 0 restores it."""
    isa = quant.qgemm_isa()
    tiles = {"avx2": "avx2-tiles", "avx512": "avx512-tiles", "amx": "amx-tiles"}.get(isa)
    small = {"avx2": "avx2-gemv", "avx512": "avx512-gemv", "amx": "avx512-gemv"}.get(isa, "rows")
    assert quant.kernel_for(1) == small and quant.kernel_for(3) == small
    assert quant.kernel_for(3, "q5_k") == "rows"
    assert quant.kernel_for(64) == (tiles or "rows")
    assert quant.kernel_for(64, "q8_0") == (tiles or "rows")
    if isa == "avx2":
        assert quant.kernel_for(12) == "avx2-gemv" and quant.kernel_for(13) == "avx2-tiles"
        assert quant.kernel_for(4, "q5_k") == "avx2-tiles"
        assert quant.kernel_for(11, "q4_k") == "avx2-gemv" and quant.kernel_for(12, "q4_k") == "avx2-tiles"
        assert quant.kernel_for(15, "q6_k") == "avx2-gemv" and quant.kernel_for(16, "q6_k") == "avx2-tiles"
        assert quant.kernel_for(23, "q8_0") == "avx2-gemv" and quant.kernel_for(24, "q8_0") == "avx2-tiles"
        assert quant.kernel_for(15, "q2_k") == "avx2-gemv" and quant.kernel_for(16, "q2_k") == "avx2-tiles"
        assert quant.kernel_for(7, "q3_k") == "avx2-gemv" and quant.kernel_for(8, "q3_k") == "avx2-tiles"
        assert quant.kernel_for(7, "iq4_nl") == "avx2-gemv" and quant.kernel_for(8, "iq4_nl") == "avx2-tiles"
        assert quant.kernel_for(11, "iq4_xs") == "avx2-gemv" and quant.kernel_for(12, "iq4_xs") == "avx2-tiles"
        previous = quant.set_gemv(False)
        try:
            assert quant.kernel_for(1) == "rows" and quant.kernel_for(4) == "avx2-tiles"
            assert quant.kernel_for(11, "q8_0") == "rows" and quant.kernel_for(12, "q8_0") == "avx2-tiles"
        finally:
            quant.set_gemv(previous)
    if isa == "avx512":
        assert quant.kernel_for(7) == "avx512-gemv" and quant.kernel_for(8) == "avx512-tiles"
        assert quant.kernel_for(3, "q5_k") == "rows" and quant.kernel_for(4, "q5_k") == "avx512-tiles"
        assert quant.kernel_for(9, "q4_k") == "avx512-gemv" and quant.kernel_for(10, "q4_k") == "avx512-tiles"
        assert quant.kernel_for(15, "q6_k") == "avx512-gemv" and quant.kernel_for(16, "q6_k") == "avx512-tiles"
        assert quant.kernel_for(11, "q8_0") == "avx512-gemv" and quant.kernel_for(12, "q8_0") == "avx512-tiles"
    if isa == "amx":  # the AVX-512 plan below 12 rows, the AMX tiles from there
        assert quant.kernel_for(7) == "avx512-gemv" and quant.kernel_for(8) == "avx512-tiles"
        assert quant.kernel_for(11) == "avx512-tiles" and quant.kernel_for(12) == "amx-tiles"
        assert quant.kernel_for(3, "q5_k") == "rows" and quant.kernel_for(4, "q5_k") == "avx512-tiles"
        assert quant.kernel_for(11, "q8_0") == "avx512-gemv" and quant.kernel_for(12, "q8_0") == "amx-tiles"
        assert quant.kernel_for(11, "q6_k") == "avx512-gemv" and quant.kernel_for(12, "q6_k") == "amx-tiles"
    previous = quant.set_tile_min_rows(128)
    try:
        assert quant.kernel_for(64) == small
        assert quant.kernel_for(128) == (tiles or "rows")
    finally:
        quant.set_tile_min_rows(previous)
    assert quant.kernel_for(64) == (tiles or "rows")
    want = {"avx2": "avx2: q4_0, q4_1, q5_0, q5_1: avx2-gemv to 12 rows, avx2-tiles from 13 rows; q8_0: avx2-gemv "
                    "to 23 rows, avx2-tiles from 24 rows; q2_k, q6_k: avx2-gemv to 15 rows, avx2-tiles from 16 rows; "
                    "q3_k, iq4_nl: avx2-gemv to 7 rows, avx2-tiles from 8 rows; q4_k, iq4_xs: avx2-gemv to 11 rows, "
                    "avx2-tiles from 12 rows; q5_k: rows to 3 rows, avx2-tiles from 4 rows",
            "avx512": "avx512: q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, iq4_nl, iq4_xs: avx512-gemv to 7 rows, avx512-tiles "
                      "from 8 rows; q8_0: avx512-gemv to 11 rows, avx512-tiles from 12 rows; q4_k: avx512-gemv to 9 "
                      "rows, avx512-tiles from 10 rows; q5_k: rows to 3 rows, avx512-tiles from 4 rows; q6_k: "
                      "avx512-gemv to 15 rows, avx512-tiles from 16 rows",
            "amx": "amx: q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, iq4_nl, iq4_xs: avx512-gemv to 7 rows, avx512-tiles to "
                   "11 rows, amx-tiles from 12 rows; q8_0, q6_k: avx512-gemv to 11 rows, amx-tiles from 12 rows; q4_k: "
                   "avx512-gemv to 9 rows, "
                   "avx512-tiles to 11 rows, amx-tiles from 12 rows; q5_k: rows to 3 rows, avx512-tiles to 11 rows, "
                   "amx-tiles from 12 rows"}
    assert quant.kernels_summary() == want.get(isa, f"{isa}: rows")


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("rows", [16, 37, 70])
def test_amx_tiles_are_the_float_product_of_bf16_inputs(qtype, rows):
    need("amx")
    data, values = weight(qtype, n=100, seed=2)  # 100 rows: the last 32-row panel is partly empty
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(100)
    mat = quant.make_qmat([(qtype, data)], 512, bias)
    with quant.forced_isa("amx"):
        got = quant.qmatmul(x, mat)
    want = x.bfloat16().double() @ values.bfloat16().double().T + bias.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize("qtype", ["q4_1", "q5_0", "q6_k"])
@pytest.mark.parametrize("rows", [300, 530])
def test_amx_tiles_over_several_chunks_of_rows(qtype, rows):
    """A prefill's rows go through the panels 256 at a time, every panel decoded once and shared by the
    chunks; the last chunk is partly empty. SwiGLU and a bias ride along."""
    need("amx")
    data, values = weight(qtype, n=100, k=256, seed=4)
    gen = torch.Generator().manual_seed(9)
    gate_up = torch.randn(rows, 512, generator=gen)
    bias = torch.randn(100, generator=gen)
    mat = quant.make_qmat([(qtype, data)], 256, bias)
    with quant.forced_isa("amx"):
        got = quant.qmatmul(gate_up, mat, swiglu=True)
    activated = torch.nn.functional.silu(gate_up[:, :256]) * gate_up[:, 256:]
    want = activated.bfloat16().double() @ values.bfloat16().double().T + bias.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=2e-3 * float(want.abs().max()))


@pytest.mark.parametrize("rows", [70, 530])
def test_amx_tiles_give_the_same_bits_however_the_threads_share_the_panels(rows):
    """Each thread starts from an even share of the panels and then takes the rest of another thread's
    from its back, so the split changes with the cores' speed; a panel's outputs must not. With more
    threads than panels (4 here) some threads start with nothing; with every task in the first thread's
    list the others take all of theirs from it (and the count of taken tasks shows they did). At 530 rows
    the second and third chunks' tasks wait for a panel another thread decoded during the first."""
    need("amx")
    data, _ = weight("q4_1", n=100, k=256, seed=5)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(6))
    mat = quant.make_qmat([("q4_1", data)], 256, torch.randn(100))
    before = torch.get_num_threads()
    results = {}
    try:
        for threads in (1, 2, 3, 7):
            torch.set_num_threads(threads)
            with quant.forced_isa("amx"):
                results[threads] = [quant.qmatmul(x, mat, swiglu=True) for _ in range(3)]
                taken = quant.amx_tasks_taken()
                with quant.amx_tasks_in_one_list():
                    results[threads] += [quant.qmatmul(x, mat, swiglu=True) for _ in range(20)]
                if threads > 1:  # 20 calls: some of them give another thread a task before the first ends
                    assert quant.amx_tasks_taken() > taken, f"{threads} threads took nothing"
    finally:
        torch.set_num_threads(before)
    for threads, outs in results.items():
        for got in outs:
            assert torch.equal(got, results[1][0]), f"{threads} threads"


def test_amx_tiles_redecode_a_weight_too_large_to_share():
    """Past 16 MiB decoded (here a 16,448-row table, as an LM head), each chunk of rows decodes the panels
    again instead of holding the whole weight in bfloat16; the product is the same."""
    need("amx")
    rows_w, k = 16448, 512
    gen = torch.Generator().manual_seed(11)
    table = torch.randn(rows_w, k, generator=gen)
    data, values = quantized_pair(table, "q8_0")
    x = torch.randn(260, k, generator=gen)
    mat = quant.make_qmat([("q8_0", data)], k, None)
    with quant.forced_isa("amx"):
        got = quant.qmatmul(x, mat)
        first_chunk = quant.qmatmul(x[:256], mat)
    want = x.bfloat16().float() @ values.bfloat16().float().T
    torch.testing.assert_close(got, want, rtol=1e-3, atol=2e-3 * float(want.abs().max()))
    torch.testing.assert_close(got[:256], first_chunk, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("path", ["scalar", *ROW_PATHS, *(f"{p}-tiles" for p in INT_PATHS), "amx"])
def test_mixed_segments_swiglu_and_strided_rows(path, request):
    """A fused layer whose shards differ in format (Q5_0 | Q8_0, as llama.cpp's Q4_K_M stores q|k|v), with
    SwiGLU applied on the way in and input rows that are not contiguous."""
    with contextlib.ExitStack() as stack:
        if path.endswith("-tiles"):
            path = path.split("-")[0]
            stack.enter_context(integer_kernel("tiles", path))
        elif path in ROW_PATHS:
            request.getfixturevalue("row_kernels")
        need(path)
        gen = torch.Generator().manual_seed(5)
        a, a_values = quantized_pair(torch.randn(48, 256, generator=gen), "q5_0")
        b, b_values = quantized_pair(torch.randn(24, 256, generator=gen), "q6_k")
        w = QuantWeight([("q5_0", a), ("q6_k", b)], 256)
        assert w.qtypes == ["q5_0", "q6_k"] and w.out_features == 72
        base = torch.randn(20, 600, generator=gen)
        gate_up = base[:, :512]  # rows 600 apart
        activated = torch.nn.functional.silu(gate_up[:, :256]) * gate_up[:, 256:]
        values = torch.cat([a_values, b_values])
        with quant.forced_isa(path):
            got = w(gate_up, swiglu=True)
            plain = w(activated)
        exact = activated @ values.T
        assert (got - exact).norm() < 0.01 * exact.norm()
        torch.testing.assert_close(got, plain, rtol=1e-4, atol=1e-4 * float(exact.abs().max()))


def test_segments_of_one_format_are_merged_and_rows_stay_independent():
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(96, 256, generator=gen)
    q = QuantWeight([("q4_k", quantized_pair(w[:64], "q4_k")[0]), ("q4_k", quantized_pair(w[64:], "q4_k")[0])], 256)
    assert q.qtypes == ["q4_k"]
    x = torch.randn(5, 256, generator=gen)
    loud = torch.randn(3, 256, generator=gen) * 1000
    # Row kernels quantize each row alone: a loud batch-mate does not change a row's result.
    assert torch.equal(q(x)[2:3], q(torch.cat([loud[:2], x[2:3], loud[2:]]))[2:3])


@pytest.mark.parametrize("rows", [(64, 16, 16), (8, 24), (12, 20), (16, 13)])
def test_shards_merged_into_place_are_the_interleaved_concatenation(rows):
    """A fused layer's shards of one format go into one segment: interleaved straight into their place where
    every shard but the last has whole groups of 8 rows, through a concatenation otherwise; the bytes are
    the concatenation's interleaving either way, and file_segments gives the file's rows back."""
    gen = torch.Generator().manual_seed(12)
    shards = [quantized_pair(torch.randn(n, 256, generator=gen), "q4_k")[0] for n in rows]
    whole = torch.cat(shards)
    with quant.forced_isa("avx2" if quant.qgemm_isa() == "amx" else quant.qgemm_isa()) as isa:
        w = QuantWeight([("q4_k", s) for s in shards], 256)
        if isa not in ("avx2", "avx512"):
            pytest.skip(f"the {isa} path keeps the file's rows")
        want = quant.relayout("q4_k", whole, 256, "x8")
    (qtype, data), = w.segments
    assert w.layouts == ["x8"] and torch.equal(data, want)
    assert torch.equal(w.file_segments()[0][1], whole)


def test_dequantized_rows_are_the_gguf_values():
    for qtype in FORMATS:
        data, values = weight(qtype, n=12, k=256)
        ids = torch.tensor([3, 0, 11, 3])
        torch.testing.assert_close(quant.dequant_rows(qtype, data, 256, ids), values[ids], rtol=0, atol=0)
        torch.testing.assert_close(QuantWeight([(qtype, data)], 256).embed(ids.reshape(2, 2)),
                                   values[ids].reshape(2, 2, 256), rtol=0, atol=0)


def test_qmatmul_declines_what_it_cannot_take():
    data, _ = weight("q8_0", n=8, k=64)
    mat = quant.make_qmat([("q8_0", data)], 64, None)
    assert quant.qmatmul(torch.randn(2, 64).double(), mat) is None
    assert quant.qmatmul(torch.randn(2, 60), mat) is None
    assert quant.qmatmul(torch.randn(2, 64).t(), mat) is None
    assert quant.qmatmul(torch.randn(0, 64), mat) is None
    with pytest.raises(ValueError, match="a q4_k row needs a multiple of 256 values, got 64"):
        QuantWeight([("q4_k", data)], 64)
    with pytest.raises(ValueError, match="no kernel for block format 'iq2_xs'"):
        QuantWeight([("iq2_xs", data)], 64)


def test_the_torch_fallback_computes_the_same_product(monkeypatch):
    data, values = weight("q6_k", n=16, k=256)
    w = QuantWeight([("q6_k", data)], 256)
    x = torch.randn(3, 256)
    native_out = w(x)
    monkeypatch.setattr(quant, "qmatmul", lambda *a: None)
    torch.testing.assert_close(w(x), x @ values.T, rtol=1e-5, atol=1e-5)
    assert (native_out - x @ values.T).norm() < 0.01 * (x @ values.T).norm()


@pytest.mark.parametrize("qtype", ["q4_1", "q8_0"])
def test_float_quantization_is_close_and_idempotent(qtype):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 256, generator=gen) * torch.linspace(0.01, 3, 256)
    data = quantize_blocks(w, qtype)
    back = dequantize_blocks(data, qtype, 256)
    step = (w.reshape(48, -1, 32).amax(-1) - w.reshape(48, -1, 32).amin(-1)).repeat_interleave(32, dim=1)
    assert ((back - w).abs() <= step / (15 if qtype == "q4_1" else 127) + 1e-3 * w.abs()).all()
    # Quantizing dequantized weights gives the same blocks back: GGUF Q4_1/Q8_0 weights stay as they were.
    assert torch.equal(quantize_blocks(back, qtype), data)
    # ... and the bytes are the gguf package's own layout.
    np.testing.assert_array_equal(dequantize_blocks(torch.from_numpy(quantize(back.numpy(), qtype)), qtype, 256),
                                  back.numpy())


def test_k_quant_reference_quantizer_matches_gguf_dequantize():
    """tests/gguf_blocks.py writes the K-quants and IQ4 formats itself; gguf reads them back within each
    format's step (the IQ4 codebook's widest gap, 127 - 104 of 127, sets theirs)."""
    w = torch.randn(16, 512, generator=torch.Generator().manual_seed(4))
    for qtype, tol in (("q2_k", 0.5), ("q3_k", 0.3), ("q4_k", 0.25), ("q5_k", 0.12), ("q6_k", 0.06),
                       ("iq4_nl", 0.12), ("iq4_xs", 0.12)):
        _, values = quantized_pair(w, qtype)
        assert (values - w).abs().max() < tol * w.abs().max(), qtype
