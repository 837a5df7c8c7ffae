"""The row-wise kernels (RMSNorm with its residual add, in float32 and bfloat16 on every instruction-set path
this machine has; the int8 GEMM's per-token scaling) against the torch operators they replace and against
the scalar reference path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tideserve import native

pytestmark = pytest.mark.skipif(native.load_library() is None, reason="no C compiler to build the kernels")

# one row; a decode batch; enough elements for several threads; an odd width
SHAPES = [(1, 576), (64, 576), (300, 1536), (7, 13)]


# float32: the order of the sum of squares is all that differs from torch. bfloat16: each output is rounded
# once, like torch's, from a float32 value that may differ in its last bits, so at most one bf16 ulp apart
# (2^-7 relative at most).
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.bfloat16: {"rtol": 2**-7, "atol": 1e-6}}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])


def inputs(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x, residual = torch.randn(shape, generator=gen) * 3, torch.randn(shape, generator=gen)
    weight = torch.randn(shape[-1], generator=gen)
    return x.to(dtype), residual.to(dtype), weight.to(dtype)


@DTYPES
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_torch_and_the_scalar_path(isa, on_scalar, shape, dtype):
    x, _, weight = inputs(shape, dtype, 0)
    got = native.rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype
    torch.testing.assert_close(got, F.rms_norm(x, (shape[-1],), weight, 1e-5), **TOLERANCE[dtype])
    torch.testing.assert_close(got, on_scalar(native.rms_norm, x, weight, 1e-5), **TOLERANCE[dtype])


@DTYPES
@pytest.mark.parametrize("shape", SHAPES)
def test_add_rms_norm_updates_the_residual_in_place(isa, on_scalar, shape, dtype):
    """The residual sum is rounded as torch's ``residual.add_(x)`` rounds it: equal bit for bit."""
    x, residual, weight = inputs(shape, dtype, 1)
    total = residual.clone().add_(x)
    scalar_residual = residual.clone()
    out = native.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(residual, total)
    torch.testing.assert_close(out, F.rms_norm(total, (shape[-1],), weight, 1e-6), **TOLERANCE[dtype])
    torch.testing.assert_close(out, on_scalar(native.rms_norm, x, weight, 1e-6, scalar_residual), **TOLERANCE[dtype])
    assert torch.equal(scalar_residual, total)


@DTYPES
@pytest.mark.parametrize(("tokens", "heads", "head_dim"), [(1, 4, 32), (9, 2, 128), (300, 16, 128), (3, 3, 13)])
def test_rms_norm_heads_normalises_each_head_in_place(isa, on_scalar, dtype, tokens, heads, head_dim):
    """Qwen3's q/k norms: the heads of some columns of a wider row (a fused qkv output), normalised in place,
    equal bit for bit to the row kernel over a contiguous copy; the columns around them are left alone."""
    gen = torch.Generator().manual_seed(4)
    qkv = (torch.randn(tokens, (heads + 3) * head_dim, generator=gen) * 3).to(dtype)
    weight = torch.randn(head_dim, generator=gen).to(dtype)
    norm_heads_ = native.bind_rms_norm_heads(dtype, "cpu")
    cols = slice(head_dim, (heads + 1) * head_dim)  # past the first head, as k's columns are past q's
    heads_in = qkv[:, cols].clone()
    want = native.rms_norm(heads_in.reshape(-1, head_dim), weight, 1e-6).reshape(tokens, -1)
    got, scalar = qkv.clone(), qkv.clone()
    norm_heads_(got[:, cols], weight, 1e-6)
    on_scalar(norm_heads_, scalar[:, cols], weight, 1e-6)
    assert torch.equal(got[:, cols], want)
    rest = torch.ones(qkv.shape[1], dtype=torch.bool)
    rest[cols] = False
    assert torch.equal(got[:, rest], qkv[:, rest]) and torch.equal(scalar[:, rest], qkv[:, rest])
    torch.testing.assert_close(scalar[:, cols], want, **TOLERANCE[dtype])
    reference = F.rms_norm(heads_in.unflatten(-1, (heads, head_dim)), (head_dim,), weight, 1e-6)
    torch.testing.assert_close(got[:, cols], reference.flatten(1), **TOLERANCE[dtype])


@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_rows_scale_each_row_and_append_the_range_row(shape, smooth):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=gen)
    x[0] = 0.0  # an all-zero row keeps a positive scale
    inv_smooth = torch.rand(shape[-1], generator=gen) + 0.5 if smooth else None
    rows, row_max = native.int8_rows(x, inv_smooth)
    scaled = x * inv_smooth if smooth else x
    want_max = scaled.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    torch.testing.assert_close(row_max, want_max)
    torch.testing.assert_close(rows[:-1], scaled / want_max)
    range_row = torch.zeros(shape[-1])
    range_row[0], range_row[-1] = 1.0, -1.0
    assert torch.equal(rows[-1], range_row)


@pytest.mark.parametrize("with_bias", [False, True])
def test_scale_rows_undoes_the_row_scaling(with_bias):
    gen = torch.Generator().manual_seed(3)
    y, row_max = torch.randn(9, 40, generator=gen), torch.rand(9, 1, generator=gen)
    bias = torch.randn(40, generator=gen) if with_bias else None
    want = y * row_max + (bias if with_bias else 0)
    assert native.scale_rows_(y, row_max, bias)
    torch.testing.assert_close(y, want)


def test_declines_what_it_cannot_run():
    x = torch.randn(4, 8)
    assert native.rms_norm(x.half(), torch.ones(8, dtype=torch.half), 1e-5) is None
    assert native.rms_norm(x.bfloat16(), torch.ones(8), 1e-5) is None  # dtypes differ
    assert native.rms_norm(x, torch.ones(8), 1e-5, torch.zeros(4, 8, dtype=torch.bfloat16)) is None
    assert native.rms_norm(x.t(), torch.ones(4), 1e-5) is None  # not contiguous
    assert native.rms_norm(x, torch.ones(7), 1e-5) is None
    assert native.int8_rows(x.double(), None) is None
    assert native.int8_rows(torch.empty(0, 8), None) is None
    y = x.clone()
    assert not native.scale_rows_(y.t(), torch.ones(8, 1), None) and torch.equal(y, x)


@pytest.mark.parametrize("shape", [(1, 49152), (64, 4099), (3, 15), (5, 16)])
def test_argmax_rows_is_torchs_first_maximum(isa, shape):
    """The greedy sampler's argmax: torch's ``max(dim=-1).indices`` on every path, ties to the first index
    (in one lane, across lanes and in the scalar tail), rows of -inf, strided rows."""
    gen = torch.Generator().manual_seed(shape[1])
    x = torch.randn(shape, generator=gen)
    assert torch.equal(native.argmax_rows(x), x.max(dim=-1).indices)
    tied = torch.zeros(shape)
    tied[:, -1] = 1.0
    tied[:, shape[1] // 3] = 1.0  # two maxima: the first one counts
    tied[0] = float("-inf")  # nothing but -inf: index 0, as torch says
    assert torch.equal(native.argmax_rows(tied), tied.max(dim=-1).indices)
    coarse = torch.randint(0, 3, shape, generator=gen).float()  # many ties everywhere
    assert torch.equal(native.argmax_rows(coarse), coarse.max(dim=-1).indices)
    wide = torch.randn(shape[0], shape[1] + 7, generator=gen)[:, 3:shape[1] + 3]  # rows 7 floats apart
    assert torch.equal(native.argmax_rows(wide), wide.max(dim=-1).indices)


def test_argmax_rows_leaves_nans_and_odd_inputs_to_torch():
    x = torch.randn(4, 100)
    x[2, 50] = float("nan")
    assert native.argmax_rows(x) is None
    assert native.argmax_rows(torch.randn(4, 100).t()) is None  # columns not contiguous
    assert native.argmax_rows(torch.randn(4, 100, dtype=torch.bfloat16)) is None
    assert native.argmax_rows(torch.empty(0, 100)).shape == (0,)
