"""Paged prefill attention in Triton: variable-length query chunks over paged KV (prefix hits included).

Each sequence's chunk is its last ``query_len`` positions: its queries attend causally within the chunk and
to the whole cached prefix before it. This step's keys and values are already in the cache, so a fresh
prompt, a chunk after an earlier chunk and a prompt after a prefix-cache hit are one case: every key is
read from the paged cache through the block table, in place.

A program takes ``BLOCK_Q`` query positions of one sequence and every query head of one KV head (rows =
positions x heads of the group), so grouped-query attention reads each key tile once per group. Key tiles
past the tile's last query position are never visited (causal skipping), nor, with a sliding window, key
tiles before the window of the tile's first query position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tideserve.model.attention.triton import _common
from tideserve.model.attention.triton._common import attend_tile

TILE = 64  # key positions per inner-loop step
BLOCK_ROWS = 64  # (query position, head) rows per program


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, lens_ptr, out_ptr, scale, softcap, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_btb,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, FP32: tl.constexpr, SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    qtile = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq).to(tl.int32)
    qlen = tl.load(qsl_ptr + seq + 1).to(tl.int32) - q_start
    ctx = tl.load(lens_ptr + seq).to(tl.int32)
    prefix = ctx - qlen  # cached keys before this chunk

    r = tl.arange(0, BLOCK_Q * G_PAD)
    gi = r % G_PAD
    qi = qtile * BLOCK_Q + r // G_PAD  # query index within the chunk
    head = kvh * GROUP + gi
    rmask = (gi < GROUP) & (qi < qlen)
    pos = prefix + qi  # absolute position of each row's query
    d = tl.arange(0, D_PAD)
    dmask = d < D
    qmask = rmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + (q_start + qi)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=qmask, other=0.0)
    if FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], tl.float32)

    # Keys up to this tile's last query position (causal); none when the tile is past the chunk. With a
    # window, from the first query position's first window key: later rows' windows start later, but as
    # BLOCK_Q <= TILE the first key tile still holds a key of every real row. Padding rows past the
    # context may see none; attend_tile keeps them at zero instead of NaN.
    hi = tl.minimum(ctx, prefix + (qtile + 1) * BLOCK_Q)
    hi = tl.where(qtile * BLOCK_Q < qlen, hi, 0)
    lo = tl.maximum(prefix + qtile * BLOCK_Q - window + 1, 0)
    for t0 in range(lo, hi, TILE):
        t = t0 + tl.arange(0, TILE)
        tmask = t < ctx
        allowed = tmask[None, :] & (t[None, :] <= pos[:, None]) & (t[None, :] > pos[:, None] - window)
        m_i, l_i, acc = attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, bt_ptr + seq * stride_btb, t, tmask, allowed,
                                    kvh, d, dmask, scale, softcap, stride_kb, stride_ks, stride_kh,
                                    BLOCK_SIZE=BLOCK_SIZE, FP32=FP32, SOFTCAP=SOFTCAP)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + qi)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=qmask)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            context_lens: torch.Tensor, scale: float, out: torch.Tensor, *,
                            max_query_len: int | None = None, window: int = 0, softcap: float = 0.0) -> None:
    """Causal attention of S variable-length query chunks over their paged contexts.

    ``window`` > 0: a query at position p attends keys p - window + 1 .. p only (the window may start
    inside the cached prefix); ``softcap`` > 0: each scaled score s becomes softcap * tanh(s / softcap)
    before the softmax. 0 means none, for both.

    q, out: [T, H, D], sequence s's queries at rows query_start_loc[s]:query_start_loc[s+1];
    k_cache, v_cache: [num_blocks, block_size, KVH, D] holding every key of each context, this chunk's
    included; block_tables: [S, max_blocks]; query_start_loc: [S+1]; context_lens: [S] (all keys,
    cached prefix + chunk, so context_lens[s] >= query_len[s]); index tensors int32 (or int64).
    ``max_query_len`` saves a device-to-host read when the caller knows it.
    """
    num_heads, num_kv_heads, head_dim, block_size = _common.check_cache(q, k_cache, v_cache, out, "[T, H, D]")
    window = _common.kernel_window(window, softcap)
    _common.check_index("block_tables", block_tables, 2, q.device)
    _common.check_index("query_start_loc", query_start_loc, 1, q.device)
    _common.check_index("context_lens", context_lens, 1, q.device)
    num_seqs = context_lens.shape[0]
    if block_tables.shape[0] != num_seqs or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} must have one row and query_start_loc "
                         f"{tuple(query_start_loc.shape)} one more entry than context_lens has sequences "
                         f"({num_seqs}).")
    if num_seqs == 0 or q.shape[0] == 0:
        return
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len <= 0:
        return
    group = num_heads // num_kv_heads
    g_pad = _common.pow2_at_least(group, 1)
    block_q = max(1, BLOCK_ROWS // g_pad)
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, out,
        float(scale), float(softcap), window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, G_PAD=g_pad, BLOCK_Q=block_q, D=head_dim, D_PAD=_common.pow2_at_least(head_dim),
        BLOCK_SIZE=block_size, TILE=TILE, FP32=_common.compute_in_fp32(q, k_cache, _prefill_kernel),
        SOFTCAP=softcap > 0,
    )
