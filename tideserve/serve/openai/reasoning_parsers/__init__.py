"""Reasoning parsers, chosen with ``--reasoning-parser NAME`` as in vLLM (``deepseek_r1``, ``qwen3``):
they split a reasoning model's output into its thinking section (``reasoning_content``) and its answer
(``content``)."""

from tideserve.serve.openai.reasoning_parsers.base import (
    ReasoningParser,
    ReasoningSplit,
    ReasoningStreamer,
)
from tideserve.serve.openai.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from tideserve.serve.openai.reasoning_parsers.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}

__all__ = ["REASONING_PARSERS", "DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "ReasoningParser",
           "ReasoningSplit", "ReasoningStreamer"]
