"""What every tool-call parser shares: the parse result, a tolerant JSON reader, and the streamer.

A parser is a pure function of the text generated so far: ``parse(text, final)`` returns the content
outside the calls and the calls, where a call still being written has its name (once complete) and the
raw text of its arguments so far. Streaming re-parses the growing text and sends only what is new, so a
streamed response carries exactly what the non-streamed one would: the arguments streamed are prefixes
of the final raw arguments text, and content never includes the start of a marker that may still grow
into a call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import ClassVar

_WS = " \t\r\n"


@dataclass
class ParsedToolCall:
    name: str | None  # None until the name string is complete
    arguments: str  # raw JSON text of the arguments (a prefix of it while the call is being written)
    done: bool = False


@dataclass
class ParseResult:
    content: str
    calls: list[ParsedToolCall] = field(default_factory=list)


class ToolParser:
    """Base class: subclasses implement ``parse``; ``name`` is the --tool-call-parser value."""

    name: ClassVar[str] = ""
    # Marker tokens that a tokenizer may hold as special tokens: decoding must keep them.
    markers: ClassVar[tuple[str, ...]] = ()

    def parse(self, text: str, final: bool) -> ParseResult:
        """Content and calls in ``text``. With ``final`` the text is complete: only calls that are whole
        and whose arguments are valid JSON count, anything else is content; without it, the call being
        written is included as it stands, and a possible marker start at the end is held back."""
        raise NotImplementedError


def make_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------------- reading JSON that may be cut off
def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def scan_value(text: str, pos: int) -> int | None:
    """End index of the JSON value starting at ``pos`` (whitespace already skipped), or None when the
    text ends first. Only brackets, strings and scalars are tracked, not validity."""
    if pos >= len(text):
        return None
    ch = text[pos]
    if ch == '"':
        return scan_string(text, pos)
    if ch in "{[":
        depth, i, n = 0, pos, len(text)
        while i < n:
            c = text[i]
            if c == '"':
                end = scan_string(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    i = pos
    while i < len(text) and text[i] not in ",}] \t\r\n":
        i += 1
    return i if i < len(text) else None  # a scalar at the very end may still grow


def scan_string(text: str, pos: int) -> int | None:
    """End index (after the closing quote) of the JSON string starting at ``pos``, or None."""
    i, n = pos + 1, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


@dataclass
class CallObject:
    """A ``{"name": ..., "<arguments key>": {...}}`` object read from text that may be cut off."""

    name: str | None = None
    arguments: str | None = None  # raw text; partial until arguments_done
    arguments_done: bool = False
    end: int | None = None  # index after the closing brace, once complete


def read_call_object(text: str, pos: int, argument_keys: tuple[str, ...]) -> CallObject:
    """Read the call object starting at ``text[pos] == '{'``; tolerant of the text ending anywhere."""
    call = CallObject()
    i = pos + 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return call
        if text[i] == "}":
            call.end = i + 1
            return call
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            return call  # not a call object after all: its end stays unknown
        key_end = scan_string(text, i)
        if key_end is None:
            return call
        key = _loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text) or text[i] != ":":
            return call
        i = skip_ws(text, i + 1)
        value_end = scan_value(text, i)
        if key == "name":
            if value_end is None:
                return call
            name = _loads(text[i:value_end])
            call.name = name if isinstance(name, str) else None
        elif key in argument_keys:
            call.arguments = text[i:value_end if value_end is not None else len(text)]
            call.arguments_done = value_end is not None
            if value_end is None:
                return call
        elif value_end is None:
            return call
        i = value_end


def _loads(raw: str):
    try:
        return json.loads(raw)
    except ValueError:
        return None


def is_json(raw: str | None) -> bool:
    if raw is None:
        return False
    try:
        json.loads(raw)
    except ValueError:
        return False
    return True


def complete_call(call: CallObject) -> ParsedToolCall | None:
    """A finished call object as a ParsedToolCall (no arguments: ``{}``), or None when it is not valid."""
    if call.end is None or call.name is None:
        return None
    arguments = call.arguments if call.arguments is not None else "{}"
    if not is_json(arguments):
        return None
    return ParsedToolCall(call.name, arguments, done=True)


def partial_call(call: CallObject) -> ParsedToolCall:
    return ParsedToolCall(call.name, call.arguments or "", done=call.end is not None)


def read_json_call_array(text: str, pos: int, argument_keys: tuple[str, ...],
                         final: bool) -> tuple[list[ParsedToolCall], bool]:
    """Calls in the JSON array ``[{call}, {call}, ...]`` starting at ``text[pos] == '['``.

    Returns the calls (with the one being written, unless ``final``) and whether the array is complete,
    every element a valid call and nothing but whitespace follows it.
    """
    calls: list[ParsedToolCall] = []
    i = pos + 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return calls, False
        if text[i] == "]":
            return calls, bool(calls) and skip_ws(text, i + 1) >= len(text)
        if text[i] == ",":
            i += 1
            continue
        if text[i] != "{":
            return calls, False
        call = read_call_object(text, i, argument_keys)
        complete = complete_call(call)
        if complete is None:
            if not final:
                calls.append(partial_call(call))
            return calls, False
        calls.append(complete)
        i = call.end


def join_content(parts: list[str]) -> str:
    """Text outside the calls, from ``parts``: the text before each call, then the text after the last.
    Whitespace that only separated text from a call goes (so the content only ever grows at its end)."""
    if len(parts) == 1:
        return parts[0]
    kept = [parts[0].rstrip()] + [p.strip() for p in parts[1:-1]] + [parts[-1].lstrip()]
    return "".join(kept)


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker`` (0 if none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


# ---------------------------------------------------------------------- streaming
class ToolCallStreamer:
    """Turns re-parses of a growing text into OpenAI-shaped deltas (content and ``tool_calls``).

    The first delta of a call carries its index, id, type and name with empty arguments; later ones carry
    argument fragments. A call is announced only once its name is complete.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._content_sent = 0
        self._ids: list[str] = []
        self._args_sent: list[int] = []

    @property
    def ids(self) -> list[str]:
        """The ids given to the calls announced so far (the final message reuses them)."""
        return list(self._ids)

    @property
    def num_calls(self) -> int:
        return len(self._ids)

    def update(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        result = self.parser.parse(text, final=final)
        # Trailing whitespace waits: it is dropped if a call follows it.
        content = result.content if final else result.content.rstrip()
        content_delta = content[self._content_sent:]
        self._content_sent = max(self._content_sent, len(content))
        deltas: list[dict] = []
        for index, call in enumerate(result.calls):
            if call.name is None:
                break  # calls are announced in order
            if index >= len(self._ids):
                self._ids.append(make_tool_call_id())
                self._args_sent.append(0)
                deltas.append({"index": index, "id": self._ids[index], "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            fragment = call.arguments[self._args_sent[index]:]
            if fragment:
                self._args_sent[index] = len(call.arguments)
                deltas.append({"index": index, "function": {"arguments": fragment}})
        return content_delta, deltas
