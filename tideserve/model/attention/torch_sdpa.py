"""The reference backend: torch's scaled_dot_product_attention over gathered KV blocks, on any device.

Decodes are taken in groups of similar context length (``group_by_blocks``), each group's blocks gathered
whole (a few large copies, not one per token) and padded to its longest context with a mask; prefill
chunks attend causally to their own keys, or, after a cached prefix, to the whole context's slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from tideserve.model.attention.backend import AttentionBackend, AttentionMetadata
from tideserve.model.attention.batch_layout import BatchLayout, PrefillSpan

_HAS_ENABLE_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")

# What one more decode group costs, in padded block-rows (each layer pays a gather and an attention
# call per group): splitting is worth it when it saves more padding than this.
GROUP_OVERHEAD_BLOCK_ROWS = 16


def group_by_blocks(num_blocks: np.ndarray, overhead: int = GROUP_OVERHEAD_BLOCK_ROWS) -> list[tuple[int, int]]:
    """Split rows (sorted by ascending block count) into contiguous groups, each padded to its largest
    row, minimising padded block-rows plus ``overhead`` per group (exact, over distinct block counts)."""
    n = len(num_blocks)
    values, firsts = np.unique(num_blocks, return_index=True)
    bounds = [int(i) for i in firsts] + [n]
    d = len(values)
    best = [0.0] + [float("inf")] * d
    cut = [0] * (d + 1)
    for j in range(1, d + 1):
        for i in range(j):
            cost = best[i] + (bounds[j] - bounds[i]) * int(values[j - 1]) + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], d
    while j > 0:
        groups.append((bounds[cut[j]], bounds[j]))
        j = cut[j]
    return groups[::-1]


@dataclass
class DecodeGroup:
    """Decode rows ``start:end`` (contexts of similar length), attended together.

    ``block_tables``: [rows, max_blocks] int64, padded with each request's own first block (so a padded
    read never touches another request's block); ``mask``: [rows, 1, 1, max_blocks * block_size] bool,
    True = a key of this request.
    """

    start: int
    end: int
    block_tables: torch.Tensor
    mask: torch.Tensor


@dataclass
class TorchMetadata(AttentionMetadata):
    """Decodes as groups of padded tables + masks; prefills as spans."""

    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)


def build_prefill_spans(layout: BatchLayout, to_device) -> list[PrefillSpan]:
    """The SDPA prefill spans of a layout's rows after its decodes."""
    bs = layout.block_size
    spans = []
    for i in range(layout.num_decodes, len(layout.query_lens)):
        q_len, start, ctx_len = int(layout.query_lens[i]), int(layout.num_computed[i]), int(layout.context_lens[i])
        span = PrefillSpan(start=int(layout.query_start_loc[i]), query_len=q_len, context_len=ctx_len)
        if start > 0:
            nb = -(-ctx_len // bs)
            slots = (layout.block_tables[i, :nb, None] * bs + np.arange(bs)).reshape(-1)[:ctx_len]
            key_pos = np.arange(ctx_len)[None, :]
            query_pos = start + np.arange(q_len)[:, None]
            span.slots = to_device(slots)
            span.mask = to_device((key_pos <= query_pos)[None, None])
        spans.append(span)
    return spans


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
          mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """q: [B, H, Lq, D]; k, v: [B, KVH, Lk, D]. Grouped-query heads share K/V without copies where the
    installed torch supports it."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads != num_kv_heads:
        if _HAS_ENABLE_GQA:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                                  enable_gqa=True)
        group = num_heads // num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
               causal: bool, softcap: float) -> torch.Tensor:
    """``_sdpa``, or, with ``softcap``, transformers' eager arithmetic: scores s = q k^T * scale capped to
    softcap * tanh(s / softcap) (SDPA has no hook between the product and the softmax), masked, softmax in
    float32. q: [B, H, Lq, D]; k, v: [B, KVH, Lk, D]; mask: bool, True = may attend."""
    if not softcap:
        return _sdpa(q, k, v, scale, mask=mask, causal=causal)
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if causal:
        lq, lk = s.shape[-2], s.shape[-1]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril(lk - lq)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), v)


def _window_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[Lq, Lk] bool: key at or before the query and within its window (window 0: the whole context)."""
    keep = key_pos[None, :] <= query_pos[:, None]
    if window:
        keep &= key_pos[None, :] > query_pos[:, None] - window
    return keep


def attend_prefills(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, prefills: list[PrefillSpan], scale: float, out: torch.Tensor, *,
                    window: int = 0, softcap: float = 0.0) -> None:
    """Each span's queries into ``out``: causal over its own keys, or over its context's cached slots (each
    query within its ``window`` when there is one). Its own keys and values are taken as the cache holds
    them (rounded to its dtype), as every later step and every chunk after a cached prefix reads them: a
    token's attention does not depend on how its prompt was cut."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    for span in prefills:
        end = span.start + span.query_len
        qs = q[span.start:end].transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
        mask = span.mask
        if window and span.context_len > window:
            first = span.context_len - span.query_len  # the position of the span's first query
            key_pos = torch.arange(span.context_len if span.slots is not None else span.query_len, device=q.device)
            query_pos = torch.arange(span.query_len, device=q.device) + (first if span.slots is not None else 0)
            mask = _window_mask(query_pos, key_pos, window)[None, None]
        if span.slots is None:
            ks = k[span.start:end].to(k_cache.dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)
            vs = v[span.start:end].to(v_cache.dtype).to(q.dtype).transpose(0, 1).unsqueeze(0)
            o = _attention(qs, ks, vs, scale, mask, mask is None, softcap)
        else:
            ks = k_flat.index_select(0, span.slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
            vs = v_flat.index_select(0, span.slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
            o = _attention(qs, ks, vs, scale, mask, False, softcap)
        out[span.start:end] = o.squeeze(0).transpose(0, 1)


def _decode_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  scale: float, softcap: float = 0.0) -> torch.Tensor:
    """Single-token queries. q: [B, H, D]; k, v: [B, KVH, L, D]; mask: [B, 1, 1, L].

    The query heads that share one KV head become that head's "query rows" ([B, KVH, group, D]), so
    grouped-query attention reads each KV head once and never copies it per query head.
    """
    b, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    qg = q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = _attention(qg, k, v, scale, mask, False, softcap)
    return out.reshape(b, num_heads, head_dim)


class TorchSDPABackend(AttentionBackend):
    """Runs wherever torch does; the reference the other backends are tested against."""

    name = "torch"

    def build_metadata(self, layout: BatchLayout) -> TorchMetadata:
        to_dev = self._to_device
        meta = TorchMetadata(self, to_dev(layout.slot_mapping), layout.num_decodes)
        n, bs = layout.num_decodes, layout.block_size
        if n:
            ctx = layout.context_lens[:n]
            # The runner sorts decodes by context length, so groups are contiguous runs; any other order
            # (a hand-built batch) is attended as one group padded to its longest context.
            ordered = bool(np.all(ctx[1:] >= ctx[:-1]))
            for lo, hi in group_by_blocks(-(-ctx // bs)) if ordered else [(0, n)]:
                c = ctx[lo:hi]
                nb = -(-int(c.max()) // bs)
                tables = layout.block_tables[lo:hi, :nb]
                used = np.arange(nb)[None, :] < -(-c[:, None] // bs)
                valid = np.arange(nb * bs)[None, :] < c[:, None]
                meta.decode_groups.append(DecodeGroup(lo, hi, to_dev(np.where(used, tables, tables[:, :1])),
                                                      to_dev(valid[:, None, None, :])))
        meta.prefills = build_prefill_spans(layout, to_dev)
        return meta

    def attend(self, q, k, v, k_cache, v_cache, meta: TorchMetadata, scale, out, *, window=0, softcap=0.0):
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        for group in meta.decode_groups:
            # Whole blocks are gathered (a few large copies, not one per token), then viewed as keys.
            b, nb = group.block_tables.shape
            idx = group.block_tables.reshape(-1)
            lk = nb * k_cache.shape[1]
            kd = k_cache.index_select(0, idx).view(b, lk, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
            vd = v_cache.index_select(0, idx).view(b, lk, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
            mask = group.mask
            if window:  # the keys of each row's window: the last ``window`` of its context
                context = mask.sum(-1, keepdim=True)
                mask = mask & (torch.arange(lk, device=mask.device) >= context - window)
            out[group.start:group.end] = _decode_group(q[group.start:group.end], kd, vd, mask, scale, softcap)
        attend_prefills(q, k, v, k_cache, v_cache, meta.prefills, scale, out, window=window, softcap=softcap)
