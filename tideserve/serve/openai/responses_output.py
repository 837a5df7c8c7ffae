"""What ``/v1/responses`` answers, built from the chat pipeline's reply: the response object and its output
items (a ``message`` with one ``output_text`` part, a ``function_call`` item per tool call), and, for a
stream, the Responses events re-shaped from the chat stream's chunks (serving_responses.py has the why).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.responses import StreamingResponse

from tideserve.serve.openai.errors import OpenAIError, from_exception
from tideserve.serve.openai.protocol import ResponsesRequest
from tideserve.serve.openai.serving import ServerState


def message_items(message: dict[str, Any], request_id: str,
                  logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """A chat reply's assistant message as output items: a reasoning item with its thinking (under
    --reasoning-parser), its text with the tokens' logprobs when asked (kept even when empty, unless the
    reply is only calls), then one function_call item per tool call."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(request_id, message["reasoning_content"], "completed"))
    text = message.get("content") or ""
    calls = message.get("tool_calls") or []
    if text or not calls:
        items.append(message_item(request_id, text, "completed", logprobs))
    for n, call in enumerate(calls):
        items.append(call_item(request_id, n, call["id"], call["function"]["name"], call["function"]["arguments"],
                               "completed"))
    return items


def message_item(request_id: str, text: str | None, status: str,
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    content = [] if text is None else [text_part(text, logprobs)]
    return {"type": "message", "id": f"msg_{request_id}", "status": status, "role": "assistant",
            "content": content}


def reasoning_item(request_id: str, text: str | None, status: str) -> dict[str, Any]:
    """The thinking section, as the Responses API returns reasoning (vLLM's shape: a reasoning_text part)."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": f"rs_{request_id}", "status": status, "summary": [], "content": content}


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An output_text part; chat's logprob entries ({token, logprob, bytes, top_logprobs}) are the Responses
    API's as they are."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(request_id: str, n: int, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{request_id}_{n}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def responses_usage(chat_usage: dict[str, int] | None) -> dict[str, Any] | None:
    """Chat usage in the Responses API's names."""
    if chat_usage is None:
        return None
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def response_object(state: ServerState, req: ResponsesRequest, request_id: str, created: int,
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


class StreamTranslator:
    """One stream's Responses events: numbers them, and keeps the output items as the chat deltas grow them
    (at most one item is open at a time: a message, or the function calls of one turn)."""

    def __init__(self, state: ServerState, req: ResponsesRequest, request_id: str, created: int) -> None:
        self.state, self.req, self.request_id, self.created = state, req, request_id, created
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.text: str | None = None  # the open message item's text; None: no message item is open
        self.reasoning: str | None = None  # the open reasoning item's text; None: none is open
        self.logprobs: list[dict[str, Any]] = []  # the open message's token logprobs (when asked for)
        self.calls: dict[int, int] = {}  # chat tool-call index -> output index of its open function_call item
        self.usage: dict[str, int] | None = None

    def event(self, kind: str, **payload: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def snapshot(self, finish_reason: str | None) -> dict:
        return response_object(self.state, self.req, self.request_id, self.created, self.items, finish_reason,
                               responses_usage(self.usage))

    def start(self) -> list[str]:
        return [self.event("response.created", response=self.snapshot(None)),
                self.event("response.in_progress", response=self.snapshot(None))]

    def on_reasoning(self, piece: str) -> list[str]:
        """A reasoning delta (the thinking comes first, so its item opens before any other)."""
        frames = []
        item_id = f"rs_{self.request_id}"
        if self.reasoning is None:
            self.items.append(reasoning_item(self.request_id, None, "in_progress"))
            self.reasoning = ""
            frames.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                     item=self.items[-1]))
            frames.append(self.event("response.content_part.added", item_id=item_id,
                                     output_index=len(self.items) - 1, content_index=0,
                                     part={"type": "reasoning_text", "text": ""}))
        self.reasoning += piece
        frames.append(self.event("response.reasoning_text.delta", item_id=item_id, output_index=len(self.items) - 1,
                                 content_index=0, delta=piece))
        return frames

    def close_reasoning(self) -> list[str]:
        if self.reasoning is None:
            return []
        index = len(self.items) - 1
        item = self.items[index] = reasoning_item(self.request_id, self.reasoning, "completed")
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        frames = [self.event("response.reasoning_text.done", **ids, text=self.reasoning),
                  self.event("response.content_part.done", **ids, part=item["content"][0]),
                  self.event("response.output_item.done", output_index=index, item=item)]
        self.reasoning = None
        return frames

    def on_text(self, piece: str, logprobs: list[dict[str, Any]]) -> list[str]:
        """A content delta, with its tokens' logprobs when asked for (a token may bring logprobs and no
        text yet: its delta is empty)."""
        frames = self.close_reasoning()
        item_id = f"msg_{self.request_id}"
        if self.text is None:
            frames += self.close_calls()
            self.items.append(message_item(self.request_id, None, "in_progress"))
            self.text = ""
            index = len(self.items) - 1
            frames.append(self.event("response.output_item.added", output_index=index, item=self.items[index]))
            frames.append(self.event("response.content_part.added", item_id=item_id, output_index=index,
                                     content_index=0, part=text_part("")))
        self.text += piece
        self.logprobs += logprobs
        frames.append(self.event("response.output_text.delta", item_id=item_id, output_index=len(self.items) - 1,
                                 content_index=0, delta=piece, logprobs=logprobs))
        return frames

    def on_call(self, call: dict[str, Any]) -> list[str]:
        """A chat ``tool_calls`` delta: the first for an index names the function, the rest add arguments."""
        frames = self.close_reasoning()
        n = call.get("index", 0)
        function = call.get("function") or {}
        if n not in self.calls:
            frames += self.close_message()
            self.items.append(call_item(self.request_id, n, call.get("id") or f"call_{self.request_id}_{n}",
                                         function.get("name") or "", "", "in_progress"))
            self.calls[n] = len(self.items) - 1
            frames.append(self.event("response.output_item.added", output_index=self.calls[n],
                                     item=dict(self.items[self.calls[n]])))
        item = self.items[self.calls[n]]
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            frames.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.calls[n], delta=function["arguments"]))
        return frames

    def close_message(self) -> list[str]:
        if self.text is None:
            return []
        index = len(self.items) - 1
        item = self.items[index] = message_item(self.request_id, self.text, "completed", self.logprobs)
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        frames = [self.event("response.output_text.done", **ids, text=self.text, logprobs=self.logprobs),
                  self.event("response.content_part.done", **ids, part=item["content"][0]),
                  self.event("response.output_item.done", output_index=index, item=item)]
        self.text, self.logprobs = None, []
        return frames

    def close_calls(self) -> list[str]:
        frames = []
        for index in self.calls.values():
            item = self.items[index]
            item["status"] = "completed"
            frames.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, arguments=item["arguments"], name=item["name"]))
            frames.append(self.event("response.output_item.done", output_index=index, item=dict(item)))
        self.calls.clear()
        return frames

    def finish(self, finish_reason: str | None) -> list[str]:
        frames = self.close_reasoning() + self.close_message() + self.close_calls()
        if not self.items:  # an empty reply still has its message
            self.items.append(message_item(self.request_id, "", "completed"))
        final = self.snapshot(finish_reason or "abort")
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return frames + [self.event(kind, response=final)]

    def error(self, err: OpenAIError) -> str:
        return self.event("error", code=str(err.status), message=err.message, param=err.param)


def chat_chunk(frame: str | bytes) -> dict[str, Any] | None:
    """One SSE frame of the chat stream as its JSON payload (None for the closing [DONE])."""
    data = frame if isinstance(frame, str) else frame.decode()
    payload = data[len("data: "):].strip() if data.startswith("data: ") else ""
    return json.loads(payload) if payload and payload != "[DONE]" else None


async def response_events(state: ServerState, req: ResponsesRequest, chat_reply: StreamingResponse, request_id: str,
                  created: int) -> AsyncIterator[str]:
    """The chat stream's chunks, re-shaped into Responses events (see the module docstring)."""
    out = StreamTranslator(state, req, request_id, created)
    finish_reason = None
    for frame in out.start():
        yield frame
    try:
        async with aclosing(chat_reply.body_iterator) as frames:  # type: ignore[type-var]
            async for frame in frames:
                chunk = chat_chunk(frame)
                if chunk is None:
                    continue
                if "error" in chunk:
                    err = chunk["error"]
                    yield out.error(OpenAIError(err.get("code") or 500, err.get("message", ""), err.get("param")))
                    return
                if chunk.get("usage") and not chunk.get("choices"):
                    out.usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta") or {}
                    logprobs = (choice.get("logprobs") or {}).get("content") or []
                    if delta.get("reasoning_content"):
                        for event in out.on_reasoning(delta["reasoning_content"]):
                            yield event
                    if delta.get("content") or logprobs:
                        for event in out.on_text(delta.get("content") or "", logprobs):
                            yield event
                    for call in delta.get("tool_calls") or []:
                        for event in out.on_call(call):
                            yield event
                    finish_reason = choice.get("finish_reason") or finish_reason
    except Exception as exc:  # the status line is gone; report in-band
        yield out.error(from_exception(exc))
        return
    for frame in out.finish(finish_reason):
        yield frame
