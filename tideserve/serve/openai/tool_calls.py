"""Tool calling for chat completions: which tools reach the template, how the output is constrained and
parsed, and how calls come back (``message.tool_calls``, or ``delta.tool_calls`` when streaming).

vLLM's rules: with tools and no ``tool_choice`` the choice is ``"auto"``; ``"auto"`` needs the server to
run with ``--enable-auto-tool-choice --tool-call-parser NAME`` (else a 400 with vLLM's wording), and
the model's own call format is parsed. ``"required"`` and a named function work without those flags:
a grammar forces valid calls (a JSON array of ``{"name", "parameters"}`` objects, or the named
function's arguments), whatever the model would have written. ``"none"`` still shows the tools to the
template and parses nothing.

The forcing grammar closes every object schema that does not say otherwise (``additionalProperties:
false``, as vLLM's default xgrammar backend does in its strict mode): a function cannot take arguments
its schema does not declare, and without this a small model keeps inventing properties (a
``"description": "..."`` after the real arguments) until ``max_tokens`` cuts the call off.
"""

from __future__ import annotations

from dataclasses import dataclass

from tideserve.serve.openai.errors import bad_request
from tideserve.serve.openai.protocol import ChatCompletionRequest, NamedToolChoice
from tideserve.serve.openai.tool_parsers import (
    TOOL_PARSERS,
    NamedToolParser,
    RequiredToolParser,
    ToolCallStreamer,
    ToolParser,
    named_schema,
    required_schema,
)
from tideserve.serve.openai.tool_parsers.base import make_tool_call_id
from tideserve.structured_outputs_params import StructuredOutputsParams

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass
class ToolPlan:
    tools: list[dict] | None  # what the chat template gets as ``tools``
    choice: str  # "none", "auto", "required" or "named"
    parser: ToolParser | None  # None: the output is plain content
    structured_outputs: StructuredOutputsParams | None  # the grammar that forces the calls
    parallel: bool
    keep_special_tokens: bool  # the parser's markers are special tokens: decoding must keep them


def plan_tools(req: ChatCompletionRequest, enable_auto_tool_choice: bool, tool_call_parser: str | None,
               tokenizer, has_constraint: bool) -> ToolPlan:
    """Validate ``tools``/``tool_choice`` (400s name the field) and decide how this request runs."""
    if req.tools is not None and not req.tools:
        raise bad_request("`tools` must not be an empty array. Either provide at least one tool or omit the "
                          "field entirely.", "tools")
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    parallel = req.parallel_tool_calls is not False
    if choice != "none" and not tools:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if not name:
            raise bad_request("Invalid `name` in `function` in `tool_choice`! Correct usage: "
                              '`{"type": "function", "function": {"name": "my_function"}}`',
                              "tool_choice.function.name")
        if all(t["function"]["name"] != name for t in tools):
            raise bad_request("The tool specified in `tool_choice` does not match any of the specified "
                              f"`tools` ({name!r}).", "tool_choice")
    if has_constraint and (choice == "required" or isinstance(choice, NamedToolChoice)):
        raise bad_request("You can only either use constraints for structured outputs or tools, not both.",
                          "tool_choice")
    if choice == "none" or not tools:
        return ToolPlan(tools, "none", None, None, parallel, False)
    if choice == "auto":
        if not (enable_auto_tool_choice and tool_call_parser):
            raise bad_request(AUTO_NEEDS_FLAGS, "tool_choice")
        parser = TOOL_PARSERS[tool_call_parser]()
        return ToolPlan(tools, "auto", parser, None, parallel, markers_are_special(parser, tokenizer))
    if choice == "required":
        schema = required_schema(tools, parallel)
        return ToolPlan(tools, "required", RequiredToolParser(), _forcing(schema), parallel, False)
    schema = named_schema(tools, choice.function.name)
    return ToolPlan(tools, "named", NamedToolParser(choice.function.name), _forcing(schema), parallel, False)


def _forcing(schema: dict) -> StructuredOutputsParams:
    """The grammar that forces calls: the schema with its objects closed (see the module docstring)."""
    return StructuredOutputsParams(json=schema, disable_additional_properties=True)


def markers_are_special(parser, tokenizer) -> bool:
    """Whether any of ``parser.markers`` is a special token (decoding would drop it unless told not to)."""
    special = set(tokenizer.all_special_ids)
    for marker in parser.markers:
        token_id = tokenizer.hf.convert_tokens_to_ids(marker)
        if isinstance(token_id, int) and token_id in special and token_id != tokenizer.hf.unk_token_id:
            return True
    return False


def strip_stop_token_text(plan: ToolPlan, tokenizer, text: str, token_ids: list[int],
                          finish_reason: str | None) -> str:
    """Decoding kept special tokens for the parser, so a finished output ends with its EOS text: drop it."""
    if not plan.keep_special_tokens or finish_reason != "stop" or not token_ids:
        return text
    last = tokenizer.decode([token_ids[-1]], skip_special_tokens=False)
    return text[: -len(last)] if last and text.endswith(last) else text


def message_with_calls(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """The assistant message for a finished output, and its finish_reason ("tool_calls" when it called)."""
    if plan.parser is None:
        return {"role": "assistant", "content": text}, finish_reason
    result = plan.parser.parse(text, final=True)
    calls = result.calls if plan.parallel else result.calls[:1]
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    tool_calls = [{"id": make_tool_call_id(), "type": "function",
                   "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    message = {"role": "assistant", "content": result.content or None, "tool_calls": tool_calls}
    return message, ("tool_calls" if finish_reason == "stop" else finish_reason)


class ToolDeltaStream:
    """One choice's streamed deltas: content and ``tool_calls`` fragments in OpenAI's shape."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.streamer = ToolCallStreamer(plan.parser) if plan.parser is not None else None
        self._text_len = 0

    def delta(self, text: str, finished: bool) -> dict:
        if self.streamer is None:
            new, self._text_len = text[self._text_len:], len(text)
            return {"content": new} if new else {}
        content, calls = self.streamer.update(text, final=finished)
        if not self.plan.parallel:
            calls = [c for c in calls if c["index"] == 0]
        delta: dict = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta

    def finish_reason(self, finish_reason: str | None) -> str | None:
        if self.streamer is not None and self.streamer.num_calls and finish_reason == "stop":
            return "tool_calls"
        return finish_reason
