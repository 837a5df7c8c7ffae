"""Hypothesis: requests verifying random proposals (some right, some wrong, cut by the step's budget) on a
tiny pool, under both preemption modes, with and without prefix caching. Every request ends with exactly the
tokens it would have produced without proposals, each running request's table covers exactly its computed
tokens after every step (the slots of rejected proposals go back at once), the cache manager's invariants
hold, the counters add up, and nothing leaks. With lookahead (the draft-model method), a request whose step
reaches its last token also holds that many slots past its scheduled ones during the step, and gives them back
with the step's update like the slots of rejected proposals."""

from hypothesis import given, settings
from hypothesis import strategies as st

from tideserve.config import SchedulerConfig
from tideserve.core.kv_cache.manager import KVCacheManager
from tideserve.core.scheduler import Scheduler
from tideserve.request import Request
from tideserve.sampling_params import SamplingParams

NUM_BLOCKS, BLOCK = 8, 4


def truth(i: int, j: int) -> int:
    """Request i's j-th output token: what its model produces whatever was proposed."""
    return (7 * i + 3 * j) % 11 + 1


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 9)), min_size=1, max_size=6),
       st.sampled_from(["recompute", "swap"]), st.integers(1, 3), st.integers(4, 10), st.booleans(),
       st.integers(0, 3), st.data())
def test_outputs_equal_the_unspeculated_ones_and_nothing_leaks(specs, mode, max_seqs, budget, prefix_caching,
                                                               ahead, data):
    kv = KVCacheManager(NUM_BLOCKS, BLOCK, enable_prefix_caching=prefix_caching)
    if mode == "swap":
        kv.enable_swap(4)
    s = Scheduler(SchedulerConfig(max_seqs, budget, True, mode), kv, max_model_len=64)
    if ahead:
        s.lookahead = lambda request, num_spec: ahead
    index = {}
    for i, (n_prompt, max_tokens) in enumerate(specs):
        rid = f"r{i}"
        index[rid] = i
        s.add_request(Request(rid, [(i + t) % 5 for t in range(n_prompt)],
                              SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0, max_tokens))
    done: dict[str, list[int]] = {}
    proposed = accepted = 0
    for _ in range(300):
        if not s.has_unfinished():
            break
        for r in s.running:  # proposals: each one right or wrong, at most what max_tokens leaves room for
            room = r.max_tokens - len(r.output_token_ids) - 1
            if r.num_tokens - r.num_computed_tokens == 1 and room > 0:
                j = len(r.output_token_ids)
                right = data.draw(st.lists(st.booleans(), max_size=min(room, 4)))
                r.spec_token_ids = [truth(index[r.request_id], j + k) if ok else 99 for k, ok in enumerate(right)]
        out = s.schedule()
        sampled = {}
        for rid, drafts in out.spec_token_ids.items():
            assert out.num_scheduled_tokens[rid] == 1 + len(drafts)
        for rid in out.num_scheduled_tokens:  # the lookahead slots exist for the step, after its last token
            r = s.requests[rid]
            reaches_end = r.num_computed_tokens >= r.num_tokens + len(out.spec_token_ids.get(rid, []))
            assert out.num_lookahead_tokens.get(rid, 0) == (ahead if reaches_end else 0)
            assert kv.num_request_blocks(rid) >= -(-(r.num_computed_tokens + out.num_lookahead_tokens.get(rid, 0))
                                                   // BLOCK)
        for rid in out.num_scheduled_tokens:
            r = s.requests[rid]
            if r.num_computed_tokens < r.num_tokens:
                continue  # a prefill chunk
            j = len(r.output_token_ids)
            tokens = []
            for d in out.spec_token_ids.get(rid, []):
                if d != truth(index[rid], j):
                    break
                tokens.append(d)
                j += 1
            tokens.append(truth(index[rid], j))
            proposed += len(out.spec_token_ids.get(rid, []))
            accepted += len(tokens) - 1
            sampled[rid] = tokens
        for r in s.update_from_output(sampled):
            assert 1 <= r.num_new_tokens <= len(sampled[r.request_id])
            if r.is_finished:
                done[r.request_id] = list(r.output_token_ids)
        kv.check_invariants()
        for r in s.running:
            assert kv.num_request_blocks(r.request_id) == -(-r.num_computed_tokens // BLOCK)
            # caught up, or prefilling (its prompt; after a recompute preemption, its outputs too)
            assert r.num_computed_tokens == r.num_tokens - 1 or r.num_computed_tokens < r.num_prompt_tokens or (
                r.num_preemptions and r.num_computed_tokens < r.num_tokens - 1)
    assert not s.has_unfinished(), "requests left unfinished after 300 steps"
    want = {f"r{i}": [truth(i, j) for j in range(max_tokens)] for i, (_, max_tokens) in enumerate(specs)}
    assert done == want
    assert kv.num_free_blocks == NUM_BLOCKS and not kv.swapped
    stats = s.spec_stats
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (proposed, accepted)
    assert sum(stats.accepted_per_pos) == accepted and all(n <= stats.num_drafts for n in stats.accepted_per_pos)
