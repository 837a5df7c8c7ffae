"""Calls that the grammar forced: ``tool_choice="required"`` or a named function (as vLLM does them).

``required``: the output is a JSON array of ``{"name": ..., "parameters": {...}}`` objects, one of the
request's tools each (``required_schema``); a named function: the output is that function's arguments
(its ``parameters`` schema). Both work without ``--enable-auto-tool-choice``: the grammar, not the model's
own tool format, decides the shape.
"""

from __future__ import annotations

from typing import Any

from tideserve.serve.openai.tool_parsers.base import (
    ParsedToolCall,
    ParseResult,
    ToolParser,
    is_json,
    read_json_call_array,
    skip_ws,
)

_ANY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


def required_schema(tools: list[dict], parallel_tool_calls: bool = True) -> dict:
    """A JSON schema for "one or more calls of these tools" (at most one without parallel calls)."""
    options = []
    for tool in tools:
        function = tool["function"]
        options.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [function["name"]]},
                           "parameters": function.get("parameters") or _ANY_OBJECT},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": options[0] if len(options) == 1 else {"anyOf": options}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def named_schema(tools: list[dict], name: str) -> dict:
    """The arguments schema of the named tool (any object when it declares none)."""
    for tool in tools:
        if tool["function"]["name"] == name:
            return tool["function"].get("parameters") or _ANY_OBJECT
    raise ValueError(f"tool_choice names the function {name!r}, which is not one of the request's tools.")


class RequiredToolParser(ToolParser):
    name = "required"

    def parse(self, text: str, final: bool) -> ParseResult:
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return ParseResult(text if final else "")
        calls, ok = read_json_call_array(text, i, ("parameters",), final)
        if final and not ok:
            return ParseResult(text)  # cut off (max_tokens, a stop string): no call, the text stays
        return ParseResult("", calls)


class NamedToolParser(ToolParser):
    name = "named"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParseResult:
        if final:
            if not is_json(text):
                return ParseResult(text)
            return ParseResult("", [ParsedToolCall(self.function_name, text.strip(), done=True)])
        return ParseResult("", [ParsedToolCall(self.function_name, text.lstrip())])
