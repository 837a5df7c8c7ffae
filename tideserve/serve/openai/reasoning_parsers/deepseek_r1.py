"""``deepseek_r1``: DeepSeek-R1 (and QwQ) always think, and their chat templates may already open
``<think>`` in the prompt. So everything before ``</think>`` is reasoning, whether or not the output
itself starts with ``<think>`` (a leading one is dropped); when no ``</think>`` comes (max_tokens cut the
thinking short), the whole output is reasoning and there is no content, as in vLLM."""

from __future__ import annotations

from tideserve.serve.openai.reasoning_parsers.base import ReasoningParser, ReasoningSplit, split_at_end


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    optional = False

    def parse(self, text: str, final: bool) -> ReasoningSplit:
        if text.startswith(self.start):
            text = text[len(self.start):]
        elif not final and self.start.startswith(text):
            return ReasoningSplit("", "")  # may still become a leading <think>, which is dropped
        return split_at_end(text, self.end, final)
