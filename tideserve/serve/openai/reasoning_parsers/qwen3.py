"""``qwen3``: Qwen3 thinks only when thinking is on (``chat_template_kwargs: {"enable_thinking":
false}`` turns it off), and then opens its output with ``<think>``. So an output that starts with
``<think>`` is reasoning up to ``</think>`` and content after it; any other output is all content.

One difference from vLLM: a thinking section that ``max_tokens`` cuts off before ``</think>`` stays
reasoning (vLLM's non-streamed answer turns it into content). A stream has already sent that text as
reasoning and cannot take it back, and here a streamed answer always equals the non-streamed one.
"""

from __future__ import annotations

from tideserve.serve.openai.reasoning_parsers.base import ReasoningParser, ReasoningSplit, split_at_end


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    optional = True

    def parse(self, text: str, final: bool) -> ReasoningSplit:
        if text.startswith(self.start):
            return split_at_end(text[len(self.start):], self.end, final)
        if not final and self.start.startswith(text):
            return ReasoningSplit("", "")  # may still open a thinking section
        return ReasoningSplit("", text, ended=True)
