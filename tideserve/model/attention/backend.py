"""The attention backend interface: one object per engine, chosen once at load (``selector.py``).

A backend owns three things that must agree with each other: its metadata builder (``build_metadata``:
a ``BatchLayout`` -> the tensors its kernels read), the kernels themselves (bound once, at construction,
after checking device, dtypes and layout), and ``forward``. The model calls ``meta.backend.forward``, so
one loaded model can serve engines with different backends at once (tests share models this way).

``AttentionMetadata``, the base of every backend's metadata, lives here beside the backend because each
names the other; what a builder reads (``BatchLayout``) lives below both, in batch_layout.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tideserve.model.attention.batch_layout import BatchLayout

# Rotate q|k of qkv [T, (H + 2 KVH) * D] in place and store k, v at meta.slot_mapping in the caches.
RopeStore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class AttentionBackend(ABC):
    """Paged attention over ``[num_blocks, block_size, KVH, D]`` caches for a flat, unpadded batch."""

    name: str = ""
    # A kernel that does rotary and the KV store in one pass (bound at construction), or None: then the
    # model rotates with torch and ``forward`` stores K/V itself.
    rope_store: RopeStore | None = None
    # The per-row tensors of a decode-only step's metadata (first dimension = the batch), read by a
    # captured graph from static buffers (worker/cuda_graphs.py); empty: this backend's steps stay eager.
    graph_fields: tuple[str, ...] = ()

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    @abstractmethod
    def build_metadata(self, layout: BatchLayout) -> AttentionMetadata:
        """This backend's metadata for one step, on its device."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, kv_stored: bool = False, *,
                window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """Store this step's K/V in the cache (unless ``kv_stored``: ``rope_store`` did), then attend.

        ``window`` > 0: a query at position p attends keys p - window + 1 .. p only (a sliding-window
        layer); ``softcap`` > 0: each scaled score s becomes softcap * tanh(s / softcap) before the softmax.

        q: [T, H, D] with unit stride in D and D in H (rows may be strided: q is a view of the fused
        qkv); k, v: [T, KVH, D]; caches: contiguous [num_blocks, block_size, KVH, D] (the KV store's
        contract). Returns [T, H, D] in q's dtype, contiguous.
        """
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if window or softcap:
            self.attend(q, k, v, k_cache, v_cache, meta, scale, out, window=window, softcap=softcap)
        else:
            self.attend(q, k, v, k_cache, v_cache, meta, scale, out)
        return out

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor, *,
               window: int = 0, softcap: float = 0.0) -> None:
        """Write every query's attention over its cached context (or its ``window``, soft-capped by
        ``softcap``: see ``forward``) into ``out`` (the K/V are stored)."""

    def describe(self) -> str:
        """What the start-up line ``decode attention: ...`` says."""
        return self.name

    def _to_device(self, array) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device)


@dataclass
class AttentionMetadata:
    """What every backend's metadata has: its backend (which attends), where this step's K/V go, and how
    many of the leading tokens are single-token queries. Each backend subclasses it with its encoding."""

    backend: AttentionBackend
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode_tokens: int


@dataclass
class GroupedMetadata:
    """One step's metadata for a model with several KV cache groups (core/kv_cache/groups.py): each group
    has its own block tables, hence its own slot mapping and metadata; every layer attends with its
    group's (``for_layer``). The model passes each layer its own, so backends and kernels see plain
    ``AttentionMetadata`` and need not know groups exist."""

    groups: list[AttentionMetadata]
    layer_group: tuple[int, ...]

    def for_layer(self, layer: int) -> AttentionMetadata:
        return self.groups[self.layer_group[layer]]


def metadata_per_layer(meta: AttentionMetadata | GroupedMetadata, num_layers: int) -> list[AttentionMetadata]:
    """Each layer's metadata: its group's, or the one shared by every layer."""
    if isinstance(meta, GroupedMetadata):
        return [meta.for_layer(i) for i in range(num_layers)]
    return [meta] * num_layers


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, KVH, D] into the flat slots of the caches (torch's path; the CPU kernel fuses it with rotary)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    if k_flat.element_size() == 1:  # float8: torch's CPU index_copy_ has no such kernel, its bytes copy alike
        k_flat.view(torch.uint8).index_copy_(0, slot_mapping, k.to(k_flat.dtype).view(torch.uint8))
        v_flat.view(torch.uint8).index_copy_(0, slot_mapping, v.to(v_flat.dtype).view(torch.uint8))
        return
    k_flat.index_copy_(0, slot_mapping, k.to(k_flat.dtype))
    v_flat.index_copy_(0, slot_mapping, v.to(v_flat.dtype))
