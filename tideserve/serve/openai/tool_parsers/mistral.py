"""``mistral``: Mistral's instruct models write ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``
(tokenizer v3), or ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11 and later). Text before the first
``[TOOL_CALLS]`` is content.
"""

from __future__ import annotations

from tideserve.serve.openai.tool_parsers.base import (
    ParsedToolCall,
    ParseResult,
    ToolParser,
    held_back,
    is_json,
    read_json_call_array,
    scan_value,
    skip_ws,
)


class MistralToolParser(ToolParser):
    name = "mistral"
    START = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    markers = (START, ARGS)

    def parse(self, text: str, final: bool) -> ParseResult:
        start = text.find(self.START)
        if start < 0:
            return ParseResult(text if final else text[:len(text) - held_back(text, self.START)])
        content = text[:start].rstrip()
        i = skip_ws(text, start + len(self.START))
        if i >= len(text):
            return ParseResult(text if final else content)
        if text[i] == "[":
            calls, ok = read_json_call_array(text, i, ("arguments", "parameters"), final)
        else:
            calls, ok = self._name_args_calls(text, start, final)
        if final and not ok:
            return ParseResult(text)
        return ParseResult(content, calls)

    def _name_args_calls(self, text: str, pos: int, final: bool) -> tuple[list[ParsedToolCall], bool]:
        """``[TOOL_CALLS]name[ARGS]{...}`` repeated; returns the calls and whether all were whole."""
        calls: list[ParsedToolCall] = []
        while text.startswith(self.START, pos):
            name_start = pos + len(self.START)
            args_at = text.find(self.ARGS, name_start)
            if args_at < 0:
                return calls, False
            name = text[name_start:args_at].strip()
            value_start = skip_ws(text, args_at + len(self.ARGS))
            end = scan_value(text, value_start)
            raw = text[value_start:end if end is not None else len(text)]
            if end is None or not is_json(raw):
                if not final:
                    calls.append(ParsedToolCall(name or None, raw))
                return calls, False
            calls.append(ParsedToolCall(name, raw, done=True))
            pos = skip_ws(text, end)
        return calls, skip_ws(text, pos) >= len(text)
