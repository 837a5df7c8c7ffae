"""Paged attention over block-structured KV caches.

The model code sees one flat batch of tokens from many requests, no padding. The runner orders the batch
so that every single-token query (decodes) comes first, then the multi-token queries (prefill chunks).
New keys and values are written into the cache through ``slot_mapping``; every read goes through the
block tables, expanded by the runner into per-request slot lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tideserve import native

_HAS_ENABLE_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


@dataclass
class PrefillSpan:
    """One request's multi-token query inside the flat batch.

    ``context_len`` counts every key the query attends to (cached prefix + this chunk). When it equals
    ``query_len`` nothing is cached yet, and the chunk's own keys are used directly with a causal mask.
    """

    start: int
    query_len: int
    context_len: int
    slots: torch.Tensor | None = None  # [context_len] cache slots of the whole context (None when no prefix)
    mask: torch.Tensor | None = None  # [1, 1, query_len, context_len] bool, True = may attend


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
class AttentionMetadata:
    """What attention needs to know about the flat batch; built once per step by the model runner."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V goes in the cache
    num_decode_tokens: int = 0  # the first num_decode_tokens tokens are single-token queries
    # [num_decodes, max_blocks] int64 block tables, padded with each request's own first block (so a
    # padded read never touches a block that was not written), and the mask of real keys:
    # [num_decodes, 1, 1, max_blocks * block_size] bool, True = a key of this request.
    decode_block_tables: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    # Or the decodes split by context length, so short contexts are not padded to the longest one.
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    # Or, for the native kernel (tideserve/native), which reads the paged cache in place: every decode's
    # raw block table (padding never read) in decode_block_tables, and its context length here.
    decode_context_lens: torch.Tensor | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)

    def decode_batches(self, block_size: int) -> list[DecodeGroup]:
        if self.decode_groups:
            return self.decode_groups
        if self.num_decode_tokens and self.decode_context_lens is not None:
            return [self._padded_group(block_size)]
        if self.num_decode_tokens:
            assert self.decode_block_tables is not None and self.decode_mask is not None
            return [DecodeGroup(0, self.num_decode_tokens, self.decode_block_tables, self.decode_mask)]
        return []

    def _padded_group(self, block_size: int) -> DecodeGroup:
        """One group padded to the longest context, from the native kernel's tables and lengths: what the
        torch path runs when the kernel turns a call down."""
        assert self.decode_block_tables is not None and self.decode_context_lens is not None
        lens = self.decode_context_lens
        num_blocks = int((lens.max() + block_size - 1) // block_size)
        tables = self.decode_block_tables[:, :num_blocks]
        used = torch.arange(num_blocks, device=lens.device)[None, :] < ((lens + block_size - 1) // block_size)[:, None]
        mask = torch.arange(num_blocks * block_size, device=lens.device)[None, :] < lens[:, None]
        return DecodeGroup(0, self.num_decode_tokens, torch.where(used, tables, tables[:, :1]),
                           mask[:, None, None, :])


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


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Single-token queries. q: [B, H, D]; k, v: [B, KVH, L, D]; mask: [B, 1, 1, L].

    The query heads that share one KV head become that head's "query rows" ([B, KVH, group, D]), so
    grouped-query attention reads each KV head once and never copies it per query head.
    """
    b, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    qg = q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, num_heads, head_dim)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_stored: bool = False,
) -> torch.Tensor:
    """Store this step's K/V in the paged cache (unless ``kv_stored`` says it is already there), then attend.

    q: [T, H, D]; k, v: [T, KVH, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D].
    Returns [T, H, D].
    """
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    if not kv_stored:
        k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))

    out = torch.empty_like(q)
    n = meta.num_decode_tokens
    native_done = (n > 0 and meta.decode_context_lens is not None and meta.decode_block_tables is not None
                   and native.paged_decode_attention(q[:n], k_cache, v_cache, meta.decode_block_tables,
                                                     meta.decode_context_lens, scale, out[:n]))
    for group in ([] if native_done else meta.decode_batches(k_cache.shape[1])):
        # Whole blocks are gathered (a few large copies, not one per token), then viewed as keys.
        b, nb = group.block_tables.shape
        idx = group.block_tables.reshape(-1)
        lk = nb * k_cache.shape[1]
        kd = k_cache.index_select(0, idx).view(b, lk, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        vd = v_cache.index_select(0, idx).view(b, lk, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        out[group.start:group.end] = _decode_attention(q[group.start:group.end], kd, vd, group.mask, scale)
    for span in meta.prefills:
        end = span.start + span.query_len
        qs = q[span.start:end].transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
        if span.slots is None:
            ks = k[span.start:end].transpose(0, 1).unsqueeze(0)
            vs = v[span.start:end].transpose(0, 1).unsqueeze(0)
            o = _sdpa(qs, ks, vs, scale, causal=True)
        else:
            ks = k_flat.index_select(0, span.slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
            vs = v_flat.index_select(0, span.slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
            o = _sdpa(qs, ks, vs, scale, mask=span.mask)
        out[span.start:end] = o.squeeze(0).transpose(0, 1)
    return out
