"""``POST /v1/responses``: OpenAI's Responses API, one turn at a time, over the chat pipeline.

Why over chat: a Responses request is a chat request in another shape (``instructions`` is the system
message, input items are messages, ``max_output_tokens`` is ``max_completion_tokens``, ``text.format`` is
``response_format``, function tools are flat). Translating it keeps one implementation of templating,
context checks, structured output, tool calling and streaming, so the two endpoints cannot drift; the
reply is the chat completion's, re-shaped into output items (a ``message`` with ``output_text``, and a
``function_call`` item per call). The OpenAI SDK's ``client.responses.create`` and the agents built on it
work unchanged. Nothing is stored: ``previous_response_id``, ``conversation`` and ``background`` are
refused with the reason, and the client sends earlier turns (including ``function_call`` and
``function_call_output`` items) in ``input``, as it would with ``store: false``.

Streaming re-shapes the chat stream into the Responses events (each SSE frame has ``event:`` and a
``data:`` with ``type`` and ``sequence_number``): response.created, response.in_progress, then per output
item output_item.added, content_part.added and output_text.delta ... done (or
function_call_arguments.delta ... done), output_item.done, and response.completed, or
response.incomplete when ``max_output_tokens`` cut the reply.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tideserve.serve.openai.errors import OpenAIError, bad_request, from_exception, validation_message
from tideserve.serve.openai.fields import RESPONSES_FIELDS, refuse_unsupported
from tideserve.serve.openai.protocol import ChatCompletionRequest, ResponsesRequest, ResponsesTool
from tideserve.serve.openai.responses_output import message_items, response_events, response_object, responses_usage
from tideserve.serve.openai.serving import RequestInfo, ServerState, resolve_request_id
from tideserve.serve.openai.serving_chat import create_chat_completion

# Chat fields an error may name, as the Responses request calls them.
_PARAM_NAMES = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                "messages": "input", "response_format": "text.format"}
_MESSAGE_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one ``include`` value there is something to include for


async def create_response(state: ServerState, req: ResponsesRequest, raw: Request,
                          info: RequestInfo) -> Response:
    state.check_model(req.model)
    if req.ignored_fields():
        state.log_ignored(req.ignored_fields())
    refuse_unsupported(req, RESPONSES_FIELDS)
    request_id = resolve_request_id(raw, info, req)
    chat = _chat_request(req, request_id)
    created = int(time.time())
    if req.stream:
        inner = await _in_responses_terms(create_chat_completion(state, chat, raw, info))
        return StreamingResponse(response_events(state, req, inner, request_id, created),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    reply = await _in_responses_terms(create_chat_completion(state, chat, raw, info))
    if not isinstance(reply, JSONResponse):  # not expected (the chat path answers JSON or raises): pass it on
        return reply
    completion = json.loads(bytes(reply.body))
    choice = completion["choices"][0]
    logprobs = (choice.get("logprobs") or {}).get("content")
    items = message_items(choice["message"], request_id, logprobs)
    body = response_object(state, req, request_id, created, items, choice["finish_reason"],
                           responses_usage(completion["usage"]))
    return JSONResponse(body)


# ---------------------------------------------------------------------- request: Responses -> chat
def _chat_request(req: ResponsesRequest, request_id: str) -> ChatCompletionRequest:
    """The chat request this Responses request means (every check after this is the chat endpoint's)."""
    body: dict[str, Any] = {"messages": _messages(req), "stream": req.stream, "request_id": request_id}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    for name in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "stop", "priority",
                 "cache_salt", "parallel_tool_calls"):
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    if req.ignore_eos:
        body["ignore_eos"] = True
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    unsupported = [value for value in req.include or () if value != LOGPROBS_INCLUDE]
    if unsupported:
        raise bad_request(f"include value {unsupported[0]!r} is not supported: the only extra output here is "
                          f"{LOGPROBS_INCLUDE!r} (there are no hosted tools, reasoning items or images).", "include")
    if LOGPROBS_INCLUDE in (req.include or ()) or req.top_logprobs:
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    if req.tools:  # OpenAI takes an empty list as no tools (the Agents SDK sends one); chat refuses it
        body["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                       "function": {"name": choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        body["response_format"] = {"type": fmt.type}
        if fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise bad_request("text.format.schema is required when text.format.type is json_schema.",
                                  "text.format.schema")
            body["response_format"]["json_schema"] = {"name": fmt.name or "response", "schema": fmt.json_schema,
                                                      "strict": fmt.strict}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # a value the Responses model let through but chat's does not
        message, param = validation_message(list(exc.errors()))
        raise bad_request(message, _PARAM_NAMES.get(param or "", param)) from exc


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """instructions + input as chat messages; consecutive function_call items become one assistant turn."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages
    if not req.input:
        raise bad_request("input must be a non-empty string or a non-empty list of input items.", "input")
    for i, item in enumerate(req.input):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}] must be an object (a message or a function_call / "
                              f"function_call_output item), got {type(item).__name__}.", "input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, i))
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = "\n".join(_part_text(part, i, j) for j, part in enumerate(output))
            if not isinstance(output, str):
                raise bad_request(f"input[{i}].output must be a string, got {type(output).__name__}.", "input")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i), "content": output})
        else:
            raise bad_request(f"input[{i}].type {kind!r} is not supported: input items are messages, "
                              "function_call and function_call_output (nothing is stored, and there are no "
                              "hosted tools or reasoning items).", "input")
    return messages


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in _MESSAGE_ROLES:
        raise bad_request(f"input[{i}].role must be one of {', '.join(_MESSAGE_ROLES)}; got {role!r}.", "input")
    content = item.get("content")
    if isinstance(content, list):
        content = "\n".join(_part_text(part, i, j) for j, part in enumerate(content))
    if not isinstance(content, str):
        raise bad_request(f"input[{i}].content must be a string or a list of input_text parts; got "
                          f"{type(content).__name__}.", "input")
    return {"role": _MESSAGE_ROLES[role], "content": content}


def _part_text(part: Any, i: int, j: int) -> str:
    if isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise bad_request(f"input[{i}].content[{j}] must be {{'type': 'input_text', 'text': str}}; got {kind!r} "
                      "(only text content is supported).", "input")


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"input[{i}].{key} is required (a string) in a {item.get('type')} item.", "input")
    return value


def _chat_tool(tool: ResponsesTool, i: int) -> dict[str, Any]:
    if tool.type != "function":
        raise bad_request(f"tools[{i}].type {tool.type!r} is not supported: only function tools are (no hosted "
                          "tools).", "tools")
    if not tool.name:
        raise bad_request(f"tools[{i}].name is required for a function tool.", "tools")
    function = {"name": tool.name}
    for key in ("description", "parameters", "strict"):
        value = getattr(tool, key)
        if value is not None:
            function[key] = value
    return {"type": "function", "function": function}


async def _in_responses_terms(work) -> Response:
    """The chat pipeline's result, its errors renamed to the Responses request's fields."""
    try:
        return await work
    except OpenAIError as exc:
        raise _renamed(exc) from exc
    except ValueError as exc:  # SamplingParams: "temperature must be ..." names a field both share
        raise _renamed(from_exception(exc)) from exc


def _renamed(exc: OpenAIError) -> OpenAIError:
    message = exc.message
    for chat_name, name in _PARAM_NAMES.items():
        if chat_name != "messages":
            message = message.replace(chat_name, name)
    message = message.replace("in the messages", "in the input").replace("of the messages", "of the input")
    message = message.replace("in the completion", "in the output").replace("of the completion", "of the output")
    return OpenAIError(exc.status, message, _PARAM_NAMES.get(exc.param or "", exc.param), exc.headers,
                       exc.err_type)


def response_not_stored(response_id: str) -> OpenAIError:
    return OpenAIError(404, f"Response {response_id!r} was not found: this server stores no responses "
                            "(send earlier turns in input instead of previous_response_id).", "response_id")
