"""Hypothesis state machine over the cache manager: random interleavings of allocate, append, prefix
hit, free, preempt (recompute and swap), swap in, grow, shrink, compact and block-size change keep
every invariant, and nothing leaks when all requests end."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tideserve.core.kv_cache.manager import KVCacheManager

NUM_BLOCKS = 12
NUM_SWAP = 6


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, 4, enable_prefix_caching=True)
        self.kv.enable_swap(NUM_SWAP)
        self.tokens: dict[str, list[int]] = {}  # live (block-holding) requests
        self.computed: dict[str, int] = {}
        self.swapped: dict[str, tuple[list[int], int]] = {}  # request -> (tokens, computed)
        self.next_id = 0

    @property
    def bs(self) -> int:
        return self.kv.block_size

    def _expect_table(self, rid: str) -> None:
        assert len(self.kv.block_ids(rid)) == -(-self.computed[rid] // self.bs)

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=20))
    def add(self, prompt):
        rid = f"r{self.next_id}"
        self.next_id += 1
        hit = self.kv.get_computed_blocks(rid, prompt)
        num_hit = len(hit) * self.bs
        assert num_hit < len(prompt)
        free_before = self.kv.num_free_blocks
        ids = self.kv.allocate_slots(rid, prompt, 0, len(prompt) - num_hit, hit)
        if ids is None:
            assert self.kv.num_free_blocks == free_before and self.kv.block_ids(rid) == []
            self.kv.free(rid)
            return
        self.tokens[rid] = list(prompt)
        self.computed[rid] = len(prompt)
        self._expect_table(rid)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.tokens[rid].append(token)
        if self.kv.allocate_slots(rid, self.tokens[rid], self.computed[rid], 1) is None:
            self.tokens[rid].pop()
            self._drop(rid)  # recompute preemption
            return
        self.computed[rid] += 1
        self._expect_table(rid)

    def _drop(self, rid):
        self.kv.free(rid)
        del self.tokens[rid], self.computed[rid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        self._drop(data.draw(st.sampled_from(sorted(self.tokens))))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def swap_out(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        n_blocks = len(self.kv.block_ids(rid))
        swap_free = self.kv.swap.num_free
        pairs = self.kv.swap_out(rid)
        if pairs is None:
            assert n_blocks > swap_free
            self._drop(rid)
            return
        assert [d for d, _ in pairs] and len(pairs) == n_blocks
        self.swapped[rid] = (self.tokens.pop(rid), self.computed.pop(rid))

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        rid = data.draw(st.sampled_from(sorted(self.swapped)))
        tokens, computed = self.swapped[rid]
        result = self.kv.swap_in(rid, tokens, computed, 0)
        if result is None:
            return
        block_ids, pairs = result
        assert len(pairs) == len(block_ids) == -(-computed // self.bs)
        del self.swapped[rid]
        self.tokens[rid], self.computed[rid] = tokens, computed
        self._expect_table(rid)

    @rule(n=st.integers(1, 6))
    def grow(self, n):
        before = self.kv.num_blocks
        self.kv.grow(n)
        assert self.kv.num_blocks == before + n

    @rule(extra=st.integers(0, 4), keep=st.integers(0, 6))
    def shrink(self, extra, keep):
        """The pool controller's shrink: keep the most valuable cached prefixes that fit, compact every
        held block below the target, drop the tail."""
        used = self.kv.num_blocks - self.kv.num_free_blocks
        keep = min(keep, self.kv.pool.num_cached_free())
        target = max(1, used + keep + extra)
        ranked = self.kv.pool.cached_free_by_value()
        kept_hashes = {self.kv.pool.blocks[i].block_hash for i in ranked[:keep]}
        evicted = self.kv.retain_cached(keep)
        assert evicted == len(ranked) - keep
        tables = {rid: self.kv.block_ids(rid) for rid in self.tokens}
        moves = dict(self.kv.compact(target))
        for rid, ids in tables.items():  # tables follow the moves
            assert self.kv.block_ids(rid) == [moves.get(b, b) for b in ids]
        assert self.kv.pool.highest_held_id() < target
        if target < self.kv.num_blocks:
            self.kv.shrink_to(target)
        # The kept prefixes are exactly the most valuable ones, still findable by their hashes.
        assert {b.block_hash for b in self.kv.pool.blocks if b.ref_cnt == 0 and b.block_hash is not None} \
            == kept_hashes
        assert self.kv.external_fragmentation() == 0.0 or extra > 0

    @rule()
    def compact_keeping_cache(self):
        cached = set(self.kv.pool.cached)
        self.kv.compact(self.kv.num_held_blocks())
        assert set(self.kv.pool.cached) == cached
        assert self.kv.external_fragmentation() == 0.0

    @precondition(lambda self: not self.swapped)
    @rule(new_bs=st.sampled_from([2, 4, 8]))
    def change_block_size(self, new_bs):
        needed = sum(-(-c // new_bs) for c in self.computed.values())
        num_blocks = max(needed + 1, self.kv.num_blocks * self.bs // new_bs)
        tables = self.kv.relayout(new_bs, num_blocks, dict(self.computed))
        for rid, ids in tables.items():
            assert len(ids) == -(-self.computed[rid] // new_bs)
        self.kv.enable_swap(NUM_SWAP)

    @rule()
    def reset_cache(self):
        self.kv.reset_prefix_cache()

    @invariant()
    def invariants_hold(self):
        self.kv.check_invariants()
        used = sum(1 for b in self.kv.pool.blocks if b.ref_cnt > 0)
        assert used + self.kv.num_free_blocks == self.kv.num_blocks
        assert set(self.kv.req_blocks) == set(self.tokens)
        assert not set(self.kv.swapped) & set(self.kv.req_blocks), "a request is swapped and holds blocks"
        assert set(self.kv.swapped) == set(self.swapped)

    def teardown(self):
        for rid in list(self.tokens):
            self.kv.free(rid)
        for rid in list(self.swapped):
            self.kv.drop_swapped(rid)
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)
        if self.kv.swap is not None:
            assert self.kv.swap.num_free == self.kv.swap.num_blocks


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
