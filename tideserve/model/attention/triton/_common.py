"""Checks and tile sizes shared by the decode and prefill kernels' launchers.

The kernels index raw pointers, so a wrong shape or dtype would read out of bounds instead of failing;
the launchers check what the kernels assume and raise ``ValueError`` naming the argument.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
# tl.dot needs every dimension to be at least 16 on GPUs; the interpreter follows the same shapes so that
# what the CPU tests run is what a GPU compiles.
MIN_DOT = 16


def pow2_at_least(n: int, floor: int = MIN_DOT) -> int:
    """The smallest power of two >= max(n, floor): Triton's block shapes must be powers of two."""
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


def check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                q_dims: str) -> tuple[int, int, int, int]:
    """Validate q/out ([T, H, D]) against the caches ([num_blocks, block_size, KVH, D]).

    Returns (num_heads, num_kv_heads, head_dim, block_size).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be {q_dims}, got shape {tuple(q.shape)}.")
    if out.shape != q.shape:
        raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}.")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}.")
    _tokens, num_heads, head_dim = q.shape
    _blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"k_cache's head_dim {cache_head_dim} differs from q's head_dim {head_dim}.")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"q's num_heads {num_heads} must be a multiple of the cache's num_kv_heads "
                         f"{num_kv_heads}.")
    for name, t in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}.")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in head_dim, got strides {t.stride()}.")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: all tensors must share one device.")
    if v_cache.dtype != k_cache.dtype or v_cache.stride() != k_cache.stride():
        raise ValueError("v_cache must have k_cache's dtype and strides.")
    return num_heads, num_kv_heads, head_dim, block_size


def check_index(name: str, t: torch.Tensor, dims: int, device: torch.device) -> None:
    if t.dim() != dims or t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be a {dims}-d int32 (or int64) tensor, got {t.dtype} {tuple(t.shape)}.")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q on {device}: all tensors must share one device.")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got strides {t.stride()}.")


def compute_in_fp32(q: torch.Tensor, k_cache: torch.Tensor, kernel: object) -> bool:
    """Dot products run in the inputs' half dtype (fp32 accumulation) when q and the cache share one;
    otherwise (or for float32) everything is widened to float32 and multiplied exactly (no tf32).

    Under the interpreter, bfloat16 dots are widened too: Triton 3.9's interpreter multiplies bfloat16
    tiles as their raw bits (results off by 1e10), while loads, stores and conversions of bfloat16 are
    right. The bfloat16 dot itself is covered by the CUDA tests.
    """
    if q.dtype == torch.float32 or q.dtype != k_cache.dtype:
        return True
    return q.dtype == torch.bfloat16 and interpreted(kernel)


def interpreted(kernel: object) -> bool:
    """Whether ``kernel`` was defined under TRITON_INTERPRET=1 (runs on CPU tensors, in numpy)."""
    return type(kernel).__name__ == "InterpretedFunction"


@triton.jit
def tanh(x):
    """tanh from exp2 (1.4426950408889634 = log2(e)), the same code compiled and interpreted:
    (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1], so nothing overflows and large |x| saturates to +-1."""
    e = tl.exp2(tl.abs(x) * (-2.0 * 1.4426950408889634))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, table_ptr, t, tmask, allowed, kvh, d, dmask, scale, softcap,
                stride_kb, stride_ks, stride_kh, BLOCK_SIZE: tl.constexpr, FP32: tl.constexpr,
                SOFTCAP: tl.constexpr):
    """One step of online softmax over key positions ``t`` (a tile), shared by decode and prefill.

    Each position's block comes from the sequence's block table row (``table_ptr``), so the paged cache
    is read in place; ``allowed`` masks the scores (real keys, causality and the window for prefill).
    With ``SOFTCAP``, the scaled score s becomes softcap * tanh(s / softcap) before masking (the torch
    backend's order); scores are then taken to base 2, so exp2 replaces exp. A row with no allowed key
    yet keeps a running max of -inf: the rescale then uses 0 in its place, so such a row stays at
    (sum 0, accumulator 0) instead of NaN. Returns the updated (running max, running sum, accumulator).
    """
    block = tl.load(table_ptr + t // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
    kv = block * stride_kb + (t % BLOCK_SIZE) * stride_ks + kvh * stride_kh
    kvmask = tmask[:, None] & dmask[None, :]
    k = tl.load(k_ptr + kv[:, None] + d[None, :], mask=kvmask, other=0.0)
    v = tl.load(v_ptr + kv[:, None] + d[None, :], mask=kvmask, other=0.0)
    if FP32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if SOFTCAP:
        s = softcap * tanh(s * (scale / softcap)) * 1.4426950408889634
    else:
        s = s * (scale * 1.4426950408889634)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


# What the kernels get for "no window": a window longer than any context, so they need no branch on it
# (Triton also specializes an int argument of 1 to a constant, which a branch on it would have to handle).
NO_WINDOW = 1 << 30


def kernel_window(window: int, softcap: float) -> int:
    """The window the kernels take (``NO_WINDOW`` for 0, none) after checking both options: 0 means none,
    a negative one is a caller's bug, not "none"."""
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: the whole context), got {window}.")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0: no soft-capping), got {softcap}.")
    return int(window) if window > 0 else NO_WINDOW
