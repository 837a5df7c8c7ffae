"""Hypothesis: random arrivals with random priorities on a tiny pool, under both policies and both
preemption modes, with and without prefix caching. Every request finishes with exactly its tokens, the
queues stay in policy order, the cache manager's invariants hold after every step, and nothing leaks."""

from hypothesis import given, settings
from hypothesis import strategies as st

from tideserve.config import SchedulerConfig
from tideserve.core.kv_cache.manager import KVCacheManager
from tideserve.core.scheduler import Scheduler
from tideserve.request import Request
from tideserve.sampling_params import SamplingParams

NUM_BLOCKS, BLOCK = 6, 4  # one request needs at most 5 blocks (12 prompt + 6 output tokens)

requests_st = st.lists(st.tuples(st.integers(1, 12),  # prompt tokens
                                 st.integers(1, 6),  # max_tokens
                                 st.integers(0, 3),  # priority
                                 st.integers(0, 6)),  # arrival step
                       min_size=1, max_size=10)


@settings(max_examples=150, deadline=None)
@given(requests_st, st.sampled_from(["fcfs", "priority"]), st.sampled_from(["recompute", "swap"]),
       st.integers(1, 4), st.booleans())
def test_every_request_finishes_in_order_without_leaks(specs, policy, mode, max_seqs, prefix_caching):
    kv = KVCacheManager(NUM_BLOCKS, BLOCK, enable_prefix_caching=prefix_caching)
    if mode == "swap":
        kv.enable_swap(4)
    s = Scheduler(SchedulerConfig(max_seqs, 8, True, mode, policy), kv, max_model_len=64)
    want: dict[str, int] = {}
    done: dict[str, list[int]] = {}
    for step_no in range(400):
        for i, (n_prompt, max_tokens, priority, arrival) in enumerate(specs):
            if arrival == step_no:
                rid = f"r{i}"
                r = Request(rid, [(i + t) % 5 for t in range(n_prompt)],
                            SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0, max_tokens,
                            priority=priority)
                want[rid] = max_tokens
                s.add_request(r)
        if step_no > max(a for *_, a in specs) and not s.has_unfinished():
            break
        out = s.schedule()
        sampled = {rid: [1] for rid in out.num_scheduled_tokens
                   if s.requests[rid].num_computed_tokens >= s.requests[rid].num_tokens}
        for r in s.update_from_output(sampled):
            if r.is_finished:
                done[r.request_id] = list(r.output_token_ids)
        kv.check_invariants()
        keys = [s._order_key(r) for r in s.running]
        assert keys == sorted(keys)
        if policy == "priority":
            keys = [s._order_key(r) for r in s.waiting]
            assert keys == sorted(keys)
    assert not s.has_unfinished(), "requests left unfinished after 400 steps"
    assert {rid: len(t) for rid, t in done.items()} == want
    assert kv.num_free_blocks == NUM_BLOCKS and not kv.swapped and not kv.cache_salts
