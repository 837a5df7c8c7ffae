"""Tool-call parsers, chosen with ``--tool-call-parser NAME`` as in vLLM (``hermes``, ``llama3_json``,
``mistral``), plus the two that read grammar-forced calls (``tool_choice`` required or named)."""

from tideserve.serve.openai.tool_parsers.base import ParsedToolCall, ParseResult, ToolCallStreamer, ToolParser
from tideserve.serve.openai.tool_parsers.forced import (
    NamedToolParser,
    RequiredToolParser,
    named_schema,
    required_schema,
)
from tideserve.serve.openai.tool_parsers.hermes import HermesToolParser
from tideserve.serve.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from tideserve.serve.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}

__all__ = ["TOOL_PARSERS", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser", "NamedToolParser",
           "ParseResult", "ParsedToolCall", "RequiredToolParser", "ToolCallStreamer", "ToolParser",
           "named_schema", "required_schema"]
