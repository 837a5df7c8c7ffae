"""Tools and tool calls on their way into a chat template.

OpenAI clients send a tool call's ``arguments`` as a JSON string; templates written for transformers
(Qwen2.5, Llama 3.1, Mistral, Hermes) expect a dict and render it with ``tojson``, so the string is
parsed here, as vLLM does. A template that never mentions ``tool_calls`` (SmolLM2's, for one) would drop
an assistant turn's calls and leave the model a history with a question, no call and then a tool's
answer; for such templates the calls are written into that turn's content as JSON instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

_MENTIONS = {name: re.compile(rf"\b{name}\b") for name in ("tools", "tool_calls")}


def template_mentions(template: str | None, name: str) -> bool:
    """Whether a chat template's source refers to ``tools`` or ``tool_calls``."""
    return bool(template) and bool(_MENTIONS[name].search(template))


def check_tools(tools: Any) -> list[dict]:
    """OpenAI ``tools``: a list of ``{"type": "function", "function": {"name": ..., ...}}``."""
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)) or not tools:
        raise ValueError("tools must be a non-empty list of {'type': 'function', 'function': {...}} objects.")
    checked = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                             f"'parameters': {{...}}}}}}; got {tool!r:.100}.")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string, got {name!r}.")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object, got "
                             f"{type(parameters).__name__}.")
        checked.append({"type": "function", "function": function})
    return checked


def prepare_tool_messages(messages: list[dict], template: str | None) -> list[dict]:
    """Parse tool-call arguments into dicts; inline the calls as content where the template ignores them.

    ``messages`` are already normalized (tideserve.tokenizer.tokenizer.normalize_messages).
    """
    inline = not template_mentions(template, "tool_calls")
    prepared = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if message.get("role") != "assistant" or not calls:
            prepared.append(message)
            continue
        if not isinstance(calls, list):
            raise ValueError(f"messages[{i}].tool_calls must be a list, got {type(calls).__name__}.")
        parsed_calls = [_parse_call(call, i, j) for j, call in enumerate(calls)]
        message = {**message, "tool_calls": parsed_calls}
        if inline:
            rendered = json.dumps([{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                   for c in parsed_calls], ensure_ascii=False)
            message["content"] = f"{message['content']}\n{rendered}" if message.get("content") else rendered
        prepared.append(message)
    return prepared


def _parse_call(call: Any, i: int, j: int) -> dict:
    where = f"messages[{i}].tool_calls[{j}]"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                         f"'arguments': ...}}}}; got {call!r:.100}.")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            raise ValueError(f"{where}.function.arguments is not valid JSON: {exc}.") from None
    return {**call, "function": {**function, "arguments": arguments}}
