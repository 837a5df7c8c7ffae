"""The KV tensors of every layer, addressed by block id, and their elastic moves.

Why a store of its own: the elastic pool grows and shrinks many times a day, and a resize that copies the
whole pool (or needs old + new storage at once) costs seconds and, on a GPU, fails exactly when memory is
tight. Two ways to hold the tensors:

- ``ReservedKVStore`` (CPU): one virtual address range reserved for the largest pool the machine could
  ever give, with no memory behind it. Each layer's K and V own a fixed, 2 MiB-aligned region of it, so
  a layer's cache is always one contiguous tensor starting at the same address. Growing commits the pages
  of the new blocks (``MADV_POPULATE_WRITE``, or writing zeros); shrinking hands the tail's pages back to
  the kernel (``MADV_DONTNEED``). Nothing is copied, nothing is allocated twice, and the cost is
  proportional to the bytes that change. Live blocks above a new end are moved by the caller first
  (compaction), one block at a time. A growth the pool sees coming (usage past its high watermark) can
  commit its pages ahead, on a thread of its own (``commit_ahead``), a chunk of every region at a time,
  each usable once done: on virtual machines that hand freed memory back to the host, a first touch costs
  3-8 s per GiB, and a commit on the engine's thread stops every step for that long.
- ``MappedKVStore`` (CUDA, ``worker/cuda_kv_store.py``): the same layout over one reserved range of device
  addresses, into which the driver maps device memory in its granularity as the pool grows and from which
  it unmaps it as the pool shrinks.
- ``CopyKVStore`` (any device without the above, and fixed-size pools on CUDA): one tensor per pool size. A
  resize copies the blocks that stay into a new tensor, so growth is capped to what fits beside the existing
  storage (about half the free memory); an allocation failure raises ``KVStoreGrowError`` and leaves the
  store as it was.

A block-size change re-chunks every token, so it is done only when no request holds KV (then the same
bytes are simply read with another block size; no copy either way). The host swap tier is a store too.
``KVCacheStorage`` holds the device pool and the swap tier together and carries out every move of their
bytes, so the runner only reads the caches. What every store shares (``KVStore``, ``KVLayout``,
``KVStoreGrowError``, the region arithmetic) lives in ``kv_store_base.py`` and is named here too.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
from collections.abc import Callable

import numpy as np
import torch

from tideserve.core.kv_cache.geometry import KVGeometry, KVStoreLimits
from tideserve.platform import platform_for
from tideserve.worker.kv_store_base import (  # the base of every store, named here too for the callers
    KVLayout,
    KVStore,
    KVStoreGrowError,
    as_copyable,
    fill_code,
    fill_region_slots,
    region_bytes_for,
    region_views,
    round_down,
    round_up,
)

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
# Regions start on 2 MiB boundaries. Transparent huge pages are not requested: they would commit memory in
# 2 MiB steps per layer region (120 MiB for a 30-layer model's smallest pool) and blur the footprint that
# co-tenants read; 4 KiB pages commit at about 0.25 s per GiB here, well within a growth step.
HUGE_PAGE = 2 * 2**20
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux value; the reservation costs no commit charge
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
# A background commit publishes its progress after each chunk of this many bytes (all regions together).
AHEAD_CHUNK_BYTES = 4 * 2**20


def _libc_madvise():
    """libc's madvise(addr, length, advice) -> int through ctypes (which releases the GIL), or None."""
    global _MADVISE
    if _MADVISE is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError):
            return None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _MADVISE = fn
    return _MADVISE


_MADVISE = None


def copy_between(src: KVStore, dst: KVStore, pairs: list[tuple[int, int]]) -> None:
    """Copy blocks ``(src block, dst block)`` from one store to another (the swap tier's moves)."""
    if not pairs:
        return
    s = torch.tensor([p[0] for p in pairs], dtype=torch.long)
    d = torch.tensor([p[1] for p in pairs], dtype=torch.long)
    s_src, d_dst = s.to(src.device), d.to(dst.device)
    # Host to GPU may overlap (the device consumes the copy in stream order); to the host it must not,
    # since the host reads the result at once.
    overlap = platform_for(dst.device).async_host_copies
    for (k, v), (dk, dv) in zip(src.caches, dst.caches, strict=True):
        for a, b in ((k, dk), (v, dv)):
            as_copyable(b).index_copy_(0, d_dst, as_copyable(a).index_select(0, s_src).to(dst.device,
                                                                                        non_blocking=overlap))


class ReservedKVStore(KVStore):
    """CPU pool over one reserved address range: resizes commit or release pages, never copy."""

    def __init__(self, layout: KVLayout, block_size: int, num_blocks: int, reserve_bytes: int,
                 populate: bool = True) -> None:
        """``reserve_bytes``: the largest pool ever (virtual only); ``populate``: commit the pages of new
        blocks at once (an honest footprint for neighbours reading the cgroup) instead of on first write."""
        super().__init__(layout, torch.device("cpu"), block_size)
        regions = 2 * layout.num_layers
        self.region_bytes = region_bytes_for(reserve_bytes, regions, HUGE_PAGE)
        self.populate = populate
        self._map = mmap.mmap(-1, regions * self.region_bytes,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        self._can_populate = True
        raw = torch.frombuffer(self._map, dtype=torch.uint8).view(regions, self.region_bytes)
        self._base = raw.data_ptr()
        # Pages committed ahead of the pool's end: [end, _ahead_end) surely, up to _ahead_target maybe
        # (while the thread runs, or after it failed part way).
        self._ahead_thread: threading.Thread | None = None
        self._ahead_end = 0
        self._ahead_target = 0
        self._ahead_failed = False
        self._ahead_cancel = threading.Event()
        self._ahead_progress = threading.Condition()  # notified as each chunk is done, and when the thread ends
        self._ahead_done = True  # whether the latest thread has ended (set under _ahead_progress)
        elem = raw.new_empty((), dtype=layout.dtype).element_size()
        self._regions = raw[:, :round_down(self.region_bytes, elem)].view(layout.dtype)
        self.capacity_tokens = self.region_bytes // layout.token_bytes
        self._fixed: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.resize(num_blocks)

    @classmethod
    def try_create(cls, layout: KVLayout, block_size: int, num_blocks: int, reserve_bytes: int,
                   populate: bool = True) -> ReservedKVStore | None:
        """A reservation of ``reserve_bytes``, halved until the kernel grants one that still holds
        ``num_blocks`` (strict overcommit or an address-space limit may refuse a large one)."""
        need = num_blocks * layout.block_bytes(block_size)
        size = max(reserve_bytes, need)
        while True:
            try:
                return cls(layout, block_size, num_blocks, size, populate)
            except (OSError, ValueError, OverflowError) as exc:
                if size // 2 < need or size // 2 < HUGE_PAGE:
                    logger.warning("could not reserve %.2f GiB of address space for the KV cache (%s); "
                                   "resizes will copy", size / 2**30, exc)
                    return None
                size //= 2

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_tokens // self.block_size

    @property
    def fixed_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._fixed is None:
            self._fixed = region_views(self._regions, self.layout, self.capacity_blocks, self.block_size)
        return self._fixed

    def describe(self) -> str:
        return (f"reserved host range ({len(self._map) / 2**30:.1f} GiB of addresses, {2 * self.layout.num_layers} "
                "regions, one per layer's K and V): resizes commit and release pages in place, nothing is copied")

    @property
    def committed_bytes(self) -> int:
        """Bytes of the pool's pages that are (or may be) resident: every region up to the pool's end, or
        up to what is being committed ahead of it."""
        end = max(self._end_bytes(self.num_blocks), self._ahead_target)
        return 2 * self.layout.num_layers * round_up(end, PAGE)

    def commit_ahead(self, num_blocks: int, on_done: Callable[[], None] | None = None) -> bool:
        """Commit the pages of a pool of ``num_blocks`` on a background thread; True once they are
        committed (``resize(num_blocks)`` then commits nothing), False while that is under way. The
        commits run with the GIL released (libc's madvise through ctypes), so steps and the server's
        event loop go on meanwhile, and in chunks across every region, each published when done
        (``committed_ahead_blocks``): a growth may take the part committed so far without waiting for
        the rest. A failure is left for ``resize`` to meet and report. ``on_done`` is called once, when
        the thread this call starts ends, or at once when it starts none."""
        started = False
        try:
            end = round_up(self._end_bytes(num_blocks), PAGE)
            if not self.populate or not self._can_populate or num_blocks <= self.num_blocks:
                return True
            if self._ahead_thread is not None:
                if self._ahead_thread.is_alive():
                    return False
                self._ahead_thread = None
            if self._ahead_failed:  # resize meets the failure on the caller's thread, and reports it
                return True
            start = max(round_down(self._end_bytes(self.num_blocks), PAGE), self._ahead_end)
            if start >= end or num_blocks > self.capacity_blocks:
                return True
            self._ahead_target = max(self._ahead_target, end)
            self._ahead_cancel.clear()
            self._ahead_done = False
            self._ahead_thread = threading.Thread(target=self._commit_range, args=(start, end, on_done),
                                                  name="kv-commit-ahead", daemon=True)
            self._ahead_thread.start()
            started = True
            return False
        finally:
            if not started and on_done is not None:
                on_done()

    @property
    def commit_in_flight(self) -> bool:
        return self._ahead_thread is not None and self._ahead_thread.is_alive()

    @property
    def committed_ahead_blocks(self) -> int:
        return max(self.num_blocks, self._ahead_end // (self.block_size * self.layout.token_bytes))

    @property
    def commit_goal_blocks(self) -> int:
        if not self.commit_in_flight:
            return self.committed_ahead_blocks
        return max(self.num_blocks, self._ahead_target // (self.block_size * self.layout.token_bytes))

    def _commit_range(self, start: int, end: int, on_done: Callable[[], None] | None = None) -> None:
        """The background half of commit_ahead: every region's [start, end), a chunk of every region at a
        time; each chunk done moves ``_ahead_end``. Stops early when asked (a shrink or a block-size
        change) or when the kernel refuses."""
        try:
            madvise = _libc_madvise()
            chunk = round_up(max(AHEAD_CHUNK_BYTES // (2 * self.layout.num_layers), PAGE), PAGE)
            regions = 2 * self.layout.num_layers
            for lo in range(start, end, chunk):
                hi = min(end, lo + chunk)
                if self.commit_guard is not None and not self.commit_guard((hi - lo) * regions):
                    logger.info("background commit stopped at %.1f of %.1f MiB: the machine's free memory fell "
                                "under the floor", (lo - start) * regions / 2**20, (end - start) * regions / 2**20)
                    return  # what is committed stays usable; a growth beyond it commits (and checks) itself
                for i in range(regions):
                    if self._ahead_cancel.is_set():
                        return
                    if madvise is None or madvise(self._base + i * self.region_bytes + lo, hi - lo,
                                                  MADV_POPULATE_WRITE) != 0:
                        self._ahead_failed = True  # resize commits the rest itself and reports the kernel's answer
                        return
                with self._ahead_progress:
                    self._ahead_end = hi
                    self._ahead_progress.notify_all()
        finally:
            with self._ahead_progress:
                self._ahead_done = True
                self._ahead_progress.notify_all()
            if on_done is not None:
                on_done()

    def _wait_ahead(self, end: int) -> None:
        """Wait until the background commit has made bytes up to ``end`` resident, or has ended (done,
        stopped or failed): a growth inside its goal needs those pages, not the whole commit."""
        with self._ahead_progress:
            self._ahead_progress.wait_for(lambda: self._ahead_end >= end or self._ahead_done)

    def _join_ahead(self, cancel: bool = False) -> None:
        if self._ahead_thread is not None:
            if cancel:
                self._ahead_cancel.set()
            self._ahead_thread.join()
            self._ahead_thread = None

    def _forget_ahead(self, end: int) -> None:
        """The pool now ends at ``end``: pages committed ahead below it are the pool's own."""
        if self._ahead_target <= end:
            self._ahead_end = self._ahead_target = 0

    def _end_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.block_size * self.layout.token_bytes

    def _build_views(self) -> None:
        self.caches = region_views(self._regions, self.layout, self.num_blocks, self.block_size)

    def _commit(self, lo: int, hi: int) -> None:
        """Make bytes [lo, hi) of every region resident (zero pages), a chunk of every region at a time;
        before each chunk ``commit_guard`` is asked whether the machine still has room for it. When it has
        not (or the kernel refuses), what this call committed goes back and ``KVStoreGrowError`` is raised:
        the store is as it was."""
        start, end = round_down(lo, PAGE), round_up(hi, PAGE)
        if end <= start:
            return
        regions = 2 * self.layout.num_layers
        chunk = round_up(max(AHEAD_CHUNK_BYTES // regions, PAGE), PAGE)
        done = start
        try:
            for c_lo in range(start, end, chunk):
                c_hi = min(end, c_lo + chunk)
                if self.commit_guard is not None and not self.commit_guard((c_hi - c_lo) * regions):
                    raise KVStoreGrowError("the machine's free memory fell under the floor while the pool's pages "
                                           "were being committed")
                for i in range(regions):
                    self._commit_region(i, c_lo, c_hi, max(c_lo, lo), min(c_hi, hi))
                done = c_hi
        except KVStoreGrowError:
            self._release(lo, done)
            raise

    def _commit_region(self, region: int, start: int, end: int, lo: int, hi: int) -> None:
        """Pages [start, end) of one region resident; without MADV_POPULATE_WRITE, bytes [lo, hi) (the
        part nobody holds: the first page may hold a live block's bytes) are written with zeros."""
        if self._can_populate:
            try:
                self._map.madvise(MADV_POPULATE_WRITE, region * self.region_bytes + start, end - start)
                return
            except OSError as exc:
                if exc.errno == 12:  # ENOMEM
                    raise KVStoreGrowError(f"out of memory committing KV pages: {exc}") from exc
                self._can_populate = False  # kernel without MADV_POPULATE_WRITE: write zeros instead
        # Fresh or released pages read as zeros already; writing them commits them.
        elem = self._regions.element_size()
        self._regions[region, lo // elem:hi // elem].zero_()

    def _release(self, lo: int, hi: int) -> None:
        """Give the pages wholly inside bytes [lo, hi) of every region back to the kernel."""
        start, end = round_up(lo, PAGE), round_up(hi, PAGE)
        if end <= start:
            return
        for i in range(2 * self.layout.num_layers):
            self._map.madvise(mmap.MADV_DONTNEED, i * self.region_bytes + start, end - start)

    def resize(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}.")
        if num_blocks > self.capacity_blocks:
            raise KVStoreGrowError(f"{num_blocks} blocks exceed the reservation of {self.capacity_blocks}")
        old_end, new_end = self._end_bytes(self.num_blocks), self._end_bytes(num_blocks)
        # A growth within what the background thread has committed so far leaves it running, and one within
        # the thread's goal first waits for the part it needs; any other resize waits for the whole commit
        # (a shrink stops it first: its pages go back with the tail).
        if old_end < new_end <= self._ahead_target and self.commit_in_flight:
            self._wait_ahead(new_end)
        if not (old_end < new_end <= self._ahead_end):
            self._join_ahead(cancel=new_end < old_end)
            self._ahead_failed = False
        if new_end > old_end and self.populate:
            self._commit(max(old_end, min(self._ahead_end, new_end)), new_end)
        elif new_end < old_end:  # and whatever was committed ahead of the old end
            self._release(new_end, max(old_end, self._ahead_target))
            self._ahead_end = self._ahead_target = 0
        self.num_blocks = num_blocks
        self._forget_ahead(new_end)
        self._build_views()

    def release_pages(self) -> None:
        self.release_all()

    def restore_pages(self) -> None:
        if self.populate:
            self._commit(0, self._end_bytes(self.num_blocks))

    def release_all(self) -> None:
        """Hand every page back while keeping the size (a swap tier nobody uses)."""
        self._join_ahead(cancel=True)
        self._release(0, max(self._end_bytes(self.num_blocks), self._ahead_target))
        self._ahead_end = self._ahead_target = 0

    def reshape_blocks(self, new_block_size: int) -> int:
        tokens = self.num_blocks * self.block_size
        new_num = max(1, tokens // new_block_size)
        if new_num * new_block_size > self.capacity_tokens:
            raise KVStoreGrowError(f"block size {new_block_size} does not fit the reservation")
        self._join_ahead(cancel=True)
        old_end = self._end_bytes(self.num_blocks)
        if self._ahead_target > old_end:  # the pages committed for the old block size's growth
            self._release(old_end, self._ahead_target)
        self._ahead_end = self._ahead_target = 0
        self.block_size = new_block_size
        self._fixed = None
        new_end = self._end_bytes(new_num)
        if new_end < old_end:
            self._release(new_end, old_end)
        elif new_end > old_end and self.populate:
            self._commit(old_end, new_end)
        self.num_blocks = new_num
        self._build_views()
        return new_num

    def limits(self) -> KVStoreLimits:
        return KVStoreLimits(copies_on_resize=False, capacity_tokens=self.capacity_tokens)

    def fill_slots(self, slots: torch.Tensor, value: float = 0.0) -> None:
        """One call for every layer: the regions read as [2 * layers, tokens, heads * dim]."""
        fill_region_slots(self._regions, self.layout, self.num_blocks * self.block_size, slots, value)


def _is_out_of_memory(exc: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None)
    return (oom is not None and isinstance(exc, oom)) or isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


def release_freed_memory(device: torch.device) -> None:
    """Hand freed memory back: CUDA's caching allocator, or glibc's heap on CPU (the device's platform)."""
    platform_for(device).release_freed_memory()


class CopyKVStore(KVStore):
    """One tensor per pool size: resizes copy the kept blocks into a new tensor (see the module doc)."""

    def __init__(self, layout: KVLayout, device: torch.device, block_size: int, num_blocks: int,
                 zero: bool = False, pin_memory: bool = False, why: str = "") -> None:
        """``why``: the reason this store holds a pool that could have resized in place, for the log."""
        super().__init__(layout, device, block_size)
        self.zero = zero
        self.pin_memory = pin_memory
        self.why = why
        self.storage: torch.Tensor | None = None
        self.storage = self._allocate(num_blocks, block_size)
        self.num_blocks = num_blocks
        self._build_views()

    def _allocate(self, num_blocks: int, block_size: int) -> torch.Tensor:
        L = self.layout
        shape = (L.num_layers, 2, num_blocks, block_size, L.num_kv_heads, L.head_dim)
        try:
            alloc = torch.zeros if self.zero else torch.empty
            if self.pin_memory:
                return alloc(shape, dtype=L.dtype, pin_memory=True)
            return alloc(shape, dtype=L.dtype, device=self.device)
        except Exception as exc:
            if _is_out_of_memory(exc):
                raise KVStoreGrowError(f"out of memory allocating {num_blocks} KV blocks: {exc}") from exc
            raise

    def _build_views(self) -> None:
        s = self.storage
        self.caches = [(s[i, 0], s[i, 1]) for i in range(self.layout.num_layers)]

    def release_pages(self) -> None:
        if self.storage is not None:
            self.caches, self.storage = [], None
            release_freed_memory(self.device)

    def restore_pages(self) -> None:
        if self.storage is None:
            zero, self.zero = self.zero, True
            try:
                self.storage = self._allocate(self.num_blocks, self.block_size)
            finally:
                self.zero = zero
            self._build_views()

    def resize(self, num_blocks: int) -> None:
        if num_blocks == self.num_blocks:
            return
        new = self._allocate(num_blocks, self.block_size)  # raises KVStoreGrowError, store unchanged
        keep = min(num_blocks, self.num_blocks)
        new[:, :, :keep].copy_(self.storage[:, :, :keep])
        self.caches = []
        self.storage = new
        self.num_blocks = num_blocks
        self._build_views()
        release_freed_memory(self.device)

    def reshape_blocks(self, new_block_size: int) -> int:
        tokens = self.num_blocks * self.block_size
        new_num = max(1, tokens // new_block_size)
        L = self.layout
        if new_num * new_block_size == tokens:  # same bytes, read in other chunks
            self.storage = self.storage.view(L.num_layers, 2, new_num, new_block_size, L.num_kv_heads,
                                             L.head_dim)
        else:  # nothing live: free first, then allocate (never old + new at once)
            self.caches, self.storage = [], None
            release_freed_memory(self.device)
            self.storage = self._allocate(new_num, new_block_size)
        self.block_size = new_block_size
        self.num_blocks = new_num
        self._build_views()
        return new_num

    def limits(self) -> KVStoreLimits:
        # The new tensor is allocated while the old one still exists: it must fit beside it.
        return KVStoreLimits(copies_on_resize=True)

    def describe(self) -> str:
        if self.zero:  # a fixed-size pool: nothing resizes it
            return f"one tensor on {self.device}, allocated once at its fixed size"
        text = (f"one tensor on {self.device}: every resize allocates a new one and copies the kept blocks into "
                "it, so a growth must fit beside the pool (an elastic pool reaches about half the free memory)")
        return f"{text}; {self.why}" if self.why else text

    def fill_slots(self, slots: torch.Tensor, value: float = 0.0) -> None:
        s = as_copyable(self.storage)
        s.view(*s.shape[:2], -1, *s.shape[4:]).index_fill_(2, slots, fill_code(self.storage, value))


_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _word(*num_bytes: int) -> torch.dtype:
    """The widest integer type whose size divides every one of ``num_bytes``.

    Why copies of the KV tiers' payloads go by words: an indexed copy (``index_copy_``, ``index_select``)
    moves one element at a time, so the same bytes move several times faster as 8-byte words than as single
    bytes. Rows of a cache are whole blocks and payload columns whole layers, so 8 divides them in every
    layout in practice; narrower types keep any other one working."""
    for dtype in _WORDS:
        size = torch.empty((), dtype=dtype).element_size()
        if all(n % size == 0 for n in num_bytes):
            return dtype
    return torch.uint8


def _block_rows(cache: torch.Tensor, *num_bytes: int) -> torch.Tensor:
    """A cache tensor as one row per block (a view: writes land in the cache), in the widest integer type
    that divides its row, its offset and ``num_bytes`` (the payload's offsets the row is copied to or from)."""
    rows = cache.view(cache.shape[0], -1).view(torch.uint8)
    return rows.view(_word(rows.shape[1], rows.storage_offset(), *num_bytes))


def create_kv_store(layout: KVLayout, device: torch.device, block_size: int, num_blocks: int,
                    reserve_bytes: int, static: bool) -> KVStore:
    """The device's pool: a reserved host range on CPU, a mapped device range where the driver maps memory in
    steps (CUDA, ``MappedKVStore``), both resizing without a copy; else a copying tensor, which says why.

    ``reserve_bytes`` is the largest the pool may ever grow to; ``static`` pools commit everything now (on a
    GPU they stay one plain tensor: nothing resizes them).
    """
    platform = platform_for(device)
    why = ""
    if platform.host_memory:
        store = ReservedKVStore.try_create(layout, block_size, num_blocks, reserve_bytes)
        if store is not None:
            return store
        why = "the host would not reserve the address range"
    elif platform.maps_device_memory and not static:
        from tideserve.worker.cuda_kv_store import MappedKVStore

        mapped, why = MappedKVStore.try_create(layout, device, block_size, num_blocks, reserve_bytes)
        if mapped is not None:
            return mapped
    return CopyKVStore(layout, device, block_size, num_blocks, zero=static, why=why)


def create_swap_store(layout: KVLayout, device: torch.device, block_size: int, num_blocks: int) -> KVStore:
    """The host-side tier for swap preemption: committed only where written, handed back when empty
    (CPU); pinned host memory for asynchronous copies when the pool is on a GPU."""
    platform = platform_for(device)
    if platform.host_memory:
        store = ReservedKVStore.try_create(layout, block_size, num_blocks,
                                           num_blocks * layout.block_bytes(block_size), populate=False)
        if store is not None:
            return store
    return CopyKVStore(layout, torch.device("cpu"), block_size, num_blocks, pin_memory=platform.async_host_copies)


class KVCacheStorage:
    """A worker's KV memory: the device pool and the host swap tier, and every move of their bytes.

    Why one object: the cache manager decides block ids; something must move the data those decisions
    imply (grow or shrink the pool, copy compacted blocks down, swap requests out and back, re-read the
    pool at another block size, clear slots nobody wrote), and the runner should only build batches over
    ``caches``. The engine's ``KVGeometry`` says what the pool should be; ``apply_geometry`` makes the
    stores match it, and the stores' own block size and count are what the runner reads. Until a store
    is attached (the pool is sized after a profiling pass, which needs the runner) the block size is the
    planned one.
    """

    def __init__(self, layout: KVLayout, device: torch.device, block_size: int) -> None:
        self.layout = layout
        self.device = device
        self._planned_block_size = block_size
        self.device_store: KVStore | None = None
        self.swap_store: KVStore | None = None
        self._commit_guard: Callable[[int], bool] | None = None
        self._zeroed: tuple | None = None  # (store, block size, blocks, id) of the last zero_block

    def attach(self, store: KVStore) -> None:
        """Take the device pool (``create_kv_store``); from now on its block size is the only one."""
        self.device_store = store
        store.commit_guard = self._commit_guard

    def set_commit_guard(self, guard: Callable[[int], bool] | None) -> None:
        """Asked before each chunk of pages the device pool commits (see ``KVStore.commit_guard``)."""
        self._commit_guard = guard
        if self.device_store is not None:
            self.device_store.commit_guard = guard

    def create_store(self, num_blocks: int, reserve_bytes: int, static: bool, block_size: int | None = None) -> None:
        """Make and attach the device pool (``create_kv_store``) at ``block_size`` (default: the planned
        one); ``reserve_bytes`` is the largest it may grow to, ``static`` commits it all now."""
        if block_size is not None:
            self._planned_block_size = block_size
        self.attach(create_kv_store(self.layout, self.device, self.block_size, num_blocks, reserve_bytes,
                                    static=static))

    def limits(self) -> KVStoreLimits:
        return self.device_store.limits()

    def describe(self) -> str:
        return self.device_store.describe()

    @property
    def bytes_outside_allocator(self) -> int:
        """The device pool's bytes that the platform's memory probe does not count (``KVStore``'s)."""
        return self.device_store.bytes_outside_allocator if self.device_store is not None else 0

    def apply_geometry(self, geometry: KVGeometry) -> None:
        """Make the device pool and the swap tier match ``geometry``: a block-size change (only while no
        block holds live KV) or a resize (``KVStoreGrowError``, changing nothing, when growth fails)."""
        if geometry.block_size != self.block_size:
            num_blocks = self.change_block_size(geometry.block_size)
            if num_blocks != geometry.num_blocks:
                self.resize(geometry.num_blocks)
        elif geometry.num_blocks != self.num_blocks:
            self.resize(geometry.num_blocks)
        swap_blocks = self.swap_store.num_blocks if self.swap_store is not None else 0
        if swap_blocks != geometry.num_swap_blocks:
            self.allocate_swap(geometry.num_swap_blocks)

    # ----------------------------------------------------------------- geometry
    @property
    def caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.device_store.caches

    @property
    def graph_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The caches a captured graph should hold: the store's ``fixed_caches`` where it has them (a resize
        leaves the graph valid), else ``caches``."""
        fixed = self.device_store.fixed_caches
        return fixed if fixed is not None else self.device_store.caches

    @property
    def block_size(self) -> int:
        return self.device_store.block_size if self.device_store is not None else self._planned_block_size

    @property
    def num_blocks(self) -> int:
        return self.device_store.num_blocks

    def bytes_per_block(self, block_size: int | None = None) -> int:
        return self.layout.block_bytes(block_size or self.block_size)

    # ----------------------------------------------------------------- the elastic pool's moves
    def resize(self, num_blocks: int) -> None:
        """Blocks below min(old, new) keep their KV; raises KVStoreGrowError (unchanged) when growth fails."""
        self.device_store.resize(num_blocks)

    def commit_ahead(self, num_blocks: int, on_done: Callable[[], None] | None = None) -> bool:
        """The device store's commit_ahead: True when a growth to ``num_blocks`` costs no page commits now;
        ``on_done`` is called once, when the commit it starts ends (at once if it starts none)."""
        return self.device_store.commit_ahead(num_blocks, on_done)

    @property
    def commit_in_flight(self) -> bool:
        return self.device_store.commit_in_flight

    @property
    def committed_ahead_blocks(self) -> int:
        return self.device_store.committed_ahead_blocks

    @property
    def commit_goal_blocks(self) -> int:
        return self.device_store.commit_goal_blocks

    def copy_blocks(self, moves: list[tuple[int, int]]) -> None:
        """Copy moved blocks' KV (old id -> new id): compaction's only copy."""
        self.device_store.copy_blocks(moves)

    def change_block_size(self, new_block_size: int) -> int:
        """Read the pool with another block size; only while no block holds live KV (nothing to re-lay out,
        so nothing is copied). Returns the new block count; the swap tier follows at the same bytes."""
        old = self.block_size
        num_blocks = self.device_store.reshape_blocks(new_block_size)
        if self.swap_store is not None:
            self.allocate_swap(self.swap_store.num_blocks * old // new_block_size)
        return num_blocks

    # ----------------------------------------------------------------- the swap tier
    def allocate_swap(self, num_swap_blocks: int) -> None:
        """Host-side second tier (pinned when the device is a GPU, so copies are asynchronous DMA)."""
        self.swap_store = (create_swap_store(self.layout, self.device, self.block_size, num_swap_blocks)
                           if num_swap_blocks > 0 else None)

    def release_pages(self) -> None:
        """Hand the pool's and the swap tier's memory back, keeping their geometry (sleep mode)."""
        self.device_store.release_pages()
        if self.swap_store is not None:
            self.swap_store.release_pages()

    def restore_pages(self) -> None:
        """The pool's and the swap tier's memory back after ``release_pages``, zeroed."""
        self.device_store.restore_pages()
        self._zeroed = None
        if self.swap_store is not None:
            self.swap_store.restore_pages()

    def release_idle_swap(self) -> None:
        """No request is swapped out: hand the swap tier's pages back (it is committed where written)."""
        release = getattr(self.swap_store, "release_all", None)
        if release is not None:
            release()

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (device block, swap block) pairs to the host tier."""
        if pairs:
            copy_between(self.device_store, self.swap_store, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (swap block, device block) pairs back to the device pool."""
        if pairs:
            copy_between(self.swap_store, self.device_store, pairs)

    # ----------------------------------------------------------------- a block's bytes (the KV tiers)
    def read_blocks(self, block_ids: list[int]) -> np.ndarray:
        """The bytes of each block, one row per block: every layer's K then V, as the pool holds them (the
        payload a KV tier keeps; ``write_blocks`` puts it back). One gather per layer's K and V."""
        if self._host_memory:  # NumPy's gathers copy whole rows (torch's go by element and thread)
            ids = np.asarray(block_ids, dtype=np.intp)
            out = np.empty((len(block_ids), self.bytes_per_block()), dtype=np.uint8)
            offset = 0
            for k, v in self.caches:
                for t in (k, v):
                    rows = t.view(t.shape[0], -1).view(torch.uint8).numpy()
                    np.take(rows, ids, axis=0, out=out[:, offset:offset + rows.shape[1]], mode="clip")
                    offset += rows.shape[1]
            return out
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        rows = [_block_rows(t).index_select(0, ids).view(torch.uint8) for k, v in self.caches for t in (k, v)]
        return torch.cat(rows, dim=1).cpu().numpy()

    def write_blocks(self, block_ids: list[int], payloads: np.ndarray | list) -> None:
        """Fill each block with its row of ``payloads`` (an array of one row per block, or a list of rows)
        as ``read_blocks`` produced it (at this block size and layout): one indexed copy per layer's K and V,
        whatever the number of blocks (and, on a device, one transfer of the whole batch before them)."""
        if not block_ids:
            return
        if not isinstance(payloads, np.ndarray):
            payloads = np.stack([np.frombuffer(p, dtype=np.uint8) for p in payloads])
        payloads = payloads[:len(block_ids)]
        offset = 0
        if self._host_memory:  # the caches are host memory: NumPy scatters whole rows (see read_blocks)
            ids = np.asarray(block_ids, dtype=np.intp)
            for k, v in self.caches:
                for t in (k, v):
                    rows = t.view(t.shape[0], -1).view(torch.uint8).numpy()
                    rows[ids] = payloads[:, offset:offset + rows.shape[1]]
                    offset += rows.shape[1]
            return
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        data = torch.from_numpy(payloads).to(self.device)
        for k, v in self.caches:
            for t in (k, v):
                rows = _block_rows(t, offset, data.shape[1])
                width = rows.shape[1] * rows.element_size()
                rows.index_copy_(0, ids, data[:, offset:offset + width].view(rows.dtype))
                offset += width

    @property
    def _host_memory(self) -> bool:
        """Whether the caches are host memory (NumPy can address them in place)."""
        return platform_for(self.device).host_memory

    # ----------------------------------------------------------------- slots nobody wrote
    def zero_block(self, block_id: int) -> None:
        """Zero one block in every layer slot, once per store layout: the null block of a model with
        several KV cache groups (core/kv_cache/groups.py), which no step writes. Masked reads of it then
        add exactly 0 (a NaN left by a fresh pool would not: 0 * NaN is NaN)."""
        key = (id(self.device_store), self.block_size, self.num_blocks, block_id)
        if self._zeroed == key:
            return
        bs = self.block_size
        self.device_store.fill_slots(torch.arange(block_id * bs, (block_id + 1) * bs, device=self.device))
        self._zeroed = key

    def clear_unwritten(self, owned: list[tuple[list[int], int]]) -> None:
        """Zero the slots of each block list from token ``num_valid`` to the end of its last block.

        A fresh pool (``torch.empty``), a resize or a relayout leaves arbitrary bytes, NaN included, in
        slots nobody wrote, and decode attention reads a context's last block whole; a recycled block
        holds stale but finite values, which the mask handles. ``num_valid`` counts the tokens that are
        (or will be, by this request's prefill) written, so prefix-cache hits and swapped-in tokens stay,
        and the cost is about one block per sequence every ``block_size`` decode steps.
        """
        bs = self.block_size
        flat = []
        for block_ids, num_valid in owned:
            end = len(block_ids) * bs
            if num_valid < end:
                pos = np.arange(num_valid, end, dtype=np.int64)
                flat.append(np.asarray(block_ids, dtype=np.int64)[pos // bs] * bs + pos % bs)
        if not flat:
            return
        self.device_store.fill_slots(torch.from_numpy(np.concatenate(flat)).to(self.device))
