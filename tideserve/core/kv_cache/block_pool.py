"""The pool of physical KV blocks: ref counts, two free lists, and the prefix-hash index.

Invariants (checked by ``check_invariants`` in tests):
- a block is free iff its ref count is 0;
- a free block may still hold a cached prefix (it keeps its hash until it is reused: lazy eviction);
- allocation takes free blocks holding nothing first, lowest id first, so live blocks pack toward the
  start of the pool (little to compact before a shrink); then cached blocks, least recently freed first,
  so eviction takes the oldest cached prefix.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from tideserve.core.kv_cache.events import BlockRemoved, KVCacheEvent, external_hash

BlockHash = int


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    num_hits: int = 0  # prefix-cache hits on the prefix it holds: what an idle pool keeps first


class BlockPool:
    """Fixed set of blocks. Free blocks holding no prefix sit in a min-heap (lowest id first); free blocks
    holding a cached prefix sit in a dict used as an O(1)-removable LRU queue."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}.")
        self.blocks: list[KVBlock] = [KVBlock(i) for i in range(num_blocks)]
        self._empty: set[int] = set(range(num_blocks))
        self._empty_heap: list[int] = list(range(num_blocks))  # may hold stale ids (lazy deletion)
        self._cached_free: dict[int, None] = {}
        self.cached: dict[BlockHash, KVBlock] = {}
        # KV cache events (core/kv_cache/events.py), appended in order when enabled; None: off, no cost.
        self.events: list[KVCacheEvent] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._empty) + len(self._cached_free)

    def free_block_ids(self) -> list[int]:
        """Free blocks in the order they will be reused."""
        return sorted(self._empty) + list(self._cached_free)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._empty or block_id in self._cached_free

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / len(self.blocks)

    def _push_empty(self, block_id: int) -> None:
        self._empty.add(block_id)
        heapq.heappush(self._empty_heap, block_id)

    def _take_free(self, block_id: int) -> None:
        """Remove a free block from whichever free list holds it."""
        if block_id in self._cached_free:
            del self._cached_free[block_id]
        else:
            self._empty.remove(block_id)  # its heap entry turns stale

    def _pop_free(self) -> KVBlock:
        while self._empty_heap:
            block_id = heapq.heappop(self._empty_heap)
            if block_id in self._empty:
                self._empty.remove(block_id)
                return self.blocks[block_id]
        block_id = next(iter(self._cached_free))
        del self._cached_free[block_id]
        block = self.blocks[block_id]
        self._evict_hash(block)
        return block

    def allocate(self, n: int) -> list[KVBlock]:
        """Take n free blocks (empty ones lowest id first, then the oldest cached), ref count 1 each."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks: only {self.num_free_blocks} are free.")
        out = []
        for _ in range(n):
            block = self._pop_free()
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take one more reference on each (cache hit); a cached free block leaves the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._take_free(block.block_id)
            block.ref_cnt += 1
            if block.block_hash is not None:
                block.num_hits += 1

    def release(self, blocks_tail_first: list[KVBlock]) -> None:
        """Drop one reference on each, in the given order; blocks reaching 0 become free (a cached one
        joins the LRU queue's tail)."""
        for block in blocks_tail_first:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} released more often than taken"
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self._cached_free[block.block_id] = None
                else:
                    self._push_empty(block.block_id)

    # ----------------------------------------------------------------- resizing (the elastic pool)
    def grow(self, num_new: int) -> None:
        """Append num_new fresh blocks (reused before any cached prefix is evicted)."""
        start = len(self.blocks)
        self.blocks.extend(KVBlock(i) for i in range(start, start + num_new))
        for block_id in range(start, start + num_new):
            self._push_empty(block_id)

    def highest_used_id(self) -> int:
        """Id of the highest block with a reference, or -1 when none is used."""
        for block in reversed(self.blocks):
            if block.ref_cnt > 0:
                return block.block_id
        return -1

    def highest_held_id(self) -> int:
        """Id of the highest block that is used or holds a cached prefix, or -1 when none does."""
        for block in reversed(self.blocks):
            if block.ref_cnt > 0 or block.block_hash is not None:
                return block.block_id
        return -1

    def empty_block_ids(self) -> list[int]:
        """Free blocks holding nothing, lowest id first."""
        return sorted(self._empty)

    def num_cached_free(self) -> int:
        return len(self._cached_free)

    def cached_free_by_value(self) -> list[int]:
        """Free blocks holding a cached prefix, the one to keep longest first: prefixes that were hit
        (shared system prompts, earlier turns of a conversation) before ones never reused, each group
        most recently freed first."""
        recent_first = list(reversed(self._cached_free))
        return ([i for i in recent_first if self.blocks[i].num_hits > 0]
                + [i for i in recent_first if self.blocks[i].num_hits == 0])

    def evict_cached_ids(self, block_ids: list[int]) -> None:
        """Forget the cached prefixes of these free blocks (they become empty)."""
        for block_id in block_ids:
            del self._cached_free[block_id]
            self._evict_hash(self.blocks[block_id])
            self._push_empty(block_id)

    def move(self, old_id: int, new_id: int) -> None:
        self.move_blocks([(old_id, new_id)])

    def move_blocks(self, moves: list[tuple[int, int]]) -> None:
        """Give each held block ``old`` (used, or free with a cached prefix) the id of the empty block
        ``new`` and vice versa. Block tables and the hash index hold block objects, so they follow; a
        cached block keeps its place in the eviction order. The caller copies the KV data."""
        if not moves:
            return
        order = list(self._cached_free)
        remap = {}
        for old_id, new_id in moves:
            held, empty = self.blocks[old_id], self.blocks[new_id]
            assert held.ref_cnt > 0 or held.block_hash is not None, held
            assert empty.ref_cnt == 0 and empty.block_hash is None and new_id in self._empty, empty
            self._empty.remove(new_id)  # its heap entry turns stale
            held.block_id, empty.block_id = new_id, old_id
            self.blocks[new_id], self.blocks[old_id] = held, empty
            self._push_empty(old_id)
            if old_id in self._cached_free:
                remap[old_id] = new_id
        if remap:
            self._cached_free = {remap.get(i, i): None for i in order}

    def shrink_to(self, num_blocks: int) -> None:
        """Drop blocks num_blocks.. (all must be free); their cached prefixes are forgotten."""
        assert num_blocks >= 1
        for block in self.blocks[num_blocks:]:
            assert block.ref_cnt == 0, f"block {block.block_id} is still used"
            self._take_free(block.block_id)
            self._evict_hash(block)
        del self.blocks[num_blocks:]
        self._empty_heap = [i for i in self._empty_heap if i < num_blocks]
        heapq.heapify(self._empty_heap)

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def publish(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Make a full block findable by its prefix hash (first writer wins; duplicates stay private).
        Returns whether it became findable."""
        if block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def evict_cached(self, from_id: int = 0) -> int:
        """Forget the cached prefixes held by free blocks with id >= from_id; returns how many."""
        evicted = [i for i in self._cached_free if i >= from_id]
        for block_id in evicted:
            del self._cached_free[block_id]
            self._evict_hash(self.blocks[block_id])
            self._push_empty(block_id)
        return len(evicted)

    def _evict_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.events is not None:
                    self._record_removed(block.block_hash)
            block.block_hash = None
        block.num_hits = 0

    def _record_removed(self, block_hash: BlockHash) -> None:
        """One BlockRemoved per run of evictions, as vLLM batches them."""
        events = self.events
        if events and isinstance(events[-1], BlockRemoved):
            events[-1].block_hashes.append(external_hash(block_hash))
        else:
            events.append(BlockRemoved([external_hash(block_hash)]))

    def check_invariants(self) -> None:
        assert not self._empty & set(self._cached_free)
        assert self._empty <= set(self._empty_heap)
        for block in self.blocks:
            assert (block.ref_cnt == 0) == self.is_free(block.block_id), block
            if block.block_id in self._cached_free:
                assert block.block_hash is not None, block
            if block.block_id in self._empty:
                assert block.block_hash is None, block
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, block
        assert len(self.cached) == sum(b.block_hash is not None for b in self.blocks)
