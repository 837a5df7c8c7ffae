"""Scheduler decisions on a tiny pool, without a model: budgets, chunking, FCFS and preemption."""

from tideserve.config import SchedulerConfig
from tideserve.core.kv_cache.manager import KVCacheManager
from tideserve.core.scheduler import Scheduler
from tideserve.request import Request, RequestStatus
from tideserve.sampling_params import SamplingParams


def make(num_blocks=10, block=4, budget=16, max_seqs=8, chunked=True):
    kv = KVCacheManager(num_blocks, block, enable_prefix_caching=False)
    return Scheduler(SchedulerConfig(max_seqs, budget, chunked), kv, max_model_len=1000)


def req(rid, n_prompt, max_tokens=100):
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   eos_token_id=0, max_tokens=max_tokens)


def step(s, token=7):
    out = s.schedule()
    sampled = {}
    for rid in out.num_scheduled_tokens:
        r = s.requests[rid]
        if r.num_computed_tokens >= r.num_tokens:
            sampled[rid] = [token]
    s.update_from_output(sampled)
    return out


def test_decodes_first_then_waiting_fcfs_under_budget():
    s = make(budget=10)
    s.add_request(req("a", 6))
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 6}
    s.add_request(req("b", 5))
    s.add_request(req("c", 5))
    out = step(s)
    # a decodes (1 token), then b fits whole (5), then c is chunked to the remaining 4.
    assert out.num_scheduled_tokens == {"a": 1, "b": 5, "c": 4}
    assert s.requests["c"].num_computed_tokens == 4 and s.requests["c"].output_token_ids == []
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}
    assert s.requests["c"].output_token_ids == [7]


def test_chunked_prefill_off_runs_a_prompt_whole_in_a_later_step():
    """Without chunking a prompt is never split: it waits while the step's budget is partly spent, and
    runs whole in the next step (the engine refuses max_num_batched_tokens < max_model_len at start)."""
    s = make(budget=8, chunked=False)
    s.add_request(req("a", 5))
    s.add_request(req("b", 6))
    assert step(s).num_scheduled_tokens == {"a": 5}  # b (6) does not fit the 3 tokens left
    assert step(s).num_scheduled_tokens == {"a": 1, "b": 6}


def swap_scheduler(num_blocks=4, num_swap=8):
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=False)
    kv.enable_swap(num_swap)
    return Scheduler(SchedulerConfig(8, 100, True, "swap"), kv, max_model_len=1000)


def test_swap_preemption_resumes_by_copying_back_not_recomputing():
    s = swap_scheduler()
    s.add_request(req("a", 7))
    s.add_request(req("b", 7))
    step(s)
    step(s)
    out = step(s)  # a needs a third block: b (the newest) is swapped out
    assert out.preempted_ids == ["b"] and len(out.swap_out) == 2
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 8  # its KV is kept, on the host
    swap_ids = list(s.kv.swapped["b"])
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    out = step(s)
    # b resumes where it stopped: its 2 blocks are copied back and only its newest token is computed.
    assert out.num_scheduled_tokens == {"b": 1}
    assert [n.num_computed_tokens for n in out.new_requests] == [8]
    assert out.swap_in == list(zip(swap_ids, s.kv.block_ids("b")[:2]))
    assert "b" not in s.kv.swapped and s.kv.swap.num_free == 8
    assert s.num_swap_ins == 1
    s.kv.check_invariants()


def test_swap_falls_back_to_recompute_when_the_swap_pool_is_full():
    s = swap_scheduler(num_swap=1)
    s.add_request(req("a", 7))
    s.add_request(req("b", 7))
    step(s)
    step(s)
    out = step(s)
    assert out.preempted_ids == ["b"] and out.swap_out == []
    assert s.requests["b"].num_computed_tokens == 0 and "b" not in s.kv.swapped


def test_aborting_a_swapped_request_releases_its_swap_blocks():
    s = swap_scheduler()
    s.add_request(req("a", 7))
    s.add_request(req("b", 7))
    for _ in range(3):
        step(s)
    assert "b" in s.kv.swapped
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert not s.kv.swapped and s.kv.swap.num_free == 8
    s.kv.check_invariants()


def test_out_of_blocks_asks_the_pool_for_exactly_what_is_missing():
    s = make(num_blocks=2, block=4, budget=100)
    asked = []

    def grow(num_short):
        asked.append(num_short)
        s.kv.grow(num_short)
        return True

    s.on_out_of_blocks = grow
    s.add_request(req("a", 30))  # 8 blocks: 6 missing
    out = step(s)
    assert asked == [6] and out.num_scheduled_tokens == {"a": 30}


def test_a_waiting_request_short_of_blocks_asks_the_admission_hook_only_while_others_run():
    """While requests run, a newcomer short of blocks asks ``on_out_of_blocks_to_admit``, which may
    decline (the pool's pages are still being committed): the running ones step on, the newcomer waits,
    and nothing is preempted. With nothing running the plain hook is asked: a waiting queue alone must
    never be left waiting on a declined growth."""
    s = make(num_blocks=3, block=4, budget=100)
    asked, admit_asked = [], []

    def grow(num_short):
        asked.append(num_short)
        s.kv.grow(num_short)
        return True

    def decline(num_short):
        admit_asked.append(num_short)
        return False

    s.on_out_of_blocks, s.on_out_of_blocks_to_admit = grow, decline
    s.add_request(req("a", 12))  # 3 blocks: fits, nothing asked
    step(s)
    s.add_request(req("b", 8))  # 2 blocks short while "a" runs: declined
    out = step(s)
    assert admit_asked == [2] and "b" not in out.num_scheduled_tokens and "a" in out.num_scheduled_tokens
    assert [r.request_id for r in s.waiting] == ["b"] and s.num_preemptions == 0
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)  # nothing runs now: the plain hook is asked
    s.kv.shrink_to(1)
    before = len(asked)
    out = step(s)
    assert asked[before:] == [1] and len(admit_asked) == 1 and out.num_scheduled_tokens == {"b": 8}


def test_max_num_seqs_caps_running():
    s = make(max_seqs=2, budget=100)
    for r in "abc":
        s.add_request(req(r, 2))
    out = step(s)
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert [r.request_id for r in s.waiting] == ["c"]


def test_preempts_newest_and_requeues_it_first():
    s = make(num_blocks=4, block=4, budget=100)
    s.add_request(req("a", 7))
    s.add_request(req("b", 7))
    step(s)  # a: 2 blocks for 7 tokens, b: 2 -> pool full; each samples its 8th token
    step(s)  # position 7 still fits in each second block
    out = step(s)  # position 8 needs a third block: none free, so b (the newest) is preempted
    assert out.preempted_ids == ["b"]
    assert s.requests["b"].status == RequestStatus.PREEMPTED
    assert s.requests["b"].num_computed_tokens == 0
    assert s.waiting[0].request_id == "b"
    assert s.num_preemptions == 1
    s.kv.check_invariants()


def test_finished_requests_free_blocks_at_once():
    s = make()
    s.add_request(req("a", 4, max_tokens=2))
    step(s)
    step(s)
    assert "a" not in s.requests and not s.running
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_abort_waiting_and_running():
    s = make()
    s.add_request(req("a", 4))
    s.add_request(req("b", 4))
    step(s)
    s.add_request(req("c", 4))
    assert s.finish_request("a", RequestStatus.FINISHED_ABORTED).status == RequestStatus.FINISHED_ABORTED
    assert s.finish_request("c", RequestStatus.FINISHED_ABORTED) is not None
    assert [r.request_id for r in s.running] == ["b"]
    assert not s.waiting
    assert s.schedule().finished_ids == ["a", "c"]


def test_a_preempted_request_resumes_only_with_room_for_the_running_ones():
    """Resumed into a pool with no free block left, it would be preempted again at the next block the
    running requests need: it waits for one free block per running request."""
    s = make(num_blocks=4, block=4, budget=100)
    s.add_request(req("a", 5))
    step(s)  # a holds 2 blocks (room for 8 tokens), 2 are free
    fresh, resumed = req("fresh", 7), req("resumed", 7)
    resumed.num_preemptions = 1
    s.add_request(resumed)
    assert "resumed" not in step(s).num_scheduled_tokens  # 2 blocks would fit, but leave none for a
    s.waiting.clear()
    s.add_request(fresh)
    assert step(s).num_scheduled_tokens == {"a": 1, "fresh": 7}  # a new request is admitted as before


# ---------------------------------------------------------------------- priority policy
def prio_scheduler(num_blocks=10, block=4, budget=100, max_seqs=8, mode="recompute", num_swap=0):
    kv = KVCacheManager(num_blocks, block, enable_prefix_caching=False)
    if num_swap:
        kv.enable_swap(num_swap)
    return Scheduler(SchedulerConfig(max_seqs, budget, True, mode, "priority"), kv, max_model_len=1000)


def preq(rid, n_prompt, priority, max_tokens=100):
    r = req(rid, n_prompt, max_tokens)
    r.priority = priority
    return r


def test_priority_orders_waiting_by_priority_then_arrival():
    s = prio_scheduler(max_seqs=2)
    for rid, p in [("a", 1), ("b", 0), ("c", 1), ("d", 0)]:
        s.add_request(preq(rid, 2, p))
    assert [r.request_id for r in s.waiting] == ["b", "d", "a", "c"]
    assert set(step(s).num_scheduled_tokens) == {"b", "d"}
    assert [r.request_id for r in s.waiting] == ["a", "c"]


def test_fcfs_ignores_priority_values():
    s = make(max_seqs=2, budget=100)
    for rid, p in [("a", 1), ("b", 0), ("c", 1)]:
        s.add_request(preq(rid, 2, p))
    assert set(step(s).num_scheduled_tokens) == {"a", "b"}


def test_out_of_blocks_preempts_the_lowest_priority_not_the_newest():
    s = prio_scheduler(num_blocks=4)
    s.add_request(preq("low", 7, priority=5))
    s.add_request(preq("high", 7, priority=0))  # newer, but more important
    step(s)
    step(s)
    out = step(s)  # both need a third block: none free
    assert out.preempted_ids == ["low"]
    assert out.num_scheduled_tokens == {"high": 1}
    assert [r.request_id for r in s.running] == ["high"] and s.waiting[0].request_id == "low"
    s.kv.check_invariants()


def test_among_equal_priorities_the_newest_is_preempted():
    s = prio_scheduler(num_blocks=4)
    s.add_request(preq("old", 7, priority=3))
    s.add_request(preq("new", 7, priority=3))
    step(s)
    step(s)
    assert step(s).preempted_ids == ["new"]


def test_a_high_priority_arrival_preempts_running_low_priority_requests_for_blocks():
    s = prio_scheduler(num_blocks=4)
    s.add_request(preq("a", 7, priority=5))
    s.add_request(preq("b", 7, priority=5))
    step(s)  # a and b hold 2 blocks each: the pool is full
    s.add_request(preq("vip", 7, priority=0))
    out = step(s)
    # vip needs 2 blocks: b (newest of the lowest priority) is preempted and vip runs in the same step.
    assert out.preempted_ids == ["b"]
    assert out.num_scheduled_tokens == {"a": 1, "vip": 7}
    assert [r.request_id for r in s.waiting] == ["b"]
    assert [r.request_id for r in s.running] == ["vip", "a"]  # sorted by (priority, arrival)
    s.kv.check_invariants()


def test_a_high_priority_arrival_takes_the_seat_of_a_low_priority_one():
    s = prio_scheduler(max_seqs=1)
    s.add_request(preq("low", 3, priority=1))
    step(s)
    s.add_request(preq("high", 3, priority=0))
    out = step(s)
    assert out.preempted_ids == ["low"] and out.num_scheduled_tokens == {"high": 3}


def test_no_preemption_without_a_priority_inversion():
    s = prio_scheduler(num_blocks=4, max_seqs=1)
    s.add_request(preq("a", 7, priority=2))
    step(s)
    s.add_request(preq("same", 3, priority=2))
    s.add_request(preq("worse", 3, priority=9))
    for _ in range(3):
        out = step(s)
        assert out.preempted_ids == [] and out.num_scheduled_tokens == {"a": 1}
    assert s.num_preemptions == 0


def test_the_elastic_pool_grows_before_a_running_request_is_preempted_for_a_waiting_one():
    s = prio_scheduler(num_blocks=4)
    asked = []

    def grow(num_short):
        asked.append(num_short)
        s.kv.grow(num_short)
        return True

    s.add_request(preq("a", 8, priority=5))
    s.add_request(preq("b", 8, priority=5))
    step(s)
    s.on_out_of_blocks = grow
    s.add_request(preq("vip", 8, priority=0))
    out = step(s)
    assert asked and out.preempted_ids == [] and s.num_preemptions == 0
    assert set(out.num_scheduled_tokens) == {"a", "b", "vip"}


def test_priority_preemption_in_swap_mode_copies_out_and_resumes_without_recompute():
    s = prio_scheduler(num_blocks=5, mode="swap", num_swap=8)
    s.add_request(preq("a", 5, priority=5))
    s.add_request(preq("b", 5, priority=5))
    step(s)  # 2 blocks each, 1 free
    s.add_request(preq("vip", 7, priority=0, max_tokens=1))
    out = step(s)
    assert out.preempted_ids == ["b"] and len(out.swap_out) == 2 and "b" in s.kv.swapped
    assert out.num_scheduled_tokens == {"a": 1, "vip": 7}
    assert s.requests["b"].num_computed_tokens == 5  # its KV is kept, on the host
    out = step(s)  # vip finished at its first token: b is copied back, not recomputed
    assert len(out.swap_in) == 2 and out.num_scheduled_tokens == {"a": 1, "b": 1}
    s.kv.check_invariants()


def test_a_request_waiting_for_its_tier_blocks_is_passed_over_and_keeps_its_place():
    s = make(budget=16)
    for rid in ("a", "b", "c"):
        s.add_request(req(rid, 4))
    s.requests["a"].status = RequestStatus.WAITING_FOR_REMOTE_KVS  # its blocks are being read
    assert step(s).num_scheduled_tokens == {"b": 4, "c": 4}
    assert [r.request_id for r in s.waiting] == ["a"] and s.requests["a"].num_computed_tokens == 0
    s.add_request(req("d", 4))
    s.requests["a"].status = RequestStatus.WAITING  # loaded: it goes before the later arrival
    assert list(step(s).num_scheduled_tokens) == ["b", "c", "a", "d"]


def test_priority_preemption_looks_past_a_request_waiting_for_its_tier_blocks():
    kv = KVCacheManager(10, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(1, 16, True, scheduling_policy="priority"), kv, max_model_len=1000)
    low = req("low", 4)
    low.priority = 5
    s.add_request(low)
    step(s)
    loading = req("loading", 4)
    loading.priority = 0
    s.add_request(loading)
    loading.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    step(s)
    assert s.requests["low"].status == RequestStatus.RUNNING  # not preempted for a request that cannot run
