"""Rotary embedding with the cache store in one pass (rope_store.c), in float32 and bfloat16 on every
instruction-set path this machine has, against the torch path it replaces: apply_rotary_ on q|k, then
index_copy_ of k and v into the paged cache (float32, bfloat16 or float8 e4m3: torch's cast is the
reference for the rounding)."""

from __future__ import annotations

import pytest
import torch

from tideserve import native
from tideserve.model.layers.rotary import RotaryEmbedding, apply_rotary_
from tideserve.worker.kv_store import as_copyable

pytestmark = pytest.mark.skipif(native.load_library() is None, reason="no C compiler to build the kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn],
                         ids=["kv-f32", "kv-bf16", "kv-fp8"])
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "head_dim", "rotary_dim"),
                         [(1, 9, 3, 64, None), (40, 4, 4, 16, None), (3, 8, 1, 8, None), (17, 2, 1, 128, None),
                          (2, 3, 3, 40, None), (5, 4, 2, 128, 96), (19, 3, 1, 40, 12)])
def test_rope_store_equals_rotary_then_index_copy(isa, tokens, heads, kv_heads, head_dim, rotary_dim, kv_dtype,
                                                  dtype):
    """Bit for bit on every path: the kernel rounds where torch's operators round (in bfloat16, after each
    product and each sum), and multiplies and adds without fusing them. ``rotary_dim``: partial rotary
    (Phi-4-mini's 96 of 128), where the values past it must come through untouched."""
    gen = torch.Generator().manual_seed(tokens)
    width = (heads + 2 * kv_heads) * head_dim
    base = torch.randn(tokens, width + 5, generator=gen).to(dtype)  # rows wider than qkv, as a strided view
    qkv = base[:, :width]
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None, dtype, "cpu", rotary_dim)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    cos, sin = rotary.cos_sin(positions)
    shape = (16, 4, kv_heads, head_dim)  # 64 slots
    slots = torch.randperm(64, generator=gen)[:tokens]
    k_cache, v_cache = torch.full(shape, 7.0, dtype=kv_dtype), torch.full(shape, 7.0, dtype=kv_dtype)

    want_qkv = qkv.clone()
    qk = want_qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    apply_rotary_(qk, cos, sin)
    if rotary_dim is not None:  # the reference itself: rotated values change, the others do not
        unrotated = qkv[:, : (heads + kv_heads) * head_dim].reshape(tokens, heads + kv_heads, head_dim)
        assert torch.equal(qk[..., rotary_dim:], unrotated[..., rotary_dim:])
        assert not torch.equal(qk[..., :rotary_dim], unrotated[..., :rotary_dim])
    want_k = as_copyable(k_cache.clone()).view(64, kv_heads, head_dim)
    want_v = as_copyable(v_cache.clone()).view(64, kv_heads, head_dim)
    want_k.index_copy_(0, slots, as_copyable(qk[:, heads:].to(kv_dtype)))
    want_v.index_copy_(0, slots, as_copyable(want_qkv[:, (heads + kv_heads) * head_dim:].reshape(
        tokens, kv_heads, head_dim).to(kv_dtype)))
    tail = base[:, width:].clone()

    assert native.rope_store(qkv, cos, sin, slots, k_cache, v_cache, heads, kv_heads)
    assert torch.equal(qkv, want_qkv)
    assert torch.equal(as_copyable(k_cache).view(64, kv_heads, head_dim), want_k)
    assert torch.equal(as_copyable(v_cache).view(64, kv_heads, head_dim), want_v)
    assert torch.equal(base[:, width:], tail)  # the columns past qkv's are not touched


def fp8_edge_values() -> torch.Tensor:
    """Every e4m3 value, the midpoints between neighbours (ties: the even one wins), values just off the
    midpoints, and what lies past the range (saturates to +-448) or below half the smallest subnormal."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[codes.isfinite()].unique().sort().values  # 0x7f / 0xff are the NaNs
    mid = (finite[1:] + finite[:-1]) / 2
    near = torch.cat([mid * (1 + 2**-20), mid * (1 - 2**-20)])
    far = torch.tensor([449.0, 463.9, 464.0, 500.0, 1e6, 3e38, 2.0**-10, 2.0**-11, 1e-30, 0.0, -0.0])
    values = torch.cat([finite, mid, near, far, -far])
    return torch.cat([values, torch.zeros((-len(values)) % 64)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fp8_stores_round_as_torchs_cast(isa, dtype):
    """The value rows go to the cache unrotated, so they carry the edge values straight to the e4m3
    rounding: bit for bit torch's ``.to(torch.float8_e4m3fn)`` on every path (the vector loops and
    their scalar tails)."""
    values = fp8_edge_values().to(dtype)
    head_dim, kv_heads, heads = 64, 1, 1
    tokens = len(values) // head_dim
    qkv = torch.zeros(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    qkv[:, 2 * head_dim:] = values.view(tokens, head_dim)
    cos, sin = torch.ones(tokens, head_dim // 2, dtype=dtype), torch.zeros(tokens, head_dim // 2, dtype=dtype)
    shape = (tokens, 1, kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=torch.float8_e4m3fn), torch.zeros(shape, dtype=torch.float8_e4m3fn)
    assert native.rope_store(qkv, cos, sin, torch.arange(tokens), k_cache, v_cache, heads, kv_heads)
    got = v_cache.view(torch.uint8).flatten()
    want = values.float().to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (got != want).nonzero().flatten()[:5].tolist()
    assert not bad, [(values[i].item(), got[i].item(), want[i].item()) for i in bad]


def test_rope_store_declines_what_it_cannot_take():
    qkv = torch.randn(2, 5 * 8)
    cos = sin = torch.ones(2, 4)
    slots = torch.tensor([0, 1])
    cache = torch.zeros(2, 2, 1, 8)
    before = qkv.clone()
    assert not native.rope_store(qkv.double(), cos, sin, slots, cache, cache.clone(), 3, 1)
    assert not native.rope_store(qkv.bfloat16(), cos, sin, slots, cache, cache.clone(), 3, 1)  # cos is float32
    assert not native.rope_store(qkv, cos, sin, slots, cache.half(), cache.half(), 3, 1)
    assert not native.rope_store(qkv, cos, sin, slots, cache.to(torch.float8_e5m2), cache.to(torch.float8_e5m2), 3, 1)
    assert not native.rope_store(qkv, cos, sin, slots.int(), cache, cache.clone(), 3, 1)
    assert not native.rope_store(qkv, cos, sin, slots, cache, cache.clone(), 4, 1)  # widths disagree
    assert torch.equal(qkv, before)
