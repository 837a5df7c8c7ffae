"""The block-quantized linear kernels (qgemm.c) against the same arithmetic written in torch: the input
quantized to 8 bits per block of 32, integer dot products, then each block's scales."""

from __future__ import annotations

import pytest
import torch

from tideserve import native
from tideserve.model.layers.quantization import BLOCK, BlockQuantWeight, dequantize_blocks, quantize_blocks

pytestmark = pytest.mark.skipif(native.load_library() is None, reason="no C compiler to build the kernels")


def quantize_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes [M, K/32, 32] float64, scales [M, K/32] float64), as qgemm.c's quantize_row_q8."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    scale = blocks.abs().amax(dim=-1) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros(()))
    codes = (blocks * inv[..., None]).round()  # half to even, as lrintf
    return codes.double(), scale.double()


def reference(x: torch.Tensor, weight: BlockQuantWeight) -> torch.Tensor:
    codes, scale = quantize_input(x)
    n = weight.out_features
    d = weight.d.double()
    if weight.fmt == "q4":
        packed = weight.qs.reshape(n, -1, BLOCK // 2)
        w_codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1).double()
    else:
        w_codes = weight.qs.reshape(n, -1, BLOCK).double()
    dots = torch.einsum("mbj,nbj->mnb", codes, w_codes)  # exact integers
    out = (dots * d[None] * scale[:, None]).sum(-1)
    if weight.fmt == "q4":
        out += (weight.m.double()[None] * (scale * codes.sum(-1))[:, None]).sum(-1)
    if weight.bias is not None:
        out += weight.bias.double()
    return out.float()


@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_qlinear_matches_the_arithmetic_it_implements(fmt, rows, bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=gen)
    b = torch.randn(200, generator=gen) if bias else None
    weight = BlockQuantWeight(w, b, fmt)
    x = torch.randn(rows, 96, generator=gen) * 2
    out = native.qlinear(x, fmt, weight.qs, weight.d, weight.m, weight.bias)
    torch.testing.assert_close(out, reference(x, weight), rtol=1e-5, atol=1e-4)
    # ... which is the float product up to the 8-bit rounding of x.
    want = torch.nn.functional.linear(x, weight.dequantize(), b)
    assert (out - want).abs().max() < 0.02 * want.abs().max()


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_qlinear_applies_swiglu_on_the_way_in(fmt, monkeypatch):
    gen = torch.Generator().manual_seed(11)
    weight = BlockQuantWeight(torch.randn(40, 64, generator=gen), fmt=fmt)
    gate_up = torch.randn(5, 128, generator=gen) * 3
    out = native.qlinear(gate_up, fmt, weight.qs, weight.d, weight.m, None, swiglu=True)
    activated = torch.nn.functional.silu(gate_up[:, :64]) * gate_up[:, 64:]
    torch.testing.assert_close(out, reference(activated, weight), rtol=1e-3, atol=2e-2)
    assert native.qlinear(gate_up[:, :127], fmt, weight.qs, weight.d, weight.m, None, swiglu=True) is None
    # The layer's torch fallback (float input, dequantized weight) computes the same product.
    monkeypatch.setattr(native, "qlinear", lambda *a: None)
    torch.testing.assert_close(weight(gate_up, swiglu=True), out, rtol=1e-3, atol=0.02 * float(out.abs().max()))


def test_qlinear_takes_strided_rows_and_zero_blocks():
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(64, 128, generator=gen)
    w[:, :32] = 0.0  # a block whose scale is zero
    weight = BlockQuantWeight(w, fmt="q4")
    base = torch.randn(6, 160, generator=gen)
    base[:, :32] = 0.0
    x = base[:, :128]  # rows 160 apart
    assert not x.is_contiguous()
    out = native.qlinear(x, "q4", weight.qs, weight.d, weight.m, None)
    torch.testing.assert_close(out, reference(x.contiguous(), weight), rtol=1e-5, atol=1e-4)


def test_qlinear_declines_what_it_cannot_take():
    weight = BlockQuantWeight(torch.randn(8, 64), fmt="q8")
    assert native.qlinear(torch.randn(2, 64).double(), "q8", weight.qs, weight.d, None, None) is None
    assert native.qlinear(torch.randn(2, 64), "q5", weight.qs, weight.d, None, None) is None
    assert native.qlinear(torch.randn(2, 60), "q8", weight.qs, weight.d, None, None) is None  # not blocks of 32
    assert native.qlinear(torch.randn(2, 64).t(), "q8", weight.qs, weight.d, None, None) is None


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_block_quantization_is_close_and_idempotent(fmt):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 256, generator=gen) * torch.linspace(0.01, 3, 256)
    qs, d, m = quantize_blocks(w, fmt)
    back = dequantize_blocks(qs, d, m, fmt)
    step = d.float().repeat_interleave(BLOCK, dim=1)
    assert ((back - w).abs() <= step * 0.51 + 1e-3 * w.abs()).all()
    # Quantizing dequantized weights gives the same blocks back: GGUF Q4_1/Q8_0 weights stay as they were.
    again = dequantize_blocks(*quantize_blocks(back, fmt), fmt)
    torch.testing.assert_close(again, back, rtol=0, atol=1e-3 * float(d.float().max()))


def test_block_quantization_needs_whole_blocks():
    with pytest.raises(ValueError, match="divisible by 32, got 48"):
        BlockQuantWeight(torch.randn(4, 48))
