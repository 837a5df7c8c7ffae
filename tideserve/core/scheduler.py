"""Continuous batching: which requests run this step, and how many tokens each.

One rule covers every phase: a request's ``num_computed_tokens`` catches up with its token count under one
per-step token budget. Running requests go first (decodes, and prefills still in progress), then waiting
requests in arrival order; a prompt larger than what remains of the budget is prefilled in chunks. When no
block is free (and the elastic pool cannot grow), the newest running request is preempted: its blocks
are freed and it goes back to the front of the waiting queue, to be recomputed later, or, in swap mode,
its KV is copied to the host tier and copied back when it resumes. Plain Python over integers.

Two policies order the queues (``SchedulerConfig.scheduling_policy``, vLLM's):
- ``fcfs``: ``running`` and ``waiting`` in arrival order (a preempted request back at the front).
- ``priority``: both ordered by (priority, arrival), lower priority values first; the victim of a
  preemption is the last running request, so the lowest priority (then the newest) goes first. A waiting
  request that outranks the last running one and cannot be admitted (no seat or no blocks) preempts it,
  as vLLM's priority policy does, so a high-priority request overtakes a full engine.
In both, the victim is ``running[-1]``: one invariant, two orders.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tideserve.config import SchedulerConfig
from tideserve.core.kv_cache.manager import KVCacheManager
from tideserve.request import Request, RequestStatus
from tideserve.sampling_params import SamplingParams
from tideserve.spec_decode.backoff import observe_round
from tideserve.spec_decode.stats import SpecDecodeStats

logger = logging.getLogger(__name__)


@dataclass
class NewRequestData:
    """A request the runner has no state for: first scheduled, or resumed after preemption."""

    request_id: str
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int | None  # the request's sampling seed: the runner keeps one generator per seeded request
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int  # includes any prefix-cache hit
    structured_output: Any = None  # the request's grammar matcher (the runner masks its samples with it)

    def __getstate__(self) -> dict[str, Any]:
        """Sent to another rank without its grammar matcher: only rank 0 samples, and a matcher holds
        native state that does not pickle."""
        return {**self.__dict__, "structured_output": None}


@dataclass
class CachedRequestData:
    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # since the previous step
    # KV copies the runner makes before the forward pass: (device block, swap block) and back.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: the proposals each request's step verifies after its last token (its scheduled
    # tokens are 1 + their number).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # The draft-model method: per request whose step reaches its last token, how many tokens the draft
    # proposes after the step's new token. Its slots (that many past the scheduled ones) are allocated for
    # this step only: the draft writes KV there, and ``update_from_output`` hands them back.
    num_lookahead_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.priority_policy = config.scheduling_policy == "priority"
        # fcfs: arrival order (preempted requests at the front); priority: sorted by _order_key.
        self.waiting: deque[Request] = deque()
        # Kept sorted by _order_key (arrival, or (priority, arrival)), so the newest arrival of the lowest
        # priority is preempted first: a request resumed after a preemption (older than the ones that
        # arrived while it waited) is not the next victim again.
        self.running: list[Request] = []
        self._arrival: dict[str, int] = {}
        self._next_arrival = 0
        self.requests: dict[str, Request] = {}
        self._finished_since_step: list[str] = []
        self._preempted_since_step: list[str] = []
        self.num_preemptions = 0
        # Asked before preempting, with the number of blocks missing: did the pool grow? (the elastic pool
        # answers; None = a fixed pool)
        self.on_out_of_blocks: Callable[[int], bool] | None = None
        # Asked instead when a waiting request lacks blocks while others run: it may decline (the request
        # waits a step) rather than stall the running ones until the pool's pages are committed.
        self.on_out_of_blocks_to_admit: Callable[[int], bool] | None = None
        self.num_swap_ins = 0  # resumed by copying their KV back (no recompute)
        self.spec_stats = SpecDecodeStats()  # proposals verified and accepted, since start
        # The draft-model method: (request, proposals it verifies this step) -> lookahead slots for the draft
        # after its step (spec_decode/proposals.py); None: no lookahead.
        self.lookahead: Callable[[Request, int], int] | None = None
        self._with_lookahead: list[str] = []  # requests holding lookahead slots until update_from_output

    # ----------------------------------------------------------------- requests in and out
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use.")
        self.requests[request.request_id] = request
        self._arrival[request.request_id] = self._next_arrival
        self._next_arrival += 1
        self.kv.set_cache_salt(request.request_id, request.cache_salt)
        self._enqueue(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request now (abort, stop string): its blocks are freed at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self._arrival.pop(request_id, None)
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        request.status = status
        self._release(request)
        return request

    def num_swapped(self) -> int:
        return len(self.kv.swapped)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----------------------------------------------------------------- one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_since_step,
                              preempted_ids=self._preempted_since_step)
        self._finished_since_step = []
        self._preempted_since_step = []
        budget = self.config.max_num_batched_tokens
        preempted_now = False
        if self.priority_policy:
            self._preempt_for_waiting(out, budget)

        scheduled_running: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new == 1 and request.spec_token_ids:  # a decode with proposals: verified in this step
                num_new += len(request.spec_token_ids)
            num_new = min(num_new, budget)
            if num_new <= 0:  # nothing to compute (should not happen); leave it
                i += 1
                continue
            spec = num_new - 1 if request.spec_token_ids and request.num_tokens - request.num_computed_tokens == 1 \
                else 0
            ahead = self._lookahead(request, request.num_computed_tokens, num_new, spec)
            while True:
                new_ids = self.kv.allocate_slots(request.request_id, request.all_token_ids,
                                                 request.num_computed_tokens, num_new + ahead)
                if new_ids is not None:
                    break
                if self._grow(self.kv.num_blocks_short(request.request_id, request.num_computed_tokens,
                                                       num_new + ahead)):
                    continue
                victim = self.running.pop()
                self._preempt(victim, out)
                preempted_now = True
                if victim is request:
                    break
            if new_ids is None:
                break
            scheduled_running.append(request)
            if spec:
                out.spec_token_ids[request.request_id] = request.spec_token_ids[:spec]
                request.num_scheduled_spec = spec
            self._note_lookahead(request, ahead, out)
            out.cached_requests.append(
                CachedRequestData(request.request_id, new_ids, request.num_computed_tokens))
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new
            i += 1

        if not preempted_now:
            budget = self._schedule_waiting(out, budget)

        for request_id, num in out.num_scheduled_tokens.items():
            self.requests[request_id].num_computed_tokens += num
        return out

    def _lookahead(self, request: Request, num_computed: int, num_new: int, num_spec: int) -> int:
        """Lookahead slots for the draft after this step: only when the step reaches the request's last
        token (so it samples one), as many as the draft-model policy asks (0 without one)."""
        if self.lookahead is None or num_computed + num_new < request.num_tokens:
            return 0
        return self.lookahead(request, num_spec)

    def _note_lookahead(self, request: Request, ahead: int, out: SchedulerOutput) -> None:
        if ahead:
            out.num_lookahead_tokens[request.request_id] = ahead
            self._with_lookahead.append(request.request_id)

    def _order_key(self, request: Request) -> int | tuple[int, int]:
        arrival = self._arrival[request.request_id]
        return (request.priority, arrival) if self.priority_policy else arrival

    def _add_running(self, request: Request) -> None:
        bisect.insort(self.running, request, key=self._order_key)

    def _enqueue(self, request: Request, preempted: bool = False) -> None:
        """Into the waiting queue: its place by priority, or (fcfs) at the back, or the front when it
        was just preempted (it arrived before everything waiting)."""
        if self.priority_policy:
            bisect.insort(self.waiting, request, key=self._order_key)
        elif preempted:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _preempt_for_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Priority policy: while the first waiting request outranks the last running one (lower value)
        and could not be admitted now (no seat, or too few blocks even after growing the pool), preempt
        that running request; the freed seat and blocks go to the waiting one in this step."""
        while self.running:
            head = next((r for r in self.waiting if r.status != RequestStatus.WAITING_FOR_REMOTE_KVS), None)
            if head is None:
                return
            victim = self.running[-1]
            if victim.priority <= head.priority or self._could_admit(head, budget):
                return
            self.running.pop()
            self._preempt(victim, out, reason=f"to admit request {head.request_id} (priority {head.priority} "
                                              f"over {victim.priority})")

    def _could_admit(self, request: Request, budget: int) -> bool:
        """Whether ``_schedule_waiting`` would find a seat and the blocks for the request's first chunk
        (the same tests, nothing allocated; the elastic pool may grow)."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        token_ids = request.all_token_ids
        if request.request_id in self.kv.swapped:
            computed, hit_blocks = request.num_computed_tokens, []
        else:
            computed = 0
            hit_blocks = ([] if request.sampling_params.needs_every_prompt_position
                          else self.kv.get_computed_blocks(request.request_id, token_ids, count_stats=False))
        num_new = len(token_ids) - computed - len(hit_blocks) * self.kv.block_size
        if self.config.enable_chunked_prefill:
            num_new = min(num_new, budget)
        reserve = len(self.running) if request.num_preemptions else 0
        short = self.kv.num_blocks_short(request.request_id, computed, num_new, hit_blocks, reserve=reserve)
        return short == 0 or self._grow(short)

    def _room_to_resume(self, request: Request, num_computed: int, num_new: int, hit_blocks=()) -> bool:
        """A preempted request resumes only when one free block per running request remains after it
        (growing the pool for that if it can): resumed into a pool with no room, it would be the newest
        request again when the running ones need their next blocks, and be preempted at once."""
        if request.num_preemptions == 0 or not self.running:
            return True
        short = self.kv.num_blocks_short(request.request_id, num_computed, num_new, hit_blocks,
                                         reserve=len(self.running))
        return short == 0 or self._grow(short)

    def _grow(self, num_short: int, admitting: bool = False) -> bool:
        grow = self.on_out_of_blocks
        if admitting and self.running and self.on_out_of_blocks_to_admit is not None:
            grow = self.on_out_of_blocks_to_admit
        return num_short > 0 and grow is not None and grow(num_short)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting requests in queue order while the budget, the seats and the blocks last. A request
        whose blocks a KV tier is still loading is passed over and keeps its place."""
        loading: list[Request] = []
        try:
            return self._admit_waiting(out, budget, loading)
        finally:
            self.waiting.extendleft(reversed(loading))

    def _admit_waiting(self, out: SchedulerOutput, budget: int, loading: list[Request]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                loading.append(self.waiting.popleft())
                continue
            if request.request_id in self.kv.swapped:
                taken = self._swap_in(request, out, budget)
                if taken is None:
                    break
                budget -= taken
                continue
            token_ids = request.all_token_ids
            # Prompt logprobs and MEAN/CLS pooling need every prompt position computed: no cache hits.
            hit_blocks = ([] if request.sampling_params.needs_every_prompt_position
                          else self.kv.get_computed_blocks(request.request_id, token_ids))
            num_hit = len(hit_blocks) * self.kv.block_size
            num_new = len(token_ids) - num_hit
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break  # the whole prompt fits a later step (max_num_batched_tokens >= max_model_len)
                num_new = budget
            ahead = self._lookahead(request, num_hit, num_new, 0)
            if not self._room_to_resume(request, 0, num_new + ahead, hit_blocks):
                break
            new_ids = self.kv.allocate_slots(request.request_id, token_ids, 0, num_new + ahead, hit_blocks)
            if new_ids is None and self._grow(self.kv.num_blocks_short(request.request_id, 0, num_new + ahead,
                                                                        hit_blocks), admitting=True):
                new_ids = self.kv.allocate_slots(request.request_id, token_ids, 0, num_new + ahead, hit_blocks)
            if new_ids is None:
                break
            self._note_lookahead(request, ahead, out)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.num_computed_tokens = num_hit
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit
            self._add_running(request)
            out.new_requests.append(NewRequestData(
                request.request_id, token_ids, request.num_prompt_tokens, request.sampling_params,
                request.sampling_params.seed, request.eos_token_id, new_ids, num_hit, request.structured_output))
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new
        return budget

    def _swap_in(self, request: Request, out: SchedulerOutput, budget: int) -> int | None:
        """Resume a swapped-out request by copying its KV back: it continues from the tokens it had
        computed, with no recompute. Returns the tokens scheduled, or None when it must wait."""
        token_ids = request.all_token_ids
        saved = request.num_computed_tokens
        num_new = len(token_ids) - saved
        if num_new > budget:
            if not self.config.enable_chunked_prefill:
                return None
            num_new = budget
        ahead = self._lookahead(request, saved, num_new, 0)
        if not self._room_to_resume(request, saved, num_new + ahead):
            return None
        result = self.kv.swap_in(request.request_id, token_ids, saved, num_new + ahead)
        if result is None and self._grow(self.kv.num_blocks_short(request.request_id, saved, num_new + ahead)):
            result = self.kv.swap_in(request.request_id, token_ids, saved, num_new + ahead)
        if result is None:
            return None
        self._note_lookahead(request, ahead, out)
        block_ids, pairs = result
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        self._add_running(request)
        self.num_swap_ins += 1
        out.swap_in.extend(pairs)
        out.new_requests.append(NewRequestData(
            request.request_id, token_ids, request.num_prompt_tokens, request.sampling_params,
            request.sampling_params.seed, request.eos_token_id, block_ids, saved, request.structured_output))
        out.num_scheduled_tokens[request.request_id] = num_new
        logger.info("Request %s swapped in: %d blocks copied back, resuming at token %d (no recompute)",
                    request.request_id, len(pairs), saved)
        return num_new

    def _preempt(self, request: Request, out: SchedulerOutput | None, allow_swap: bool = True,
                 reason: str = "KV cache full") -> None:
        mode = "recompute"
        pairs = None
        if allow_swap and self.config.preemption_mode == "swap":
            pairs = self.kv.swap_out(request.request_id)
            mode = "swap" if pairs is not None else "recompute (swap pool full)"
        if pairs is None:
            self.kv.free(request.request_id)
            request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, preempted=True)
        request.spec_token_ids = []
        request.num_scheduled_spec = 0
        if out is not None:
            out.preempted_ids.append(request.request_id)
            out.num_scheduled_tokens.pop(request.request_id, None)
            out.spec_token_ids.pop(request.request_id, None)
            out.num_lookahead_tokens.pop(request.request_id, None)
            if pairs:
                out.swap_out.extend(pairs)
        else:
            self._preempted_since_step.append(request.request_id)
        swap = self.kv.swap
        logger.warning(
            "Request %s preempted (mode=%s): %s, %d/%d blocks free, swap %d/%d blocks free, "
            "%d running, %d waiting.", request.request_id, mode, reason, self.kv.num_free_blocks,
            self.kv.num_blocks, swap.num_free if swap else 0, swap.num_blocks if swap else 0,
            len(self.running), len(self.waiting))

    def preempt_newest(self) -> Request | None:
        """Between steps (memory pressure): recompute-preempt the newest running request (under the
        priority policy, the newest of the lowest priority)."""
        if not self.running:
            return None
        victim = self.running.pop()
        self._preempt(victim, None, allow_swap=False)
        return victim

    # ----------------------------------------------------------------- after the forward pass
    def update_from_output(self, sampled: dict[str, list[int]]) -> list[Request]:
        """Append each request's new tokens in order (one, or its accepted proposals and the model's token
        after them), stopping at the first that ends it; returns the requests that got a token, each with
        ``num_new_tokens`` set. The slots of proposals that were not accepted are handed back: the request's
        computed tokens and block table shrink to what it keeps, and so do those of requests that held lookahead
        slots for the draft this step."""
        updated = []
        for request_id, token_ids in sampled.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            num_spec, request.num_scheduled_spec = request.num_scheduled_spec, 0
            request.spec_token_ids = []
            request.num_new_tokens = 0
            if num_spec:
                self.spec_stats.observe(num_spec, len(token_ids) - 1)
                observe_round(request, num_spec, len(token_ids) - 1)
                rejected = num_spec - (len(token_ids) - 1)
                if rejected:
                    request.num_computed_tokens -= rejected
                    self.kv.trim(request_id, request.num_computed_tokens)
            stopped = False
            if request.max_tokens == 0:  # scored or pooled its prompt only: no token to keep
                request.status = RequestStatus.FINISHED_LENGTH
            else:
                for token_id in token_ids:
                    request.output_token_ids.append(token_id)
                    request.num_new_tokens += 1
                    if request.check_stop_token():
                        stopped = True
                        break
            if request.is_finished or stopped:
                self.running.remove(request)
                del self.requests[request_id]
                self._arrival.pop(request_id, None)
                self._release(request)
            updated.append(request)
        for request_id in self._with_lookahead:
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                self.kv.trim(request_id, request.num_computed_tokens)
        self._with_lookahead = []
        return updated

    def _release(self, request: Request) -> None:
        self.kv.free(request.request_id)
        self.kv.drop_swapped(request.request_id)
        self.kv.drop_cache_salt(request.request_id)
        self._finished_since_step.append(request.request_id)
