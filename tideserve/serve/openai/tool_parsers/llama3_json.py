"""``llama3_json``: Llama 3.1/3.2 answer a call with bare JSON, ``{"name": ..., "parameters": {...}}``, optionally
after ``<|python_tag|>``, several calls separated by ``;``. Output that does not start with ``{`` is content.
"""

from __future__ import annotations

from tideserve.serve.openai.tool_parsers.base import (
    ParseResult,
    ToolParser,
    complete_call,
    partial_call,
    read_call_object,
    skip_ws,
)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"
    markers = (PYTHON_TAG,)

    def parse(self, text: str, final: bool) -> ParseResult:
        i = skip_ws(text, 0)
        if text.startswith(self.PYTHON_TAG, i):
            i = skip_ws(text, i + len(self.PYTHON_TAG))
        elif not final and self.PYTHON_TAG.startswith(text[i:]):
            return ParseResult("")  # empty so far, or the tag being written
        if i >= len(text):
            return ParseResult(text if final else "")
        if text[i] != "{":
            return ParseResult(text)
        calls = []
        while True:
            call = read_call_object(text, i, ("parameters", "arguments"))
            complete = complete_call(call)
            if complete is None:
                if final:
                    return ParseResult(text)  # not (only) calls: all of it is content
                calls.append(partial_call(call))
                return ParseResult("", calls)
            calls.append(complete)
            i = skip_ws(text, call.end)
            if i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
            if i >= len(text):
                return ParseResult("", calls)
            if text[i] != "{":
                return ParseResult(text) if final else ParseResult("", calls)
