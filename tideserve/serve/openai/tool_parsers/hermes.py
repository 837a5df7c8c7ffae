"""``hermes``: Hermes 2 Pro and Qwen2.5 write each call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text around the calls is content."""

from __future__ import annotations

from tideserve.serve.openai.tool_parsers.base import (
    CallObject,
    ParseResult,
    ToolParser,
    complete_call,
    held_back,
    join_content,
    partial_call,
    read_call_object,
    skip_ws,
)


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    markers = (START, END)

    def parse(self, text: str, final: bool) -> ParseResult:
        parts: list[str] = []  # the text before each call
        pending = ""  # text since the last call
        calls = []
        pos = 0
        while True:
            start = text.find(self.START, pos)
            if start < 0:
                tail = text[pos:]
                pending += tail if final else tail[:len(tail) - held_back(tail, self.START)]
                break
            end = text.find(self.END, start + len(self.START))
            body_end = len(text) if end < 0 else end
            brace = skip_ws(text, start + len(self.START))
            call = (read_call_object(text[:body_end], brace, ("arguments", "parameters"))
                    if brace < body_end and text[brace] == "{" else CallObject())
            complete = complete_call(call)
            seg_end = len(text) if end < 0 else end + len(self.END)
            if complete is None and final:
                pending += text[pos:seg_end]  # not a valid call: it stays text
            else:
                parts.append(pending + text[pos:start])
                pending = ""
                calls.append(complete if complete is not None else partial_call(call))
            if end < 0:
                break
            pos = seg_end
        parts.append(pending)
        return ParseResult(join_content(parts), calls)
