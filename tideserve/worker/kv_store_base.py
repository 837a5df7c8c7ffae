"""What every KV store is: per-layer K and V tensors addressed by block id, the layout they share, and the
arithmetic of stores over one reserved range (regions, views, slot fills).

Apart from ``kv_store.py`` (the host and copying stores, the choice of store, the KV storage) so that the
mapped store on CUDA (``cuda_kv_store.py``) builds on it without the two importing each other.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tideserve.core.kv_cache.geometry import KVGeometry, KVStoreLimits


class KVStoreGrowError(RuntimeError):
    """Growing the pool failed (out of memory, or beyond the reservation); the store is unchanged."""


@dataclass(frozen=True)
class KVLayout:
    """The shape of one token's KV: what every store, the runner and the pool's arithmetic share."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def token_bytes(self) -> int:
        """Bytes of one token in one layer's K (or V)."""
        return self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block across every layer's K and V."""
        return 2 * self.num_layers * block_size * self.token_bytes


def as_copyable(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or for a float8 cache its bytes: torch's CPU index_copy_ / index_fill_ have no float8
    kernels, and moving or zeroing the bytes is the same operation."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


def fill_code(t: torch.Tensor, value: float) -> float | int:
    """``value`` as ``as_copyable(t)`` holds it (a float8 value's byte)."""
    if t.is_floating_point() and t.element_size() == 1:
        return int(torch.tensor(value).to(t.dtype).view(torch.uint8))
    return value


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def round_down(n: int, to: int) -> int:
    return n // to * to


def region_bytes_for(reserve_bytes: int, num_regions: int, align: int) -> int:
    """Bytes of each of ``num_regions`` equal regions that together hold ``reserve_bytes``, each a multiple of
    ``align`` (a huge page on the host, the driver's granularity on a GPU)."""
    return round_up(max(1, math.ceil(reserve_bytes / num_regions)), align)


def region_views(regions: torch.Tensor, layout: KVLayout, num_blocks: int,
                 block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each ``[num_blocks, block_size, heads, dim]`` at the start of its region: ``regions``
    is ``[2 * num_layers, elements]`` in the cache dtype, K of layer i in row 2i and its V in row 2i + 1."""
    shape = (num_blocks, block_size, layout.num_kv_heads, layout.head_dim)
    elems = num_blocks * block_size * layout.num_kv_heads * layout.head_dim
    return [(regions[2 * i, :elems].view(shape), regions[2 * i + 1, :elems].view(shape))
            for i in range(layout.num_layers)]


def fill_region_slots(regions: torch.Tensor, layout: KVLayout, num_tokens: int, slots: torch.Tensor,
                      value: float) -> None:
    """``fill_slots`` over every layer at once: the regions read as ``[2 * layers, tokens, heads * dim]``."""
    width = layout.num_kv_heads * layout.head_dim
    raw = as_copyable(regions)
    raw[:, :num_tokens * width].view(2 * layout.num_layers, num_tokens, width).index_fill_(
        1, slots, fill_code(regions, value))


class KVStore(ABC):
    """Per-layer K and V, each ``[num_blocks, block_size, num_kv_heads, head_dim]`` and contiguous."""

    def __init__(self, layout: KVLayout, device: torch.device, block_size: int) -> None:
        self.layout = layout
        self.device = device
        self.block_size = block_size
        self.num_blocks = 0
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Asked before each chunk of pages a growth commits: may this many more bytes be made resident now?
        # (None: always.) A store whose allocations fail cleanly (a GPU's) never asks.
        self.commit_guard: Callable[[int], bool] | None = None

    def bytes_per_block(self, block_size: int | None = None) -> int:
        return self.layout.block_bytes(block_size or self.block_size)

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block()

    @property
    def fixed_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per-layer K and V over the store's whole reservation, ``[capacity blocks, block_size, heads, dim]``,
        at addresses and shapes that no resize changes (only a block-size change does); the same list object
        until then. Blocks past ``num_blocks`` must never be read or written through them. What a captured
        CUDA graph holds (worker/cuda_graphs.py): a resize then leaves it valid. None: a store whose resizes
        move its tensors."""
        return None

    @property
    def bytes_outside_allocator(self) -> int:
        """Bytes of the pool that the platform's ``used_by_process_bytes`` does not see (device memory the
        driver maps beside torch's allocator); 0 where the probe counts the pool."""
        return 0

    def describe(self) -> str:
        """What holds the pool and what a resize costs, for the start-up log."""
        return type(self).__name__

    def close(self) -> None:
        """Give the store's memory and address space back now (garbage collection does the same later)."""
        return None

    @abstractmethod
    def resize(self, num_blocks: int) -> None:
        """Make blocks 0..num_blocks-1 addressable; blocks below min(old, new) keep their KV."""

    def commit_ahead(self, num_blocks: int, on_done: Callable[[], None] | None = None) -> bool:
        """Prepare a growth to ``num_blocks`` off the caller's thread; True when ``resize`` may follow at
        once (stores without background commits: always). ``on_done`` is called once: when a commit this
        call starts ends, or at once when it starts none."""
        if on_done is not None:
            on_done()
        return True

    @property
    def commit_in_flight(self) -> bool:
        """Whether a background commit (``commit_ahead``) is running now."""
        return False

    @property
    def committed_ahead_blocks(self) -> int:
        """The largest pool whose pages are committed already (a resize to it commits nothing)."""
        return self.num_blocks

    @property
    def commit_goal_blocks(self) -> int:
        """The largest pool a background commit under way will have made resident (a growth up to it waits
        only for the part it needs); ``committed_ahead_blocks`` when none is."""
        return self.committed_ahead_blocks

    @abstractmethod
    def reshape_blocks(self, new_block_size: int) -> int:
        """Read the pool with another block size; only while no block holds live KV. Returns the new
        block count (the same bytes, or fewer)."""

    @abstractmethod
    def release_pages(self) -> None:
        """Hand every byte of the pool back while keeping its geometry: what the blocks held is lost (sleep
        mode, with no request holding KV). ``restore_pages`` makes the pool usable again."""

    @abstractmethod
    def restore_pages(self) -> None:
        """Make the pool's memory resident again after ``release_pages`` (zeroed)."""

    @abstractmethod
    def limits(self) -> KVStoreLimits:
        """What bounds a growth of this store (a reservation, or a copy beside the old pool)."""

    def max_blocks_within(self, spare_bytes: int) -> int:
        """The largest pool size a resize can reach when ``spare_bytes`` more memory may be taken."""
        return self.limits().max_blocks_within(self.geometry_now(), spare_bytes)

    def geometry_now(self) -> KVGeometry:
        """This store's block size and count as a geometry (its own bytes per token)."""
        layout = self.layout
        return KVGeometry(layout.num_layers, layout.token_bytes, str(layout.dtype).removeprefix("torch."),
                          self.block_size, self.num_blocks)

    def copy_blocks(self, moves: list[tuple[int, int]]) -> None:
        """Copy the KV of block ``src`` to block ``dst`` for each (src, dst): compaction's only copy."""
        if not moves:
            return
        src = torch.tensor([m[0] for m in moves], dtype=torch.long, device=self.device)
        dst = torch.tensor([m[1] for m in moves], dtype=torch.long, device=self.device)
        for k, v in self.caches:
            for t in (as_copyable(k), as_copyable(v)):
                t.index_copy_(0, dst, t.index_select(0, src))

    def fill_slots(self, slots: torch.Tensor, value: float = 0.0) -> None:
        """Set the token slots ``block_id * block_size + offset`` of every layer's K and V to ``value``."""
        hd = (self.layout.num_kv_heads, self.layout.head_dim)
        for k, v in self.caches:
            for t in (as_copyable(k), as_copyable(v)):
                t.view(-1, *hd).index_fill_(0, slots, fill_code(k, value))
