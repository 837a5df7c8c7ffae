"""A grammar that waits out a reasoning model's thinking section: structured output constrains the answer.

``ReasoningGate`` wraps a request's ``GrammarMatcher`` and follows its output token by token:

- thinking: no mask (the sample is free) and the grammar does not move; the gate watches for the end
  marker's token ids and, once the output ends with them, hands over to the grammar;
- answer: the grammar's own mask and advance, exactly as without a gate;
- undecided (optional thinking, the first token only): the grammar's mask plus the start marker's first
  token, so the model may either open a thinking section or answer at once; the first token decides;
- opening: the start marker spans several tokens and its first one was sampled: the rest is forced,
  so the section opens as the parser will read it.

The gate lives in the engine process beside the matcher it wraps (the model runner reads it to build
the step's masks); its state depends only on the request's output tokens, advanced once per sampled
token, like the matcher's.
"""

from __future__ import annotations

from typing import Any

import torch

from tideserve.structured_output.backend import GrammarMatcher
from tideserve.structured_outputs_params import ReasoningMarkers

THINKING, ANSWER, UNDECIDED, OPENING = "thinking", "answer", "undecided", "opening"


class ReasoningGate:
    """A ``GrammarMatcher`` look-alike that applies the grammar only after the thinking section."""

    def __init__(self, matcher: GrammarMatcher, markers: ReasoningMarkers) -> None:
        self.matcher = matcher
        self.end = markers.end_token_ids
        self.start = markers.start_token_ids
        self.state = UNDECIDED if self.start else THINKING
        self._opened = 0  # start-marker tokens sampled so far (state OPENING)
        self._tail: list[int] = []  # the last output tokens, to find the end marker (state THINKING)

    @property
    def active(self) -> bool:
        """Whether the next sample is masked at all (a thinking token is free)."""
        return self.state != THINKING

    @property
    def handle(self) -> Any:
        """The matcher's native handle while its mask is exactly the grammar's; None when ``fill_bitmask``
        must write this row itself."""
        return self.matcher.handle if self.state == ANSWER else None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.state == OPENING:
            bitmask[row].zero_()
            _allow(bitmask, row, self.start[self._opened])
            return
        self.matcher.fill_bitmask(bitmask, row)
        if self.state == UNDECIDED:
            _allow(bitmask, row, self.start[0])

    def accept_token(self, token_id: int) -> bool:
        if self.state == ANSWER:
            return self.matcher.accept_token(token_id)
        if self.state == UNDECIDED:
            if token_id != self.start[0]:
                self.state = ANSWER  # no thinking section: the grammar applies from the first token
                return self.matcher.accept_token(token_id)
            self.state, self._opened = OPENING, 0
        if self.state == OPENING:
            if token_id != self.start[self._opened]:
                return False  # the mask forced the marker's next token
            self._opened += 1
            if self._opened == len(self.start):
                self.state = THINKING
            return True
        self._tail = (self._tail + [token_id])[-len(self.end):]
        if tuple(self._tail) == self.end:
            self.state = ANSWER
        return True

    def is_accepting(self) -> bool:
        return self.state == ANSWER and self.matcher.is_accepting()

    def is_terminated(self) -> bool:
        return self.state == ANSWER and self.matcher.is_terminated()

    def error(self) -> str:
        return self.matcher.error() if self.state == ANSWER else f"the reasoning gate refused a token ({self.state})"


def _allow(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Set token ``token_id``'s bit in ``bitmask[row]`` (int32 words: bit 31 is the sign bit)."""
    word, bit = divmod(token_id, 32)
    value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


def gated(matcher: GrammarMatcher, markers: ReasoningMarkers | None) -> GrammarMatcher | ReasoningGate:
    """The matcher a request uses: behind a gate when it carries reasoning markers."""
    return matcher if markers is None else ReasoningGate(matcher, markers)
