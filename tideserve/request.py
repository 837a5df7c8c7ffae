"""A request inside the engine, and its state machine.

WAITING -> RUNNING -> FINISHED_*; RUNNING -> PREEMPTED (back in the waiting queue) -> RUNNING.
A waiting (or preempted) request whose prefix a KV tier holds is WAITING_FOR_REMOTE_KVS (vLLM's name) while
those blocks are read back, and returns to its previous state once they are in the pool: the scheduler
passes over it meanwhile, keeping its place in the queue.
``num_computed_tokens`` is the one counter the scheduler drives: prefill, chunked prefill, decode and
recompute after preemption are all "computed tokens catching up with all tokens".
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from tideserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    max_tokens: int  # resolved: never beyond what the context allows
    arrival_time: float = field(default_factory=time.monotonic)
    prompt: str | None = None
    priority: int = 0  # the priority scheduling policy serves lower values first
    cache_salt: str | None = None  # isolates the request's prefix-cache entries (vLLM's cache_salt)
    # Structured output: this request's grammar matcher (structured_output.backend.GrammarMatcher). It
    # advances once per token appended to output_token_ids, so a recompute after preemption, which
    # re-runs tokens already generated, never advances it twice.
    structured_output: Any = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    prefill_counted: bool = False  # its prompt is in the engine's prompt-token counter (once, at prefill's end)
    num_new_tokens: int = 0  # output tokens the last step appended (more than one when proposals were accepted)
    # Speculative decoding (spec_decode/): the proposals for its next step, and how many of them that step
    # verifies (set by the scheduler: the step's budget may take fewer).
    spec_token_ids: list[int] = field(default_factory=list)
    num_scheduled_spec: int = 0
    spec_skip_steps: int = 0  # decode steps left without proposals (the acceptance policy's back-off)
    spec_backoff: int = 1  # the back-off after the next round that accepts nothing

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None

    def check_stop_token(self) -> bool:
        """Mark the request finished if its last token ends it (EOS, stop token, or length)."""
        params = self.sampling_params
        n_out = len(self.output_token_ids)
        last = self.output_token_ids[-1]
        if n_out >= params.min_tokens:
            if not params.ignore_eos and last == self.eos_token_id:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.all_stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if n_out >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
