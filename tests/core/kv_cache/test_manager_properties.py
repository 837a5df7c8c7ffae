"""Hypothesis state machine over the cache manager: random allocate / append / prefix hit / free /
preempt interleavings keep every invariant, and nothing leaks when all requests end."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tideserve.core.kv_cache.manager import KVCacheManager

BLOCK = 4
NUM_BLOCKS = 12


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK, enable_prefix_caching=True)
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.next_id = 0

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=20))
    def add(self, prompt):
        rid = f"r{self.next_id}"
        self.next_id += 1
        hit = self.kv.get_computed_blocks(rid, prompt)
        num_hit = len(hit) * BLOCK
        assert num_hit < len(prompt)
        free_before = self.kv.num_free_blocks
        ids = self.kv.allocate_slots(rid, prompt, 0, len(prompt) - num_hit, hit)
        if ids is None:
            assert self.kv.num_free_blocks == free_before
            assert self.kv.block_ids(rid) == []
            self.kv.req_hashes.pop(rid, None)
            return
        self.tokens[rid] = list(prompt)
        self.computed[rid] = len(prompt)
        assert len(self.kv.block_ids(rid)) == -(-len(prompt) // BLOCK)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.tokens[rid].append(token)
        ids = self.kv.allocate_slots(rid, self.tokens[rid], self.computed[rid], 1)
        if ids is None:  # out of blocks: preempt this request, as the scheduler would
            self.tokens[rid].pop()
            self.kv.free(rid)
            del self.tokens[rid], self.computed[rid]
            return
        self.computed[rid] += 1
        assert len(self.kv.block_ids(rid)) == -(-self.computed[rid] // BLOCK)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(rid)
        del self.tokens[rid], self.computed[rid]

    @rule()
    def reset_cache(self):
        self.kv.reset_prefix_cache()

    @invariant()
    def invariants_hold(self):
        self.kv.check_invariants()
        used = sum(1 for b in self.kv.pool.blocks if b.ref_cnt > 0)
        assert used + self.kv.num_free_blocks == NUM_BLOCKS

    def teardown(self):
        for rid in list(self.tokens):
            self.kv.free(rid)
        assert self.kv.num_free_blocks == NUM_BLOCKS
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
