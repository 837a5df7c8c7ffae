"""The pool of physical KV blocks: ref counts, a free queue, and the prefix-hash index.

Invariants (checked by ``check_invariants`` in tests):
- a block is in the free queue iff its ref count is 0;
- a free block may still hold a cached prefix (it keeps its hash until it is reused: lazy eviction);
- the free queue is ordered least recently freed first, so eviction takes the oldest cached block.
"""

from __future__ import annotations

from dataclasses import dataclass

BlockHash = int


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """Fixed set of blocks; the free queue is a dict used as an O(1)-removable ordered set."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}.")
        self.blocks: list[KVBlock] = [KVBlock(i) for i in range(num_blocks)]
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))
        self.cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def free_block_ids(self) -> list[int]:
        """The free queue, oldest first (next to be reused first)."""
        return list(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / len(self.blocks)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take n blocks from the head of the free queue, evicting any cached prefix they hold."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self._free)} are free.")
        out = []
        for _ in range(n):
            block_id = next(iter(self._free))
            del self._free[block_id]
            block = self.blocks[block_id]
            self._evict_hash(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take one more reference on each (cache hit); a cached free block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks_tail_first: list[KVBlock]) -> None:
        """Drop one reference on each, in the given order; blocks reaching 0 join the free queue's tail."""
        for block in blocks_tail_first:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} released more often than taken"
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    # ----------------------------------------------------------------- resizing (the elastic pool)
    def grow(self, num_new: int) -> None:
        """Append num_new fresh blocks; they join the head of the free queue (never-used blocks first)."""
        start = len(self.blocks)
        self.blocks.extend(KVBlock(i) for i in range(start, start + num_new))
        fresh = dict.fromkeys(range(start, start + num_new))
        fresh.update(self._free)
        self._free = fresh

    def highest_used_id(self) -> int:
        """Id of the highest block with a reference, or -1 when none is used."""
        for block in reversed(self.blocks):
            if block.ref_cnt > 0:
                return block.block_id
        return -1

    def move(self, old_id: int, new_id: int) -> None:
        """Give the used block ``old_id`` the identity of the free block ``new_id`` (and vice versa).

        Block tables hold block objects, so they follow the move; the caller copies the KV data.
        """
        used, free = self.blocks[old_id], self.blocks[new_id]
        assert used.ref_cnt > 0 and free.ref_cnt == 0, (used, free)
        self._evict_hash(free)
        del self._free[new_id]
        used.block_id, free.block_id = new_id, old_id
        self.blocks[new_id], self.blocks[old_id] = used, free
        self._free[old_id] = None

    def shrink_to(self, num_blocks: int) -> None:
        """Drop blocks num_blocks.. (all must be free); their cached prefixes are forgotten."""
        assert num_blocks >= 1
        for block in self.blocks[num_blocks:]:
            assert block.ref_cnt == 0, f"block {block.block_id} is still used"
            self._evict_hash(block)
            del self._free[block.block_id]
        del self.blocks[num_blocks:]

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def publish(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Make a full block findable by its prefix hash (first writer wins; duplicates stay private)."""
        if block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def evict_cached(self, from_id: int = 0) -> int:
        """Forget the cached prefixes held by free blocks with id >= from_id; returns how many."""
        dropped = 0
        for block_id in self._free:
            if block_id < from_id:
                continue
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict_hash(block)
                dropped += 1
        return dropped

    def _evict_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def check_invariants(self) -> None:
        for block in self.blocks:
            assert (block.ref_cnt == 0) == (block.block_id in self._free), block
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, block
        assert len(self.cached) == sum(b.block_hash is not None for b in self.blocks)
