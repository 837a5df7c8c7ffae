"""What every reasoning parser shares: the split of an output into thinking and answer, and the streamer.

A parser is a pure function of the text generated so far: ``parse(text, final)`` returns the reasoning
(the thinking section, markers removed) and the content (the answer). Without ``final`` the text may
still grow, so anything at its end that could be the start of a marker is held back. Every parser keeps
one invariant: the reasoning and the content of a shorter text are prefixes of those of any text it
grows into. Streaming re-parses the growing text and sends only what is new, so the concatenated
deltas always equal the non-streamed split, however the text was cut into deltas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass
class ReasoningSplit:
    reasoning: str  # the thinking section's text ("" when there is none)
    content: str  # the answer ("" when there is none yet)
    ended: bool = False  # the thinking section is over (or there is none): later text is content


class ReasoningParser:
    """Base class: subclasses implement ``parse``; ``name`` is the --reasoning-parser value."""

    name: ClassVar[str] = ""
    start: ClassVar[str] = THINK_START
    end: ClassVar[str] = THINK_END
    # Whether the thinking section is optional and must then open the output (qwen3), or is always there
    # and may have been opened by the prompt (deepseek_r1). The grammar gate follows the same rule.
    optional: ClassVar[bool] = False

    @property
    def markers(self) -> tuple[str, str]:
        return (self.start, self.end)

    def parse(self, text: str, final: bool) -> ReasoningSplit:
        raise NotImplementedError


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker`` (0 if none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def split_at_end(thinking: str, end: str, final: bool) -> ReasoningSplit:
    """Split text that is inside the thinking section at its first ``end`` marker."""
    index = thinking.find(end)
    if index >= 0:
        return ReasoningSplit(thinking[:index], thinking[index + len(end):], ended=True)
    if final:
        return ReasoningSplit(thinking, "")
    return ReasoningSplit(thinking[:len(thinking) - held_back(thinking, end)], "")


class ReasoningStreamer:
    """Turns re-parses of a growing text into ``reasoning``/``content`` deltas."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._reasoning_sent = 0
        self._content_sent = 0
        self.content = ""  # the content so far (what a tool-call parser reads)

    def update(self, text: str, final: bool = False) -> tuple[str, str]:
        """The new reasoning and the new content since the last call."""
        split = self.parser.parse(text, final)
        reasoning = split.reasoning[self._reasoning_sent:]
        content = split.content[self._content_sent:]
        self._reasoning_sent = max(self._reasoning_sent, len(split.reasoning))
        self._content_sent = max(self._content_sent, len(split.content))
        self.content = split.content
        return reasoning, content
