"""The hybrid (several KV cache groups) cache manager: the grouping of layers, exact block ids of the window
freeing and of prefix hits across the two kinds of layer, and a hypothesis state machine over random
interleavings of admit (with prefix hits), chunked prefill, decode, free, preempt (recompute and swap),
swap in, grow, shrink, compact, block-size change and cache reset, every invariant checked after each."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tideserve.core.kv_cache.events import apply_events
from tideserve.core.kv_cache.groups import KVCacheGroups, first_live_block
from tideserve.core.kv_cache.hybrid import HybridKVCacheManager, PrefixHit


def test_grouping_gemma3_270m():
    """18 layers, every sixth global: 3 full + 15 local -> groups of 3 layers, 1 full + 5 sliding."""
    windows = [0 if (i + 1) % 6 == 0 else 512 for i in range(18)]
    groups = KVCacheGroups.from_windows(windows)
    assert groups.group_size == 3 and groups.windows == (0, 512, 512, 512, 512, 512)
    assert [groups.layer_group[i] for i in (5, 11, 17)] == [0, 0, 0]
    assert [groups.layer_slot[i] for i in (5, 11, 17)] == [0, 1, 2]
    assert groups.layer_group[:5] == (1, 1, 1, 2, 2) and groups.layer_slot[:5] == (0, 1, 2, 0, 1)
    assert groups.is_hybrid


def test_one_kind_of_layer_is_one_group():
    for windows in ([0] * 4, [4096] * 4):
        groups = KVCacheGroups.from_windows(windows)
        assert not groups.is_hybrid and groups.group_size == 4 and groups.layer_slot == (0, 1, 2, 3)


def test_first_live_block():
    # window 6, block 4: a query at 9 reads keys 4..9 -> block 1 on; at 8, keys 3..8 -> block 0 on.
    assert first_live_block(9, 6, 4) == 1 and first_live_block(8, 6, 4) == 0
    assert first_live_block(100, 0, 4) == 0


def make(num_blocks=16, windows=(0, 6), bs=4):
    return HybridKVCacheManager(num_blocks, bs, KVCacheGroups.from_windows(list(windows)))


def test_window_frees_blocks_exact_ids():
    kv = make()  # group 0 full, group 1 window 6; block 0 is the null block
    ids = kv.allocate_slots("a", list(range(10)), 0, 10)
    assert ids == ([1, 2, 3], [4, 5, 6])
    # Decoding token 10: computed 10 -> keys 5.. -> block 0 (positions 0..3) leaves group 1's window.
    ids = kv.allocate_slots("a", list(range(11)), 10, 1)
    assert ids == ([], []) and kv.block_ids("a") == ([1, 2, 3], [0, 5, 6])
    assert kv.pool.blocks[4].ref_cnt == 0 and kv.pool.blocks[4].block_hash is not None  # cached, evictable
    ids = kv.allocate_slots("a", list(range(13)), 11, 2)  # computed 11 -> keys 6..: block 1 stays
    assert ids == ([7], [8]) and kv.block_ids("a") == ([1, 2, 3, 7], [0, 5, 6, 8])
    kv.check_invariants()
    kv.free("a")
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks - 1  # only the null block stays held


def test_capacity_counts_the_releases():
    """A pool with no free block still admits a decode whose window release frees one."""
    kv = make(num_blocks=7)  # null + 6
    assert kv.allocate_slots("a", list(range(12)), 0, 12) == ([1, 2, 3], [4, 5, 6])
    assert kv.num_free_blocks == 0
    # computed 12: keys 7.. -> block 0 of group 1 goes; 13 tokens need a 4th block in both groups: short 1.
    assert kv.num_blocks_short("a", 12, 1) == 1
    assert kv.allocate_slots("a", list(range(13)), 12, 1) is None and kv.block_ids("a") == ([1, 2, 3], [4, 5, 6])
    kv.grow(1)
    assert kv.num_blocks_short("a", 12, 1) == 0
    assert kv.allocate_slots("a", list(range(13)), 12, 1) == ([7], [4])  # the released block, reused at once
    kv.check_invariants()


def test_prefix_hit_across_kinds_of_layer():
    kv = make(num_blocks=32)
    prompt = list(range(20))
    kv.allocate_slots("a", prompt, 0, 20)  # groups: [1..5], [6..10]
    kv.allocate_slots("a", prompt + [99], 20, 1)  # computed 20: keys 15.. -> group 1 keeps blocks 3, 4
    assert kv.block_ids("a") == ([1, 2, 3, 4, 5, 11], [0, 0, 0, 9, 10, 12])
    kv.free("a")
    # Same 20 tokens + 1: hit 20 tokens; a query at 20 reads keys 15..19 -> group 1 needs block 3, 4 only.
    hit = kv.get_computed_blocks("b", prompt + [7])
    assert isinstance(hit, PrefixHit) and hit.num_tokens == 20 and len(hit) == 5
    assert [[b.block_id for b in t] for t in hit.tables] == [[1, 2, 3, 4, 5], [0, 0, 0, 9, 10]]
    assert kv.allocate_slots("b", prompt + [7], 0, 1, hit) == ([1, 2, 3, 4, 5, 11], [0, 0, 0, 9, 10, 12])
    kv.check_invariants()
    # Forget group 1's block for tokens 16..19: a 20-token hit is no longer valid, 16 is (keys 11..15).
    kv.free("b")
    key = kv._group_key(kv._full_block_hashes("c", prompt)[4], 1)
    kv.pool.evict_cached_ids([kv.pool.cached[key].block_id])
    hit = kv.get_computed_blocks("c", prompt + [7])
    assert hit.num_tokens == 16 and [[b.block_id for b in t] for t in hit.tables] == [[1, 2, 3, 4], [0, 0, 8, 9]]


def test_groups_never_alias():
    kv = make(num_blocks=32, windows=(0, 0, 100, 100))  # two groups, both reading everything they hold
    prompt = list(range(9))
    kv.allocate_slots("a", prompt, 0, 9)
    hashes = kv._full_block_hashes("a", prompt)
    tables = kv.req_tables["a"]
    for g, table in enumerate(tables):
        for i in range(2):
            assert table[i].block_hash == kv._group_key(hashes[i], g)
    assert tables[0][0] is not tables[1][0]


def test_swap_round_trip_skips_blocks_out_of_window():
    kv = make(num_blocks=16)
    kv.enable_swap(8)
    kv.allocate_slots("a", list(range(10)), 0, 10)  # ([1, 2, 3], [4, 5, 6])
    pairs = kv.swap_out("a")
    assert pairs == [(1, 0), (2, 1), (3, 2), (4, 3), (5, 4), (6, 5)]
    # Resumed at 10 computed tokens: group 1's block 0 is out of the window and is not copied back. (The
    # pool hands out empty blocks first: 1, 2, 4, 5 still hold cached prefixes.)
    ids, back = kv.swap_in("a", list(range(11)), 10, 1)
    assert ids == ([3, 6, 7], [0, 8, 9]) and back == [(0, 3), (1, 6), (2, 7), (4, 8), (5, 9)]
    kv.check_invariants()


def test_events_replay_to_the_cached_set():
    kv = make(num_blocks=10)
    kv.enable_events()
    seen: set[int] = set()
    for r in range(6):
        prompt = [r] * 14
        if kv.allocate_slots(f"r{r}", prompt, 0, 14) is not None:
            kv.allocate_slots(f"r{r}", prompt + [1], 14, 1)
            kv.free(f"r{r}")
        apply_events(seen, kv.take_events())
        assert seen == {h & (2**64 - 1) for h in kv.pool.cached}
    kv.reset_prefix_cache()
    assert apply_events(seen, kv.take_events()) == set()


NUM_BLOCKS = 24
NUM_SWAP = 10


class HybridMachine(RuleBasedStateMachine):
    """The manager against a model of each request: its tokens, computed tokens and last step's start."""

    WINDOWS: tuple[int, ...] = (0, 6, 6, 0, 9, 9)

    def __init__(self) -> None:
        super().__init__()
        self.kv = HybridKVCacheManager(NUM_BLOCKS, 4, KVCacheGroups.from_windows(list(self.WINDOWS)))
        self.kv.enable_swap(NUM_SWAP)
        self.kv.enable_events()
        self.seen: set[int] = set()
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.step_start: dict[str, int] = {}  # computed tokens before the request's latest step
        self.swapped: dict[str, tuple[list[int], int]] = {}
        self.next_id = 0

    @property
    def bs(self) -> int:
        return self.kv.block_size

    def _check_request(self, rid: str) -> None:
        """Tables: the computed tokens' length, null exactly before each window (checked in the invariant),
        and a sliding group holds at most floor((n + w - 2) / B) + 2 blocks after a step of n tokens."""
        ids = self.kv.block_ids(rid)
        c, start = self.computed[rid], self.step_start[rid]
        for g, w in enumerate(self.kv.groups.windows):
            assert len(ids[g]) == -(-c // self.bs)
            live = sum(1 for b in ids[g] if b != self.kv.null_block_id)
            assert live == len(ids[g]) - first_live_block(start, w, self.bs)
            if w:
                assert live <= (c - start + w - 2) // self.bs + 2

    def _step(self, rid: str, new_tokens: list[int], num_new: int) -> bool:
        tokens = self.tokens[rid] + new_tokens
        free_before = self.kv.num_free_blocks
        short = self.kv.num_blocks_short(rid, self.computed[rid], num_new)
        if self.kv.allocate_slots(rid, tokens, self.computed[rid], num_new) is None:
            assert short > 0 and self.kv.num_free_blocks == free_before
            self._drop(rid)  # recompute preemption
            return False
        assert short == 0
        self.tokens[rid] = tokens
        self.step_start[rid] = self.computed[rid]
        self.computed[rid] += num_new
        self._check_request(rid)
        return True

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=24), chunk=st.integers(1, 24))
    def add(self, prompt, chunk):
        rid = f"r{self.next_id}"
        self.next_id += 1
        hit = self.kv.get_computed_blocks(rid, prompt)
        assert hit.num_tokens < len(prompt)
        num_new = min(chunk, len(prompt) - hit.num_tokens)
        short = self.kv.num_blocks_short(rid, 0, num_new, hit)
        ids = self.kv.allocate_slots(rid, prompt, 0, num_new, hit)
        if ids is None:
            assert short > 0 and self.kv.block_ids(rid) == ()
            self.kv.free(rid)
            return
        assert short == 0
        self.tokens[rid] = list(prompt)
        self.step_start[rid] = hit.num_tokens
        self.computed[rid] = hit.num_tokens + num_new
        assert ids == self.kv.block_ids(rid)
        self._check_request(rid)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 2), chunk=st.integers(1, 12))
    def step(self, data, token, chunk):
        """A prefill chunk while the prompt is not computed, else one decode token."""
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        pending = len(self.tokens[rid]) - self.computed[rid]
        if pending > 0:
            self._step(rid, [], min(chunk, pending))
        else:
            self._step(rid, [token], 1)

    def _drop(self, rid):
        self.kv.free(rid)
        del self.tokens[rid], self.computed[rid], self.step_start[rid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        self._drop(data.draw(st.sampled_from(sorted(self.tokens))))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def swap_out(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        live = sum(1 for t in self.kv.block_ids(rid) for b in t if b != self.kv.null_block_id)
        swap_free = self.kv.swap.num_free
        pairs = self.kv.swap_out(rid)
        if pairs is None:
            assert live > swap_free
            self._drop(rid)
            return
        assert len(pairs) == live
        self.swapped[rid] = (self.tokens.pop(rid), self.computed.pop(rid))
        del self.step_start[rid]

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        rid = data.draw(st.sampled_from(sorted(self.swapped)))
        tokens, computed = self.swapped[rid]
        result = self.kv.swap_in(rid, tokens, computed, 0)
        if result is None:
            return
        del self.swapped[rid]
        self.tokens[rid], self.computed[rid], self.step_start[rid] = tokens, computed, computed
        assert result[0] == self.kv.block_ids(rid)
        self._check_request(rid)

    @rule(n=st.integers(1, 6))
    def grow(self, n):
        self.kv.grow(n)

    @rule(extra=st.integers(0, 4), keep=st.integers(0, 6))
    def shrink(self, extra, keep):
        used = self.kv.num_blocks - self.kv.num_free_blocks
        keep = min(keep, self.kv.pool.num_cached_free())
        target = max(1, used + keep + extra)
        self.kv.retain_cached(keep)
        tables = {rid: self.kv.block_ids(rid) for rid in self.tokens}
        moves = dict(self.kv.compact(target))
        for rid, ids in tables.items():  # tables follow the moves; the null block never moves
            assert self.kv.block_ids(rid) == tuple([moves.get(b, b) for b in t] for t in ids)
        assert self.kv.pool.highest_held_id() < target
        if target < self.kv.num_blocks:
            self.kv.shrink_to(target)

    @precondition(lambda self: not self.swapped)
    @rule(new_bs=st.sampled_from([2, 4, 8]))
    def change_block_size(self, new_bs):
        num_blocks = max(200, self.kv.num_blocks * self.bs // new_bs)
        tables = self.kv.relayout(new_bs, num_blocks, dict(self.computed))
        for rid, ids in tables.items():
            assert all(len(t) == -(-self.computed[rid] // new_bs) for t in ids)
            self.step_start[rid] = self.computed[rid]
        self.kv.enable_swap(NUM_SWAP)

    @rule()
    def reset_cache(self):
        self.kv.reset_prefix_cache()

    @invariant()
    def invariants_hold(self):
        self.kv.check_invariants()
        used = sum(1 for b in self.kv.pool.blocks if b.ref_cnt > 0)
        assert used + self.kv.num_free_blocks == self.kv.num_blocks
        assert set(self.kv.req_tables) == set(self.tokens)
        assert not set(self.kv.swapped) & set(self.kv.req_tables)
        assert set(self.kv.swapped) == set(self.swapped)
        # Every published block of a request holds its group's key of the request's own chain.
        for rid, tables in self.kv.req_tables.items():
            hashes = self.kv.req_hashes.get(rid, [])
            for g, table in enumerate(tables):
                for i, block in enumerate(table[:len(hashes)]):
                    if block is not self.kv.null_block and block.block_hash is not None:
                        assert block.block_hash == self.kv._group_key(hashes[i], g)
        apply_events(self.seen, self.kv.take_events())
        assert self.seen == {h & (2**64 - 1) for h in self.kv.pool.cached}

    def teardown(self):
        for rid in list(self.tokens):
            self.kv.free(rid)
        for rid in list(self.swapped):
            self.kv.drop_swapped(rid)
        assert self.kv.num_free_blocks == self.kv.num_blocks - 1  # the null block
        assert sum(b.ref_cnt for b in self.kv.pool.blocks) == 1
        if self.kv.swap is not None:
            assert self.kv.swap.num_free == self.kv.swap.num_blocks


class GemmaLikeMachine(HybridMachine):
    WINDOWS = (5, 5, 5, 5, 5, 0)  # five local layers per global one: six groups of one layer


TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestGemmaLikeMachine = GemmaLikeMachine.TestCase
TestGemmaLikeMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("windows", [(0, 6), (5, 5, 5, 5, 5, 0)])
def test_decode_holds_a_bounded_window(windows):
    """A long decode: each sliding group holds at most floor((w - 1) / B) + 2 blocks, the full group all."""
    kv = make(num_blocks=200, windows=windows)
    tokens = list(range(5))
    kv.allocate_slots("a", tokens, 0, 5)
    for c in range(5, 120):
        tokens.append(c % 7)
        assert kv.allocate_slots("a", tokens, c, 1) is not None
        for g, w in enumerate(kv.groups.windows):
            live = sum(1 for b in kv.block_ids("a")[g] if b)
            assert live == (-(-(c + 1) // 4) if not w else -(-(c + 1) // 4) - first_live_block(c, w, 4))
            assert not w or live <= (w - 1) // 4 + 2
    kv.check_invariants()
