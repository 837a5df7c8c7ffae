"""Per-request block tables over the block pool, with prefix caching.

A request's block table covers exactly ceil(num_computed_tokens / block_size) blocks after a step. Full
blocks are identified by a chained hash (parent hash, the block's token ids, an extra key for anything
else that changes the KV), so a new request can reuse every cached full block of its prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tideserve.core.kv_cache.block_pool import BlockHash, BlockPool, KVBlock
from tideserve.core.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, external_hash
from tideserve.core.kv_cache.tiers import TierIndex, TierKey, tier_block_key, tier_root_key

_ROOT_HASH: BlockHash = hash(("tideserve-root",)) & 0xFFFFFFFFFFFF


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_key: object = None) -> BlockHash:
    return hash((parent, tuple(token_ids), extra_key))


class SwapSpace:
    """Second-tier block ids (host memory): a plain free list; swapped blocks are never shared."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self.high_water = 0  # most blocks in use at once since the tier's memory was last handed back

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks if self.num_blocks else 0.0

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self._free)
        ids = [self._free.pop() for _ in range(n)]
        self.high_water = max(self.high_water, self.num_blocks - len(self._free))
        return ids

    def release(self, ids: list[int]) -> None:
        self._free.extend(reversed(ids))

    def check_invariants(self, swapped: dict[str, list[int]]) -> None:
        used = [i for ids in swapped.values() for i in ids]
        assert len(used) == len(set(used)) and not set(used) & set(self._free)
        assert len(used) + len(self._free) == self.num_blocks


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found cached


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 extra_key: object = None) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.extra_key = extra_key
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        # Requests whose prefix-cache entries are isolated: their hash chain starts from the salt, so
        # only requests with the same salt share their blocks.
        self.cache_salts: dict[str, str] = {}
        self.prefix_stats = PrefixCacheStats()
        self.swap: SwapSpace | None = None
        self.swapped: dict[str, list[int]] = {}  # request id -> swap block ids, in table order
        self.events: list[KVCacheEvent] | None = None  # see enable_events
        # The KV tiers below the pool, nearest first (core/kv_cache/tiers.py; none: off). Their keys are a
        # second, stable hash chain per request; blocks published since the last take_tier_writes wait in
        # _tier_writes.
        self.tiers: list[TierIndex] = []
        # With events on: tier key -> (event hash, parent's event hash, token ids) of the blocks in
        # _tier_writes, for the tiers' BlockStored events (take_tier_event_blocks)
        self._tier_event_blocks: dict[TierKey, tuple[int, int | None, list[int]]] = {}
        self.tier_keys: dict[str, list[TierKey]] = {}
        self._tier_writes: list[tuple[KVBlock, BlockHash, TierKey]] = []

    # ----------------------------------------------------------------- KV cache events
    def enable_events(self) -> None:
        """Record what the prefix cache gains and loses (core/kv_cache/events.py) for ``take_events``.
        Off by default: then nothing is allocated per block."""
        if self.events is None:
            self.events = []
            self.pool.events = self.events

    def take_events(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first (empty when events are off)."""
        if not self.events:
            return []
        out = list(self.events)
        self.events.clear()
        return out

    # ----------------------------------------------------------------- swap tier
    def enable_swap(self, num_swap_blocks: int) -> None:
        self.swap = SwapSpace(num_swap_blocks) if num_swap_blocks > 0 else None

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Copy plan (device block, swap block) for a preempted request; None when the swap pool is full.

        The device blocks are released at once; the caller copies their KV before anything else writes.
        """
        table = self.req_blocks.get(request_id, [])
        if self.swap is None or not table or len(table) > self.swap.num_free:
            return None
        assert request_id not in self.swapped, f"request {request_id} is already swapped out"
        swap_ids = self.swap.allocate(len(table))
        pairs = [(b.block_id, s) for b, s in zip(table, swap_ids)]
        self.swapped[request_id] = swap_ids
        self.free(request_id)
        return pairs

    def swap_in(self, request_id: str, token_ids: Sequence[int], num_saved_tokens: int,
                num_new_tokens: int) -> tuple[list[int], list[tuple[int, int]]] | None:
        """Device blocks for a swapped request and the copy plan (swap block, device block), or None
        (changing nothing) when the pool has too few free blocks."""
        swap_ids = self.swapped[request_id]
        num_blocks = self.blocks_needed(num_saved_tokens + num_new_tokens)
        if num_blocks > self.pool.num_free_blocks:
            return None
        blocks = self.pool.allocate(num_blocks)
        self.req_blocks[request_id] = blocks
        pairs = [(s, b.block_id) for s, b in zip(swap_ids, blocks)]
        self.swap.release(self.swapped.pop(request_id))
        if self.enable_prefix_caching:
            self._publish_full_blocks(request_id, token_ids,
                                      min(num_saved_tokens + num_new_tokens, len(token_ids)))
        return [b.block_id for b in blocks], pairs

    def drop_swapped(self, request_id: str) -> None:
        if request_id in self.swapped and self.swap is not None:
            self.swap.release(self.swapped.pop(request_id))

    # ----------------------------------------------------------------- KV tiers below the pool
    def enable_tier(self, index: TierIndex | None) -> None:
        """Keep full prefix blocks in one tier below the pool too (``index``: the keys it holds; None: off)."""
        self.enable_tiers([] if index is None else [index])

    def enable_tiers(self, indexes: list[TierIndex]) -> None:
        """Keep full prefix blocks in these tiers below the pool too (the keys each holds, nearest first;
        none: off). Off, nothing per block is computed."""
        self.tiers = list(indexes) if self.enable_prefix_caching else []
        self.tier_keys.clear()
        self._tier_writes.clear()
        self._tier_event_blocks.clear()

    @property
    def tier(self) -> TierIndex | None:
        """The nearest tier's keys (None: no tier)."""
        return self.tiers[0] if self.tiers else None

    def _tier_block_keys(self, request_id: str, token_ids: Sequence[int], num_blocks: int) -> list[TierKey]:
        """Tier keys of the first ``num_blocks`` full blocks of token_ids, extending what was computed."""
        keys = self.tier_keys.setdefault(request_id, [])
        bs = self.block_size
        parent = keys[-1] if keys else tier_root_key(bs, self.cache_salts.get(request_id))
        for i in range(len(keys), num_blocks):
            parent = tier_block_key(parent, token_ids[i * bs:(i + 1) * bs])
            keys.append(parent)
        return keys

    def plan_tier_load(self, request_id: str, token_ids: Sequence[int],
                       index: TierIndex | None = None) -> tuple[int, list[TierKey]]:
        """Where a waiting request's prefix hit in the pool ends, and the tier keys of the blocks right
        after it that the tier ``index`` (default: the nearest) holds, in order: what loading them back
        would add to its hit. Capped as ``get_computed_blocks`` is (the last token is always computed).
        Nothing is allocated."""
        index = self.tier if index is None else index
        if index is None:
            return 0, []
        start = self.num_pool_hit_blocks(request_id, token_ids)
        max_blocks = (len(token_ids) - 1) // self.block_size
        found: list[TierKey] = []
        for i in range(start, max_blocks):
            key = self._tier_block_keys(request_id, token_ids, i + 1)[i]
            if key not in index:
                break
            found.append(key)
        return start, found

    def num_pool_hit_blocks(self, request_id: str, token_ids: Sequence[int]) -> int:
        """How many leading full blocks of the request the pool holds now, capped as ``get_computed_blocks``
        is (the last token is always computed). Nothing is allocated or touched."""
        hashes = self._full_block_hashes(request_id, token_ids)
        max_blocks = (len(token_ids) - 1) // self.block_size
        start = 0
        while start < max_blocks and self.pool.lookup(hashes[start]) is not None:
            start += 1
        return start

    def tier_load_shortfall(self, request_id: str, start: int, num_blocks: int) -> int:
        """How many more free blocks loading ``num_blocks`` after the request's pool hit of ``start``
        blocks needs (``begin_tier_load`` holds the hit, so its free blocks do not count)."""
        hit_free = sum(1 for h in self.req_hashes[request_id][:start] if self.pool.lookup(h).ref_cnt == 0)
        return max(0, num_blocks + hit_free - self.pool.num_free_blocks)

    def begin_tier_load(self, request_id: str, start: int, num_blocks: int) -> tuple[list[KVBlock], list[KVBlock]]:
        """(the request's pool hit, held; up to ``num_blocks`` free blocks to load the tier's KV into),
        both held until ``finish_tier_load``. The hit is held first: a load must not evict the very prefix
        it continues (the least recently used cached blocks are the ones an allocation takes)."""
        hit = [self.pool.lookup(h) for h in self.req_hashes[request_id][:start]]
        self.pool.touch(hit)
        return hit, self.pool.allocate(min(num_blocks, self.pool.num_free_blocks))

    def finish_tier_load(self, request_id: str, token_ids: Sequence[int], hit: list[KVBlock], blocks: list[KVBlock],
                         num_loaded: int) -> None:
        """The first ``num_loaded`` of ``blocks`` now hold the KV of the request's blocks after its pool
        ``hit``: publish them as cached prefixes (the request's allocation then hits them like any other)
        and release every block held, tail first, so the prefix's head stays cached longest."""
        start = len(hit)
        hashes = self._full_block_hashes(request_id, token_ids)
        events = self.events
        stored: BlockStored | None = None
        bs = self.block_size
        for j, block in enumerate(blocks[:num_loaded]):
            i = start + j
            if not self.pool.publish(block, hashes[i]):
                break
            if events is not None:
                if stored is None:
                    stored = BlockStored([], external_hash(hashes[i - 1]) if i else None, [], bs)
                    events.append(stored)
                stored.block_hashes.append(external_hash(hashes[i]))
                stored.token_ids.extend(token_ids[i * bs:(i + 1) * bs])
        self.pool.release(blocks[::-1] + hit[::-1])

    def take_tier_event_blocks(self) -> dict[TierKey, tuple[int, int | None, list[int]]]:
        """For the blocks of the last ``take_tier_writes``, with events on: tier key -> (hash, parent hash,
        token ids) as the pool's events name them, so a tier's events name the same blocks."""
        out, self._tier_event_blocks = self._tier_event_blocks, {}
        return out

    def record_events(self, events: list[KVCacheEvent]) -> None:
        """Add events from outside the pool (the KV tiers'), in order, when events are on."""
        if self.events is not None:
            self.events.extend(events)

    def take_tier_writes(self) -> list[tuple[int, TierKey]]:
        """(block id, tier key) of the blocks published since the last call that still hold their prefix
        and that some tier lacks: what to write down once the step that computed them has run (each tier
        keeps those it lacks)."""
        out: list[tuple[int, TierKey]] = []
        if not self.tiers:
            self._tier_writes.clear()
            return out
        seen: set[TierKey] = set()
        for block, block_hash, key in self._tier_writes:
            if block.block_hash == block_hash and key not in seen and any(key not in t for t in self.tiers):
                seen.add(key)
                out.append((block.block_id, key))
        self._tier_writes.clear()
        return out

    # ----------------------------------------------------------------- queries
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks_for_tokens(self, num_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` may hold at once (its prompt prefilled in one step)."""
        return self.blocks_needed(num_tokens)

    # ----------------------------------------------------------------- prefix cache
    def set_cache_salt(self, request_id: str, salt: str | None) -> None:
        """Isolate a request's cached prefixes (kept until ``drop_cache_salt``, across preemptions)."""
        if salt:
            self.cache_salts[request_id] = salt

    def drop_cache_salt(self, request_id: str) -> None:
        self.cache_salts.pop(request_id, None)

    def _root_hash(self, request_id: str) -> BlockHash:
        salt = self.cache_salts.get(request_id)
        return _ROOT_HASH if salt is None else hash((_ROOT_HASH, "salt", salt))

    def _full_block_hashes(self, request_id: str, token_ids: Sequence[int],
                           num_tokens: int | None = None) -> list[BlockHash]:
        """Hashes of every full block of token_ids[:num_tokens], extending what was computed before."""
        hashes = self.req_hashes.setdefault(request_id, [])
        bs = self.block_size
        parent = hashes[-1] if hashes else self._root_hash(request_id)
        limit = len(token_ids) if num_tokens is None else num_tokens
        for i in range(len(hashes), limit // bs):
            parent = hash_block(parent, token_ids[i * bs:(i + 1) * bs], self.extra_key)
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int],
                            count_stats: bool = True) -> list[KVBlock]:
        """Cached full blocks of a new request's tokens, left to right until the first miss.

        Capped so the last token is always computed: the request needs its logits. ``count_stats=False``
        only looks (the scheduler asking whether a request would fit), leaving the hit counters alone.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = self._full_block_hashes(request_id, token_ids)
        max_blocks = (len(token_ids) - 1) // self.block_size
        hit: list[KVBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hit.append(block)
        if count_stats:
            self.prefix_stats.queries += len(token_ids)
            self.prefix_stats.hits += len(hit) * self.block_size
        return hit

    # ----------------------------------------------------------------- allocation
    def allocate_slots(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                       num_new_tokens: int, new_computed_blocks: Sequence[KVBlock] = ()) -> list[int] | None:
        """Make room for num_new_tokens after the computed ones (and a prefix hit, if any).

        ``num_computed_tokens`` excludes the tokens of ``new_computed_blocks``. Returns the ids of the
        blocks appended to the request's table, or None (changing nothing) when the pool is too small.
        """
        table = self.req_blocks.setdefault(request_id, [])
        num_hit_tokens = len(new_computed_blocks) * self.block_size
        total = num_computed_tokens + num_hit_tokens + num_new_tokens
        num_new_blocks = max(0, self.blocks_needed(total) - len(table) - len(new_computed_blocks))
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            if not table:
                del self.req_blocks[request_id]
            return None
        self.pool.touch(list(new_computed_blocks))
        table.extend(new_computed_blocks)
        new_blocks = self.pool.allocate(num_new_blocks)
        table.extend(new_blocks)
        if self.enable_prefix_caching:
            self._publish_full_blocks(request_id, token_ids, min(total, len(token_ids)))
        return [b.block_id for b in new_computed_blocks] + [b.block_id for b in new_blocks]

    def num_blocks_short(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
                         new_computed_blocks: Sequence[KVBlock] = (), reserve: int = 0) -> int:
        """How many more free blocks ``allocate_slots`` with these arguments would need to leave
        ``reserve`` blocks free afterwards (0: it fits)."""
        table = self.req_blocks.get(request_id, ())
        total = num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        need = max(0, self.blocks_needed(total) - len(table) - len(new_computed_blocks))
        need += sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return max(0, need + reserve - self.pool.num_free_blocks)

    def _publish_full_blocks(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> None:
        hashes = self._full_block_hashes(request_id, token_ids, num_tokens)
        table = self.req_blocks[request_id]
        events = self.events
        stored: BlockStored | None = None  # the run of consecutive blocks published by this call
        bs = self.block_size
        tier_keys = self._tier_block_keys(request_id, token_ids, num_tokens // bs) if self.tiers else None
        for i in range(num_tokens // bs):
            if table[i].block_hash is not None or not self.pool.publish(table[i], hashes[i]):
                stored = None
                continue
            if tier_keys is not None and any(tier_keys[i] not in t for t in self.tiers):
                self._tier_writes.append((table[i], hashes[i], tier_keys[i]))
                if events is not None:  # what a tier's BlockStored event for this block will say
                    self._tier_event_blocks[tier_keys[i]] = (external_hash(hashes[i]), external_hash(hashes[i - 1])
                                                             if i else None, list(token_ids[i * bs:(i + 1) * bs]))
            if events is None:
                continue
            if stored is None:
                parent = external_hash(hashes[i - 1]) if i else None
                stored = BlockStored([], parent, [], bs)
                events.append(stored)
            stored.block_hashes.append(external_hash(hashes[i]))
            stored.token_ids.extend(token_ids[i * bs:(i + 1) * bs])

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Release the blocks past the ones ``num_tokens`` tokens fill (the slots of rejected proposals), tail
        first, so the table covers exactly ceil(num_tokens / block_size) blocks again. They hold no published
        prefix: only verified tokens' full blocks are published."""
        table = self.req_blocks.get(request_id)
        keep = self.blocks_needed(num_tokens)
        if table and len(table) > keep:
            tail = table[keep:]
            del table[keep:]
            assert all(b.block_hash is None for b in tail), "a trimmed block holds a published prefix"
            self.pool.release(tail[::-1])

    def free(self, request_id: str) -> None:
        """Release a request's blocks at once, tail first so shared prefix roots live longest."""
        table = self.req_blocks.pop(request_id, None)
        self.req_hashes.pop(request_id, None)
        self.tier_keys.pop(request_id, None)
        if table:
            self.pool.release(table[::-1])

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix no request holds; returns how many. One event: AllBlocksCleared when
        nothing stays cached, else BlockRemoved (blocks of running requests keep their prefixes)."""
        events = self.events
        if events is None:
            return self.pool.evict_cached()
        removed = [external_hash(b.block_hash) for b in self.pool.blocks
                   if b.ref_cnt == 0 and b.block_hash is not None]
        self.pool.events = None
        try:
            num = self.pool.evict_cached()
        finally:
            self.pool.events = events
        if not self.pool.cached:
            events.append(AllBlocksCleared())
        elif removed:
            events.append(BlockRemoved(removed))
        return num

    # ----------------------------------------------------------------- elastic pool
    def grow(self, num_new_blocks: int) -> None:
        self.pool.grow(num_new_blocks)

    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a cached prefix."""
        return self.pool.num_cached_free()

    def num_hit_cached_blocks(self) -> int:
        """Free blocks holding a cached prefix that some request has reused (a shared system prompt)."""
        return sum(1 for i in self.pool.cached_free_by_value() if self.pool.blocks[i].num_hits > 0)

    def num_request_blocks(self, request_id: str) -> int:
        """Blocks in ``request_id``'s table (0 when it holds none)."""
        return len(self.req_blocks.get(request_id, ()))

    def highest_used_id(self) -> int:
        """Id of the highest block a request holds, or -1: the pool cannot shrink below it."""
        return self.pool.highest_used_id()

    def swap_in_use(self) -> bool:
        """Whether any swap block holds a swapped-out request's KV."""
        return self.swap is not None and self.swap.num_free < self.swap.num_blocks

    def swap_high_water(self) -> int:
        """Most swap blocks in use at once since the tier's memory was last handed back (0 without one)."""
        return self.swap.high_water if self.swap is not None else 0

    def swap_memory_released(self) -> None:
        """The swap tier's pages went back to the system: its high-water mark starts over."""
        if self.swap is not None:
            self.swap.high_water = 0

    def num_held_blocks(self) -> int:
        """Blocks that are used or hold a cached prefix: what a pool keeping its cache cannot drop."""
        return self.pool.num_blocks - len(self.pool.empty_block_ids())

    def retain_cached(self, num_keep: int) -> int:
        """Keep the ``num_keep`` most valuable cached prefixes (see ``BlockPool.cached_free_by_value``)
        and forget the rest; returns how many were forgotten."""
        ranked = self.pool.cached_free_by_value()
        self.pool.evict_cached_ids(ranked[max(0, num_keep):])
        return max(0, len(ranked) - max(0, num_keep))

    def compact(self, target_blocks: int) -> list[tuple[int, int]]:
        """Move held blocks (used ones first, then cached prefixes, most valuable first) with id >=
        target_blocks into empty ids below it; returns the (old, new) moves, for the KV copy.

        Nothing is evicted here: as many blocks move as there are empty ids below the target, and the
        caller checks ``pool.highest_used_id()`` to see how far the pool can shrink.
        """
        holes = [i for i in self.pool.empty_block_ids() if i < target_blocks]
        tail = self.pool.blocks[target_blocks:]
        used = [b.block_id for b in tail if b.ref_cnt > 0]
        rank = {block_id: r for r, block_id in enumerate(self.pool.cached_free_by_value())}
        cached = sorted((b.block_id for b in tail if b.ref_cnt == 0 and b.block_hash is not None),
                        key=rank.__getitem__)
        moves = list(zip(used + cached, holes))
        self.pool.move_blocks(moves)
        return moves

    def shrink_to(self, num_blocks: int) -> None:
        self.pool.shrink_to(num_blocks)

    def external_fragmentation(self) -> float:
        """Empty blocks below the highest held block (holes that stop the pool from shrinking) / pool."""
        top = self.pool.highest_held_id()
        if top < 0:
            return 0.0
        holes = sum(1 for b in self.pool.blocks[:top] if b.ref_cnt == 0 and b.block_hash is None)
        return holes / self.pool.num_blocks

    def relayout(self, new_block_size: int, num_blocks: int,
                 live: dict[str, int]) -> dict[str, list[int]]:
        """Start a fresh pool of another block size holding ``live`` requests (id -> computed tokens).

        Returns each live request's new block ids; the caller copies the KV token by token. The prefix
        cache starts empty: hashes depend on the block size.
        """
        needed = sum(-(-n // new_block_size) for n in live.values())
        if needed > num_blocks:
            raise ValueError(f"relayout needs {needed} blocks of {new_block_size}, pool has {num_blocks}")
        self._fresh_pool(new_block_size, num_blocks)
        self.req_blocks = {}
        self.req_hashes = {}
        self.tier_keys = {}  # the tier's keys are rooted in the block size
        self._tier_writes = []
        self._tier_event_blocks = {}
        tables = {}
        for request_id, num_tokens in live.items():
            blocks = self.pool.allocate(-(-num_tokens // new_block_size))
            self.req_blocks[request_id] = blocks
            tables[request_id] = [b.block_id for b in blocks]
        return tables

    def _fresh_pool(self, block_size: int, num_blocks: int) -> None:
        """An empty pool of another block size: no prefix survives (hashes depend on the block size)."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        if self.events is not None:
            self.pool.events = self.events
            self.events.append(AllBlocksCleared())

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        if self.swap is not None:
            self.swap.check_invariants(self.swapped)
        total_refs = sum(b.ref_cnt for b in self.pool.blocks)
        assert total_refs == sum(len(t) for t in self.req_blocks.values()), "ref counts != table lengths"
