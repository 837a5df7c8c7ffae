"""Engine-side output handling: incremental detokenization, stop strings, logprobs, n > 1 grouping.

Each child request (one per sample when n > 1) keeps a detokenizer; the parent's RequestOutput carries one
CompletionOutput per child, in index order. With best_of > n, the finished output keeps the n children
with the highest cumulative logprob, best first, re-indexed 0..n-1 (vLLM V0's best_of); until then it
lists every candidate.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from tideserve.outputs import CompletionOutput, Logprob, RequestOutput
from tideserve.request import Request, RequestStatus
from tideserve.tokenizer.detokenizer import IncrementalDetokenizer
from tideserve.tokenizer.tokenizer import Tokenizer
from tideserve.worker.model_runner import PooledPart


@dataclass
class ChildState:
    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finished: bool = False
    # An embedding request's pooling so far: MEAN's running sum and how many positions it holds, or the
    # LAST/CLS state (count 1).
    pooled: torch.Tensor | None = None
    pooled_count: int = 0

    def embedding(self) -> list[float] | None:
        """The finished embedding request's vector (mean taken, unit length when it normalizes)."""
        pooling = self.request.sampling_params.pooling
        if pooling is None or self.pooled is None or self.request.status != RequestStatus.FINISHED_LENGTH:
            return None
        vector = self.pooled / self.pooled_count
        if pooling.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.tolist()

    def completion(self) -> CompletionOutput:
        req = self.request
        return CompletionOutput(
            index=self.index, text=self.detokenizer.text, token_ids=list(req.output_token_ids),
            cumulative_logprob=self.cumulative_logprob, logprobs=self.logprobs,
            finish_reason=req.finish_reason, stop_reason=req.stop_reason)


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[ChildState] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_returned: int | None = None  # best_of > n: how many of the children the finished output keeps
    hide_logprobs: bool = False  # logprobs computed only to rank best_of samples: not returned

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)

    def completions(self) -> list[CompletionOutput]:
        outputs = [c.completion() for c in self.children]
        if self.num_returned is not None and self.num_returned < len(outputs) and self.finished:
            ranked = sorted(outputs, key=_cumulative, reverse=True)[:self.num_returned]
            outputs = [replace(c, index=i) for i, c in enumerate(ranked)]
        if self.hide_logprobs:
            for c in outputs:
                c.logprobs = None
        return outputs

    def output(self) -> RequestOutput:
        first = self.children[0].request
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            outputs=self.completions(), finished=self.finished,
            num_generated_tokens=sum(len(c.request.output_token_ids) for c in self.children),
            prompt_logprobs=self.prompt_logprobs,
            embedding=self.children[0].embedding() if self.finished else None,
            num_cached_tokens=first.num_cached_tokens,
            metrics={"arrival_time": first.arrival_time,
                     "first_scheduled_time": first.first_scheduled_time or 0.0,
                     "first_token_time": first.first_token_time or 0.0})


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, ChildState] = {}
        self._child_parent_id: dict[str, str] = {}

    def add(self, parent_id: str, prompt: str | None, prompt_token_ids: list[int],
            children: list[Request], num_returned: int | None = None, hide_logprobs: bool = False) -> None:
        parent = ParentState(parent_id, prompt, prompt_token_ids, num_returned=num_returned,
                             hide_logprobs=hide_logprobs)
        for index, req in enumerate(children):
            params = req.sampling_params
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=list(params.stop), include_stop_str_in_output=params.include_stop_str_in_output)
            child = ChildState(index, req, detok, [] if params.logprobs is not None else None,
                               0.0 if params.logprobs is not None else None)
            parent.children.append(child)
            self.child_to_parent[req.request_id] = child
            self._child_parent_id[req.request_id] = parent_id
        if children and children[0].sampling_params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]  # the first prompt token has no context to be scored in
        self.parents[parent_id] = parent

    def child_ids(self, parent_id: str) -> list[str]:
        parent = self.parents.get(parent_id)
        return [c.request.request_id for c in parent.children] if parent else []

    def on_prompt_logprobs(self, request_id: str, first: int, entries: list[dict[int, Logprob]]) -> None:
        """Record prompt-token scores; a recompute after preemption re-scores tokens already kept."""
        child = self.child_to_parent.get(request_id)
        parent = self.parents.get(self._child_parent_id.get(request_id, ""))
        if child is None or parent is None or child.index != 0 or parent.prompt_logprobs is None:
            return
        for index, entry in enumerate(entries, start=first):
            if index != len(parent.prompt_logprobs):
                continue
            for token_id, lp in entry.items():
                lp.decoded_token = self.tokenizer.decode([token_id], skip_special_tokens=False)
            parent.prompt_logprobs.append(entry)

    def on_pooled(self, request_id: str, part: PooledPart) -> None:
        """Add a step's pooled positions. Positions come in order; a request recomputed after preemption
        starts again at position 0 (pooling that reads every position never takes a prefix-cache hit), and
        one swapped back in continues where its sum stopped."""
        child = self.child_to_parent.get(request_id)
        if child is None:
            return
        if child.request.sampling_params.pooling.pooling_type != "MEAN":
            child.pooled, child.pooled_count = part.vector, 1
            return
        if part.first == 0:
            child.pooled, child.pooled_count = part.vector.clone(), part.count
        elif part.first == child.pooled_count and child.pooled is not None:
            child.pooled += part.vector
            child.pooled_count += part.count

    def on_token(self, request: Request, token_id: int, logprobs: dict[int, Logprob] | None) -> str | None:
        """Feed one new token; returns the stop string it completed, if any."""
        child = self.child_to_parent[request.request_id]
        if child.logprobs is not None and logprobs is not None:
            child.logprobs.append(logprobs)
            if token_id in logprobs:
                child.cumulative_logprob += logprobs[token_id].logprob
        return child.detokenizer.append([token_id])

    def on_finished(self, request: Request) -> None:
        child = self.child_to_parent.get(request.request_id)
        if child is not None and not child.finished:
            child.finished = True
            child.detokenizer.finish()

    def pop_if_finished(self, parent_id: str) -> None:
        parent = self.parents.get(parent_id)
        if parent and parent.finished:
            del self.parents[parent_id]
            for c in parent.children:
                self.child_to_parent.pop(c.request.request_id, None)
                self._child_parent_id.pop(c.request.request_id, None)

    def parent_of(self, request_id: str) -> str | None:
        return self._child_parent_id.get(request_id)


def _cumulative(c: CompletionOutput) -> float:
    return c.cumulative_logprob if c.cumulative_logprob is not None else float("-inf")


def finish_status(stop_string: str | None) -> RequestStatus:
    return RequestStatus.FINISHED_STOPPED if stop_string is not None else RequestStatus.FINISHED_LENGTH
