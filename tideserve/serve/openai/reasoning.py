"""Reasoning output for chat completions: the thinking section comes back apart from the answer.

With ``--reasoning-parser NAME`` a choice's text is split by the parser (reasoning_parsers/): the thinking
section is ``message.reasoning_content`` (streamed: ``delta.reasoning_content``) and the rest is
``content``, which is all that tool-call parsing reads. Both names are sent: ``reasoning_content`` was
vLLM's field until vLLM 0.11 renamed it ``reasoning``, so clients written for either find it.
``include_reasoning: false`` drops it from the response (the split still happens: the content never
carries the thinking).

Structured output constrains only the answer: the request carries the markers' token ids
(``SamplingParams.reasoning_markers``) and the engine's grammar starts after the end marker
(tideserve/structured_output/reasoning_gate.py), following the same rule as the parser.
"""

from __future__ import annotations

from tideserve.serve.openai.reasoning_parsers import REASONING_PARSERS, ReasoningParser, ReasoningStreamer
from tideserve.serve.openai.tool_calls import ToolDeltaStream
from tideserve.structured_outputs_params import ReasoningMarkers

FIELDS = ("reasoning_content", "reasoning")


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    return REASONING_PARSERS[name]() if name else None


def reasoning_markers(parser: ReasoningParser, tokenizer) -> ReasoningMarkers:
    """The parser's markers as the tokenizer spells them (one id each where it has them as tokens)."""
    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))
    return ReasoningMarkers(ids(parser.end), ids(parser.start) if parser.optional else ())


def split_reasoning(parser: ReasoningParser | None, text: str) -> tuple[str | None, str]:
    """A finished choice's (reasoning or None, content)."""
    if parser is None:
        return None, text
    split = parser.parse(text, final=True)
    return split.reasoning or None, split.content


def with_reasoning(message: dict, reasoning: str | None, include: bool) -> dict:
    """``message`` with the reasoning fields after its role (vLLM's order), and an empty content as None."""
    out = {"role": message["role"]}
    if include:
        out.update(dict.fromkeys(FIELDS, reasoning))
    out.update(message)
    if out.get("content") == "":
        out["content"] = None
    return out


class ReasoningDeltaStream:
    """One choice's streamed deltas: reasoning, then content and tool calls read from the content only."""

    def __init__(self, parser: ReasoningParser | None, tools: ToolDeltaStream, include: bool) -> None:
        self.streamer = ReasoningStreamer(parser) if parser is not None else None
        self.tools = tools
        self.include = include

    def delta(self, text: str, finished: bool) -> dict:
        if self.streamer is None:
            return self.tools.delta(text, finished)
        reasoning, _ = self.streamer.update(text, final=finished)
        delta = self.tools.delta(self.streamer.content, finished)
        if reasoning and self.include:
            delta = {**dict.fromkeys(FIELDS, reasoning), **delta}
        return delta

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return self.tools.finish_reason(finish_reason)
