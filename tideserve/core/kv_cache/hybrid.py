"""The cache manager for a model with several KV cache groups (core/kv_cache/groups.py): one block table
per group per request over the one shared pool, and sliding-window groups that give their blocks back as
the window moves on.

Per request and group, a table covers ceil(num_tokens / block_size) positions, as in the single-group
manager. A full-attention group's table holds a block at every position. A sliding group's table holds
``null_block`` (block 0, reserved for the pool's lifetime, never written and never read by any attention
backend: every kernel skips or masks keys before the window, and the null block is kept zeroed by the
workers so a masked read adds exactly 0) at every position before ``first_live_block``: those blocks
were released as soon as the request's computed tokens moved the window past them, and a hashed one
stays findable as an evictable cached block, as any freed block does.

Invariants (``check_invariants``): free + cached + held = all blocks; the null block is held once, by the
manager; sum of ref counts = sum of non-null table entries + 1; all of a request's tables have one length;
a sliding table is null exactly before its ``first_live_block`` at the request's computed tokens.

Prefix caching: the chained hash of a request's full blocks is the same for every group, and the pool keys
group g's block by (hash, g), so groups never alias. A hit of h tokens is valid when every full group
has its blocks before h cached and every sliding group has the blocks covering keys h - window + 1 .. h - 1
(what the first computed query reads); the longest such h, capped so the last prompt token is computed,
is taken, and the new request's sliding tables start with nulls before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tideserve.core.kv_cache.block_pool import BlockHash, KVBlock
from tideserve.core.kv_cache.events import BlockStored, external_hash
from tideserve.core.kv_cache.groups import NULL_BLOCK_ID, KVCacheGroups, first_live_block
from tideserve.core.kv_cache.manager import KVCacheManager

GroupBlockIds = tuple[list[int], ...]  # one list of block ids per KV cache group


@dataclass
class PrefixHit:
    """A prefix-cache hit over every group: ``num_tokens`` (a whole number of blocks) and, per group,
    ``tables[g]``: the hit's table (the null block before a sliding group's window). ``len()`` is the hit
    in blocks, as the single-group manager's list of hit blocks, so the scheduler counts both alike."""

    num_tokens: int
    block_size: int
    tables: list[list[KVBlock]] = field(default_factory=list)

    def __len__(self) -> int:
        return self.num_tokens // self.block_size


class HybridKVCacheManager(KVCacheManager):
    """``KVCacheManager``'s contract over several groups: block ids travel as one list per group
    (``GroupBlockIds``), a prefix hit as a ``PrefixHit``; everything else (events, swap tier, the elastic
    pool's grow, shrink and compaction, reset) keeps its meaning, counted in the one pool's blocks."""

    def __init__(self, num_blocks: int, block_size: int, groups: KVCacheGroups,
                 enable_prefix_caching: bool = True, extra_key: object = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 with {groups.num_groups} KV cache groups (one is the "
                             f"null block), got {num_blocks}.")
        super().__init__(num_blocks, block_size, enable_prefix_caching, extra_key)
        self.groups = groups
        self.req_tables: dict[str, list[list[KVBlock]]] = {}
        self.req_computed: dict[str, int] = {}  # tokens computed before the request's latest step
        self._published: dict[str, int] = {}  # per request: full blocks whose publication was settled
        self._swap_positions: dict[str, list[tuple[int, int]]] = {}  # per swap block: (group, index)
        self.null_block = self._reserve_null()

    def _reserve_null(self) -> KVBlock:
        null = self.pool.allocate(1)[0]
        assert null.block_id == NULL_BLOCK_ID, "the null block is a fresh pool's first block"
        return null

    @property
    def null_block_id(self) -> int:
        return self.null_block.block_id

    # ----------------------------------------------------------------- helpers
    def _first_live(self, group: int, num_computed: int) -> int:
        return first_live_block(num_computed, self.groups.windows[group], self.block_size)

    def _group_key(self, block_hash: BlockHash, group: int) -> BlockHash:
        return hash((block_hash, group))

    def _live(self, table: list[KVBlock]) -> list[KVBlock]:
        null = self.null_block
        return [b for b in table if b is not null]

    def _plan(self, request_id: str, num_computed: int, num_new: int, hit: PrefixHit | None
              ) -> tuple[list[list[KVBlock]], list[list[int]], int, int]:
        """(tables to start from, per group the indices to release, blocks to allocate, blocks freed by the
        releases): what ``allocate_slots`` would do, decided without changing anything."""
        tables = self.req_tables.get(request_id)
        if tables is None:
            tables = [list(t) for t in hit.tables] if hit else [[] for _ in self.groups.windows]
        computed = num_computed + (hit.num_tokens if hit else 0)
        need = self.blocks_needed(computed + num_new)
        releases, num_new_blocks, gained = [], 0, 0
        for g, table in enumerate(tables):
            stop = min(self._first_live(g, computed), len(table))
            out = [i for i in range(stop) if table[i] is not self.null_block]
            releases.append(out)
            gained += sum(1 for i in out if table[i].ref_cnt == 1)
            num_new_blocks += max(0, need - len(table))
        return tables, releases, num_new_blocks, gained

    @staticmethod
    def _revived(hit: PrefixHit | None) -> int:
        return sum(1 for t in hit.tables for b in t if b.ref_cnt == 0) if hit else 0

    @staticmethod
    def _as_hit(new_computed_blocks: Sequence[KVBlock] | PrefixHit) -> PrefixHit | None:
        if isinstance(new_computed_blocks, PrefixHit):
            return new_computed_blocks if new_computed_blocks.num_tokens else None
        if new_computed_blocks:
            raise TypeError("a hybrid KV cache takes its prefix hits as a PrefixHit (get_computed_blocks)")
        return None

    # ----------------------------------------------------------------- queries
    def block_ids(self, request_id: str) -> GroupBlockIds:  # type: ignore[override]
        return tuple([b.block_id for b in t] for t in self.req_tables.get(request_id, ()))

    def num_request_blocks(self, request_id: str) -> int:
        """Blocks in the request's full-attention table (every group's table has its length): what the
        unused slots of its last block are counted against."""
        tables = self.req_tables.get(request_id)
        return len(tables[0]) if tables else 0

    def max_blocks_for_tokens(self, num_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` may hold at once: a prompt prefilled in one step holds
        a block per position in every group until its next step releases what left the windows."""
        return self.groups.num_groups * self.blocks_needed(num_tokens)

    def num_live_blocks(self, request_id: str) -> int:
        """Blocks the request holds over every group (null entries excluded)."""
        return sum(len(self._live(t)) for t in self.req_tables.get(request_id, ()))

    # ----------------------------------------------------------------- prefix cache
    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int],  # type: ignore[override]
                            count_stats: bool = True) -> PrefixHit:
        """The longest valid hit (see the module's docstring), capped so the last token is computed."""
        bs = self.block_size
        if not self.enable_prefix_caching:
            return PrefixHit(0, bs, [])
        hashes = self._full_block_hashes(request_id, token_ids)
        max_blocks = min(len(hashes), (len(token_ids) - 1) // bs)
        windows = self.groups.windows
        cached = [[self.pool.lookup(self._group_key(hashes[i], g)) for i in range(max_blocks)]
                  for g in range(len(windows))]
        # Full groups: every block before the hit; the longest run from the start bounds it.
        k = max_blocks
        for g, w in enumerate(windows):
            if not w:
                k = next((i for i, b in enumerate(cached[g][:k]) if b is None), k)
        # Sliding groups: the blocks a query at position k * bs reads; try shorter hits until all hold.
        while k > 0 and not all(
                all(b is not None for b in cached[g][self._first_live(g, k * bs):k])
                for g, w in enumerate(windows) if w):
            k -= 1
        tables = []
        for g in range(len(windows)):
            first = self._first_live(g, k * bs)
            tables.append([self.null_block] * first + cached[g][first:k])
        if count_stats:
            self.prefix_stats.queries += len(token_ids)
            self.prefix_stats.hits += k * bs
        return PrefixHit(k * bs, bs, tables if k else [])

    def _publish_full_blocks(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> None:
        """Make the request's full blocks findable, group by group, from the first one not settled yet."""
        hashes = self._full_block_hashes(request_id, token_ids, num_tokens)
        tables = self.req_tables[request_id]
        start = self._published.get(request_id, 0)
        end = num_tokens // self.block_size
        if end <= start:
            return
        bs, events = self.block_size, self.events
        for g, table in enumerate(tables):
            stored: BlockStored | None = None
            for i in range(start, end):
                block = table[i]
                key = self._group_key(hashes[i], g)
                if block is self.null_block or block.block_hash is not None or not self.pool.publish(block, key):
                    stored = None
                    continue
                if events is None:
                    continue
                if stored is None:
                    parent = external_hash(self._group_key(hashes[i - 1], g)) if i else None
                    stored = BlockStored([], parent, [], bs)
                    events.append(stored)
                stored.block_hashes.append(external_hash(key))
                stored.token_ids.extend(token_ids[i * bs:(i + 1) * bs])
        self._published[request_id] = end

    # ----------------------------------------------------------------- allocation
    def allocate_slots(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,  # type: ignore[override]
                       num_new_tokens: int, new_computed_blocks: Sequence[KVBlock] | PrefixHit = ()
                       ) -> GroupBlockIds | None:
        """Release the blocks the window left behind, then make room for ``num_new_tokens`` in every group.

        Returns, per group, the ids appended to the request's table (a new request: its whole table, nulls
        included), or None, changing nothing, when the pool is too small even after the releases.
        """
        hit = self._as_hit(new_computed_blocks)
        is_new = request_id not in self.req_tables
        tables, releases, num_new, gained = self._plan(request_id, num_computed_tokens, num_new_tokens, hit)
        if num_new + self._revived(hit) > self.pool.num_free_blocks + gained:
            return None
        # Tail first, so the blocks nearest the window (the likeliest to serve a later prefix) live longest.
        for g in range(len(tables)):
            table = tables[g]
            self.pool.release([table[i] for i in reversed(releases[g])])
            for i in releases[g]:
                table[i] = self.null_block
        if hit:
            self.pool.touch([b for t in hit.tables for b in t if b is not self.null_block])
        computed = num_computed_tokens + (hit.num_tokens if hit else 0)
        total = computed + num_new_tokens
        need = self.blocks_needed(total)
        appended: list[list[int]] = []
        for table in tables:
            before = 0 if is_new else len(table)
            table.extend(self.pool.allocate(max(0, need - len(table))))
            appended.append([b.block_id for b in table[before:]])
        self.req_tables[request_id] = tables
        self.req_computed[request_id] = computed
        if self.enable_prefix_caching:
            self._publish_full_blocks(request_id, token_ids, min(total, len(token_ids)))
        return tuple(appended)

    def num_blocks_short(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,  # type: ignore[override]
                         new_computed_blocks: Sequence[KVBlock] | PrefixHit = (), reserve: int = 0) -> int:
        """How many more free blocks ``allocate_slots`` would need to leave ``reserve`` free (0: it fits),
        counting what each group really needs: the window's releases come back first."""
        hit = self._as_hit(new_computed_blocks)
        _, _, num_new, gained = self._plan(request_id, num_computed_tokens, num_new_tokens, hit)
        return max(0, num_new + self._revived(hit) + reserve - self.pool.num_free_blocks - gained)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Release, in every group, the blocks past the ones ``num_tokens`` tokens fill (rejected proposals'
        slots), tail first. They lie after the window's start, so none is the null block, and they hold no
        published prefix."""
        tables = self.req_tables.get(request_id)
        keep = self.blocks_needed(num_tokens)
        if not tables or len(tables[0]) <= keep:
            return
        order = [t[i] for i in range(len(tables[0]) - 1, keep - 1, -1) for t in tables]
        assert all(b is not self.null_block and b.block_hash is None for b in order), "trimmed a kept block"
        for table in tables:
            del table[keep:]
        self.pool.release(order)

    def free(self, request_id: str) -> None:
        """Release every block the request holds, tail first across its groups (shared roots live longest)."""
        tables = self.req_tables.pop(request_id, None)
        self.req_hashes.pop(request_id, None)
        self.req_computed.pop(request_id, None)
        self._published.pop(request_id, None)
        if not tables:
            return
        null = self.null_block
        order = [t[i] for i in range(len(tables[0]) - 1, -1, -1) for t in tables if t[i] is not null]
        self.pool.release(order)

    # ----------------------------------------------------------------- swap tier
    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Copy plan (device block, swap block) for the request's live blocks of every group; None when the
        swap tier is too small. The device blocks are released at once."""
        tables = self.req_tables.get(request_id)
        if self.swap is None or not tables:
            return None
        live = [(g, i, b) for g, t in enumerate(tables) for i, b in enumerate(t) if b is not self.null_block]
        if not live or len(live) > self.swap.num_free:
            return None
        assert request_id not in self.swapped, f"request {request_id} is already swapped out"
        swap_ids = self.swap.allocate(len(live))
        self.swapped[request_id] = swap_ids
        self._swap_positions[request_id] = [(g, i) for g, i, _ in live]
        pairs = [(b.block_id, s) for (_, _, b), s in zip(live, swap_ids)]
        self.free(request_id)
        return pairs

    def swap_in(self, request_id: str, token_ids: Sequence[int], num_saved_tokens: int,  # type: ignore[override]
                num_new_tokens: int) -> tuple[GroupBlockIds, list[tuple[int, int]]] | None:
        """Device tables for a swapped request (nulls before each window at ``num_saved_tokens``) and the copy
        plan (swap block, device block) of the saved blocks still in a window; None, changing nothing, when
        the pool has too few free blocks."""
        need = self.blocks_needed(num_saved_tokens + num_new_tokens)
        firsts = [self._first_live(g, num_saved_tokens) for g in range(self.groups.num_groups)]
        if sum(need - f for f in firsts) > self.pool.num_free_blocks:
            return None
        tables = [[self.null_block] * f + self.pool.allocate(need - f) for f in firsts]
        swap_ids = self.swapped.pop(request_id)
        positions = self._swap_positions.pop(request_id)
        pairs = [(s, tables[g][i].block_id) for s, (g, i) in zip(swap_ids, positions)
                 if firsts[g] <= i < need]
        self.swap.release(swap_ids)
        self.req_tables[request_id] = tables
        self.req_computed[request_id] = num_saved_tokens
        if self.enable_prefix_caching:
            self._publish_full_blocks(request_id, token_ids, min(num_saved_tokens + num_new_tokens, len(token_ids)))
        return tuple([b.block_id for b in t] for t in tables), pairs

    def drop_swapped(self, request_id: str) -> None:
        super().drop_swapped(request_id)
        self._swap_positions.pop(request_id, None)

    # ----------------------------------------------------------------- the elastic pool
    def relayout(self, new_block_size: int, num_blocks: int,  # type: ignore[override]
                 live: dict[str, int]) -> dict[str, GroupBlockIds]:
        """A fresh pool of another block size (the null block first) holding ``live`` requests (id ->
        computed tokens), each group's table null before its window. The prefix cache starts empty."""
        tables: dict[str, list[list[KVBlock]]] = {}
        needed = 1
        for n in live.values():
            nb = -(-n // new_block_size)
            needed += sum(nb - first_live_block(n, w, new_block_size) for w in self.groups.windows)
        if needed > num_blocks:
            raise ValueError(f"relayout needs {needed} blocks of {new_block_size}, pool has {num_blocks}")
        self._fresh_pool(new_block_size, num_blocks)
        self.null_block = self._reserve_null()
        self.req_hashes, self.req_computed, self._published = {}, {}, {}
        for request_id, n in live.items():
            nb = self.blocks_needed(n)
            firsts = [self._first_live(g, n) for g in range(self.groups.num_groups)]
            tables[request_id] = [[self.null_block] * f + self.pool.allocate(nb - f) for f in firsts]
            self.req_computed[request_id] = n
        self.req_tables = tables
        return {rid: tuple([b.block_id for b in t] for t in ts) for rid, ts in tables.items()}

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        if self.swap is not None:
            self.swap.check_invariants(self.swapped)
        null = self.null_block
        assert null.block_id == NULL_BLOCK_ID and null.ref_cnt == 1 and null.block_hash is None, null
        entries = 0
        for request_id, tables in self.req_tables.items():
            assert len(tables) == self.groups.num_groups
            assert len({len(t) for t in tables}) == 1, "a request's group tables differ in length"
            computed = self.req_computed[request_id]
            for g, table in enumerate(tables):
                first = min(self._first_live(g, computed), len(table))
                assert all(b is null for b in table[:first]), f"{request_id}: a block before group {g}'s window"
                assert all(b is not null for b in table[first:]), f"{request_id}: a null in group {g}'s window"
                entries += len(table) - first
        total_refs = sum(b.ref_cnt for b in self.pool.blocks)
        assert total_refs == entries + 1, "ref counts != non-null table entries + the null block"
