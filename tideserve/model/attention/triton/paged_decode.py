"""Paged decode attention in Triton: one query token per sequence over its cached keys.

Why this shape: decode is bound by reading the KV cache, so each program reads one KV head's keys and
values once and serves every query head of that group (grouped-query attention) from them, straight from
the paged cache through the block table (no gather into a contiguous copy). Tokens are visited in tiles
of ``TILE`` positions independent of the cache's block size: each position's block id comes from the
table, so block sizes 8 to 128 run the same code.

Split-K: a batch of few sequences over long contexts would leave most of the GPU idle with one program
per (sequence, KV head). Then the context is cut into partitions of ``PARTITION_SIZE`` tokens computed in
parallel, each keeping its running max and sum, and a second kernel merges them by log-sum-exp. The rule
(:func:`num_partitions`): split when the longest context spans more than one partition and either the
batch gives fewer than ``SPLIT_BELOW_PROGRAMS`` (sequence, KV head) programs or the longest context
exceeds ``ALWAYS_SPLIT_ABOVE`` tokens (vLLM's paged attention v1/v2 rule, in the same spirit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tideserve.model.attention.triton import _common
from tideserve.model.attention.triton._common import attend_tile

TILE = 64  # key positions per inner-loop step
PARTITION_SIZE = 512  # key positions per split-K partition (a multiple of TILE)
SPLIT_BELOW_PROGRAMS = 256  # about two programs per SM on current GPUs
ALWAYS_SPLIT_ABOVE = 8192  # tokens: one program per head would loop too long even in a full batch


def num_partitions(max_context_len: int, num_programs: int, partition_size: int = PARTITION_SIZE) -> int:
    """How many split-K partitions a decode batch gets (1 = no split); see the module docstring."""
    parts = max(1, -(-int(max_context_len) // partition_size))
    if parts > 1 and (num_programs < SPLIT_BELOW_PROGRAMS or max_context_len > ALWAYS_SPLIT_ABOVE):
        return parts
    return 1


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, tmp_out_ptr, tmp_m_ptr, tmp_l_ptr,
    scale, softcap, window, num_heads, num_parts,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_kb, stride_ks, stride_kh, stride_btb,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PARTITION: tl.constexpr, SPLIT: tl.constexpr,
    FP32: tl.constexpr, SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(lens_ptr + seq).to(tl.int32)
    # The query sits at ctx - 1: its window's first key is ctx - window. The loop starts there, so no key
    # before the window is read or masked; a partition wholly before it runs no tile and stores
    # (max -inf, sum 0), which the reduction weighs 0.
    first = tl.maximum(ctx - window, 0)
    if SPLIT:
        start = tl.maximum(part * PARTITION, first)
        end = tl.minimum(ctx, part * PARTITION + PARTITION)
    else:
        start = first
        end = ctx

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    head = kvh * GROUP + g
    gmask = g < GROUP
    dmask = d < D
    q = tl.load(q_ptr + seq * stride_qb + head[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    if FP32:
        q = q.to(tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for t0 in range(start, end, TILE):
        t = t0 + tl.arange(0, TILE)
        tmask = t < end
        m_i, l_i, acc = attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, bt_ptr + seq * stride_btb, t, tmask,
                                    tmask[None, :], kvh, d, dmask, scale, softcap, stride_kb, stride_ks,
                                    stride_kh, BLOCK_SIZE=BLOCK_SIZE, FP32=FP32, SOFTCAP=SOFTCAP)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    omask = gmask[:, None] & dmask[None, :]
    if SPLIT:
        row = (seq * num_heads + head) * num_parts + part
        tl.store(tmp_m_ptr + row, m_i, mask=gmask)
        tl.store(tmp_l_ptr + row, l_i, mask=gmask)
        tl.store(tmp_out_ptr + row[:, None] * D_PAD + d[None, :], o, mask=omask)
    else:
        tl.store(out_ptr + seq * stride_ob + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _reduce_kernel(
    tmp_out_ptr, tmp_m_ptr, tmp_l_ptr, lens_ptr, out_ptr, num_heads, num_parts, stride_ob, stride_oh,
    D: tl.constexpr, D_PAD: tl.constexpr, P_PAD: tl.constexpr, PARTITION: tl.constexpr,
):
    """Merge one (sequence, head)'s partitions: weights l_p * 2^(m_p - max m), outputs normalized per
    partition, so the sum is the softmax over the whole context."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(lens_ptr + seq).to(tl.int32)
    used = tl.cdiv(ctx, PARTITION)
    base = (seq * num_heads + head) * num_parts
    p = tl.arange(0, P_PAD)
    pmask = p < used
    m = tl.load(tmp_m_ptr + base + p, mask=pmask, other=float("-inf"))
    big = tl.max(m, 0)
    big = tl.where(big > float("-inf"), big, 0.0)
    sums = tl.load(tmp_l_ptr + base + p, mask=pmask, other=0.0)
    total = tl.sum(tl.where(pmask, sums * tl.exp2(m - big), 0.0), 0)
    d = tl.arange(0, D_PAD)
    dmask = d < D
    acc = tl.zeros([D_PAD], tl.float32)
    for i in range(0, used):
        w = tl.load(tmp_l_ptr + base + i) * tl.exp2(tl.load(tmp_m_ptr + base + i) - big)
        acc += w * tl.load(tmp_out_ptr + (base + i) * D_PAD + d, mask=dmask, other=0.0)
    o = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=dmask)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor, *, max_context_len: int | None = None,
                           partition_size: int | None = None, window: int = 0, softcap: float = 0.0) -> None:
    """out[b] = softmax(q[b] K_b^T * scale) V_b over sequence b's first context_lens[b] cached keys.

    ``window`` > 0: only the last ``window`` keys (the query is at context_lens[b] - 1, so keys
    p - window + 1 .. p); ``softcap`` > 0: each scaled score s becomes softcap * tanh(s / softcap) before
    the softmax. 0 means none, for both.

    q, out: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D] (float32, bfloat16 or float16,
    any mix with q); block_tables: [B, max_blocks] int32 (or int64), entries past a sequence's blocks never
    read; context_lens: [B] int32 (or int64), each >= 1. ``max_context_len`` (the largest context_lens)
    saves a device-to-host read when the caller knows it; ``partition_size`` (a multiple of 64) forces
    split-K with that partition, else :func:`num_partitions` decides.
    """
    num_heads, num_kv_heads, head_dim, block_size = _common.check_cache(q, k_cache, v_cache, out, "[B, H, D]")
    batch = q.shape[0]
    window = _common.kernel_window(window, softcap)
    _common.check_index("block_tables", block_tables, 2, q.device)
    _common.check_index("context_lens", context_lens, 1, q.device)
    if block_tables.shape[0] != batch or context_lens.shape[0] != batch:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} "
                         f"must have q's batch size {batch} rows.")
    if batch == 0:
        return
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    if partition_size is None:
        partition, parts = PARTITION_SIZE, num_partitions(max_context_len, batch * num_kv_heads)
    else:
        if partition_size < TILE or partition_size % TILE:
            raise ValueError(f"partition_size must be a positive multiple of {TILE}, got {partition_size}.")
        partition, parts = partition_size, max(1, -(-max_context_len // partition_size))
    group = num_heads // num_kv_heads
    d_pad = _common.pow2_at_least(head_dim)
    split = parts > 1
    if split:
        tmp_out = torch.empty((batch, num_heads, parts, d_pad), dtype=torch.float32, device=q.device)
        tmp_m = torch.empty((batch, num_heads, parts), dtype=torch.float32, device=q.device)
        tmp_l = torch.empty_like(tmp_m)
    else:
        tmp_out = tmp_m = tmp_l = out  # unused
    _decode_kernel[(batch, num_kv_heads, parts)](
        q, k_cache, v_cache, block_tables, context_lens, out, tmp_out, tmp_m, tmp_l,
        float(scale), float(softcap), window, num_heads, parts,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, G_PAD=_common.pow2_at_least(group), D=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size, TILE=TILE,
        PARTITION=partition, SPLIT=split, FP32=_common.compute_in_fp32(q, k_cache, _decode_kernel),
        SOFTCAP=softcap > 0,
    )
    if split:
        _reduce_kernel[(batch, num_heads)](
            tmp_out, tmp_m, tmp_l, context_lens, out, num_heads, parts, out.stride(0), out.stride(1),
            D=head_dim, D_PAD=d_pad, P_PAD=_common.pow2_at_least(parts, 1), PARTITION=partition,
        )
