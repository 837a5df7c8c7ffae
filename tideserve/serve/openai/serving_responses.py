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
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tideserve.serve.openai.errors import OpenAIError, bad_request, from_exception, validation_message
from tideserve.serve.openai.fields import RESPONSES_FIELDS, refuse_unsupported
from tideserve.serve.openai.protocol import ChatCompletionRequest, ResponsesRequest, ResponsesTool
from tideserve.serve.openai.serving import RequestInfo, ServerState, resolve_request_id
from tideserve.serve.openai.serving_chat import create_chat_completion

# Chat fields an error may name, as the Responses request calls them.
_PARAM_NAMES = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                "messages": "input", "response_format": "text.format"}
_MESSAGE_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")


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
        return StreamingResponse(_events(state, req, inner, request_id, created, info),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    reply = await _in_responses_terms(create_chat_completion(state, chat, raw, info))
    if not isinstance(reply, JSONResponse):  # a disconnect: pass its status through
        return reply
    completion = json.loads(bytes(reply.body))
    choice = completion["choices"][0]
    items = _message_items(choice["message"], request_id)
    body = _response(state, req, request_id, created, items, choice["finish_reason"],
                     _usage(completion["usage"]))
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
    if req.tools is not None:
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


# ---------------------------------------------------------------------- reply: chat -> Responses
def _message_items(message: dict[str, Any], request_id: str) -> list[dict[str, Any]]:
    items = []
    text = message.get("content") or ""
    calls = message.get("tool_calls") or []
    if text or not calls:
        items.append(_message_item(request_id, text, "completed"))
    for n, call in enumerate(calls):
        items.append(_call_item(request_id, n, call["id"], call["function"]["name"],
                                call["function"]["arguments"], "completed"))
    return items


def _message_item(request_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": f"msg_{request_id}", "status": status, "role": "assistant",
            "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(request_id: str, n: int, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{request_id}_{n}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _usage(chat_usage: dict[str, int] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def _response(state: ServerState, req: ResponsesRequest, request_id: str, created: int,
              items: list[dict[str, Any]], finish_reason: str | None, usage: dict[str, Any] | None) -> dict:
    """The response object; finish_reason None: still in progress (the stream's first events)."""
    if finish_reason is None:
        status, incomplete = "in_progress", None
    elif finish_reason == "length":
        status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    elif finish_reason == "abort":
        status, incomplete = "incomplete", {"reason": "aborted"}
    else:
        status, incomplete = "completed", None
    choice = req.tool_choice
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
    return {
        "id": f"resp_{request_id}", "object": "response", "created_at": created, "status": status,
        "background": False, "error": None, "incomplete_details": incomplete,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls, "model": state.model_name, "output": items,
        "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
        "reasoning": None, "service_tier": "default", "store": False,
        "temperature": req.temperature, "text": {"format": fmt or {"type": "text"}},
        "tool_choice": (choice if isinstance(choice, str) else choice.model_dump()) if choice is not None
        else ("auto" if req.tools else "none"),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "top_p": req.top_p,
        "truncation": "disabled", "usage": usage, "user": req.user, "metadata": req.metadata or {},
    }


class _EventWriter:
    """Numbers the events of one stream and keeps the output items as they grow."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []

    def event(self, kind: str, **payload: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _events(state: ServerState, req: ResponsesRequest, chat_reply: Response, request_id: str,
                  created: int, info: RequestInfo) -> AsyncIterator[str]:
    """The chat stream's chunks, re-shaped into Responses events (see the module docstring)."""
    out = _EventWriter()
    text: str | None = None  # the open message item's text, None when no message item is open
    calls: dict[int, int] = {}  # chat tool-call index -> output index of its open function_call item
    finish_reason = None
    usage = None

    def snapshot(reason: str | None) -> dict:
        return _response(state, req, request_id, created, out.items, reason, _usage(usage))

    def close_message() -> list[str]:
        nonlocal text
        if text is None:
            return []
        index = len(out.items) - 1
        item = out.items[index] = _message_item(request_id, text, "completed")
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        frames = [out.event("response.output_text.done", **ids, text=text, logprobs=[]),
                  out.event("response.content_part.done", **ids, part=_text_part(text)),
                  out.event("response.output_item.done", output_index=index, item=item)]
        text = None
        return frames

    def close_calls() -> list[str]:
        frames = []
        for index in calls.values():
            item = out.items[index]
            item["status"] = "completed"
            frames.append(out.event("response.function_call_arguments.done", item_id=item["id"],
                                    output_index=index, arguments=item["arguments"], name=item["name"]))
            frames.append(out.event("response.output_item.done", output_index=index, item=dict(item)))
        calls.clear()
        return frames

    yield out.event("response.created", response=snapshot(None))
    yield out.event("response.in_progress", response=snapshot(None))
    body = chat_reply.body_iterator
    try:
        async with aclosing(body) as frames:  # type: ignore[type-var]
            async for frame in frames:
                data = frame if isinstance(frame, str) else frame.decode()
                payload = data[len("data: "):].strip() if data.startswith("data: ") else ""
                if not payload or payload == "[DONE]":
                    continue
                chunk = json.loads(payload)
                if "error" in chunk:
                    err = chunk["error"]
                    yield out.event("error", code=str(err.get("code")), message=err.get("message"),
                                    param=err.get("param"))
                    return
                if chunk.get("usage") and not chunk.get("choices"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta") or {}
                    piece = delta.get("content")
                    if piece:
                        if text is None:
                            for frame_out in close_calls():
                                yield frame_out
                            out.items.append(_message_item(request_id, None, "in_progress"))
                            index = len(out.items) - 1
                            text = ""
                            yield out.event("response.output_item.added", output_index=index,
                                            item=out.items[index])
                            yield out.event("response.content_part.added", item_id=f"msg_{request_id}",
                                            output_index=index, content_index=0, part=_text_part(""))
                        text += piece
                        yield out.event("response.output_text.delta", item_id=f"msg_{request_id}",
                                        output_index=len(out.items) - 1, content_index=0, delta=piece,
                                        logprobs=[])
                    for call in delta.get("tool_calls") or []:
                        n = call.get("index", 0)
                        function = call.get("function") or {}
                        if n not in calls:
                            for frame_out in close_message():
                                yield frame_out
                            out.items.append(_call_item(request_id, n, call.get("id") or f"call_{request_id}_{n}",
                                                        function.get("name") or "", "", "in_progress"))
                            calls[n] = len(out.items) - 1
                            yield out.event("response.output_item.added", output_index=calls[n],
                                            item=dict(out.items[calls[n]]))
                        item = out.items[calls[n]]
                        pieces = function.get("arguments") or ""
                        if pieces:
                            item["arguments"] += pieces
                            yield out.event("response.function_call_arguments.delta", item_id=item["id"],
                                            output_index=calls[n], delta=pieces)
                    if choice.get("finish_reason"):
                        finish_reason = choice["finish_reason"]
    except Exception as exc:  # the status line is gone; report in-band
        err = from_exception(exc)
        yield out.event("error", code=str(err.status), message=err.message, param=err.param)
        return
    for frame_out in close_message() + close_calls():
        yield frame_out
    if not out.items:  # an empty reply still has its message
        out.items.append(_message_item(request_id, "", "completed"))
    final = snapshot(finish_reason or "abort")
    kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
    yield out.event(kind, response=final)


def response_not_stored(response_id: str) -> OpenAIError:
    return OpenAIError(404, f"Response {response_id!r} was not found: this server stores no responses "
                            "(send earlier turns in input instead of previous_response_id).", "response_id")
