"""``POST /v1/chat/completions``: messages through the model's chat template, streaming and not.

A stream opens with one ``{"role": "assistant"}`` delta per choice (so clients see the response start
while the request may still wait for a slot), then content deltas; each choice's last chunk carries its
``finish_reason``; with ``stream_options.include_usage`` a final chunk has empty choices and the usage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tideserve.serve.openai.errors import OpenAIError, bad_request
from tideserve.serve.openai.logprobs import chat_logprobs, padded
from tideserve.serve.openai.protocol import ChatCompletionRequest, usage
from tideserve.serve.openai.serving import (
    SSE_DONE,
    RequestInfo,
    ServerState,
    check_common,
    check_context,
    check_logprobs,
    merged,
    sampling_params,
    sse,
    sse_error,
    submit,
    until_disconnected,
)

logger = logging.getLogger(__name__)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request,
                                 info: RequestInfo) -> Response:
    check_common(state, req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
    top_k = (req.top_logprobs or 0) if req.logprobs else None
    check_logprobs(state, top_k, "top_logprobs")
    if req.max_completion_tokens is not None:
        max_tokens, max_tokens_param = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_tokens_param = req.max_tokens, "max_tokens"
    try:
        token_ids = await asyncio.to_thread(  # rendering and encoding long chats must not stall the loop
            state.engine.tokenizer.encode_chat, req.messages, add_generation_prompt=req.add_generation_prompt)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from exc
    check_context(state, len(token_ids), max_tokens, "messages", max_tokens_param)
    try:
        params = sampling_params(req, max_tokens, top_k)
    except ValueError as exc:
        if str(exc).startswith("max_tokens") and max_tokens_param != "max_tokens":
            raise bad_request(str(exc).replace("max_tokens", max_tokens_param, 1), max_tokens_param) from exc
        raise
    if state.config.log_prompts:
        logger.info("request_id=%s messages=%r", info.request_id, req.messages)
    info.prompt_tokens = len(token_ids)
    streams = await submit(state, [(None, token_ids)], params, info.request_id)
    response_id = f"chatcmpl-{info.request_id}"
    if req.stream:
        return StreamingResponse(_stream(state, req, streams, response_id, info, top_k),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def collect():
        final = None
        async with aclosing(merged(state, streams)) as outputs:
            async for _, out in outputs:
                final = out
        return final

    final = await until_disconnected(raw, collect())
    if final is None or not final.finished:
        raise OpenAIError(503, "The request was aborted by the server before it finished.")
    choices = []
    for c in final.outputs:
        logprobs = None
        if top_k is not None:
            logprobs = chat_logprobs(c.token_ids, padded(c.logprobs, len(c.token_ids)), top_k, state.token_str)
        choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": logprobs, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    info.output_tokens = sum(len(c.token_ids) for c in final.outputs)
    return JSONResponse({"id": response_id, "object": "chat.completion", "created": int(time.time()),
                         "model": state.model_name, "choices": choices,
                         "usage": usage(info.prompt_tokens, info.output_tokens)})


@dataclass
class _ChoiceState:
    text_len: int = 0
    num_tokens: int = 0
    done: bool = False


async def _stream(state: ServerState, req: ChatCompletionRequest, streams, response_id: str,
                  info: RequestInfo, top_k: int | None):
    created = int(time.time())
    choices = [_ChoiceState() for _ in range(req.n)]
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)

    def chunk(choice: dict) -> str:
        payload = {"id": response_id, "object": "chat.completion.chunk", "created": created,
                   "model": state.model_name, "choices": [choice]}
        if include_usage:
            payload["usage"] = usage(info.prompt_tokens, info.output_tokens or 0) if continuous else None
        return sse(payload)

    try:
        for index in range(req.n):
            yield chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})
        async with aclosing(merged(state, streams)) as outputs:
            async for _, out in outputs:
                for c in out.outputs:
                    st = choices[c.index]
                    if st.done:
                        continue
                    delta = c.text[st.text_len:]
                    num_tokens = len(c.token_ids)
                    if not (delta or num_tokens > st.num_tokens or c.finish_reason):
                        continue
                    logprobs = None
                    if top_k is not None:
                        logprobs = chat_logprobs(c.token_ids[st.num_tokens:num_tokens],
                                                 padded(c.logprobs, num_tokens)[st.num_tokens:], top_k,
                                                 state.token_str)
                    st.text_len, st.num_tokens = len(c.text), num_tokens
                    st.done = c.finish_reason is not None
                    info.output_tokens = sum(ch.num_tokens for ch in choices)
                    yield chunk({"index": c.index, "delta": {"content": delta} if delta else {},
                                 "logprobs": logprobs, "finish_reason": c.finish_reason,
                                 "stop_reason": c.stop_reason})
        for index, st in enumerate(choices):
            if not st.done:
                yield chunk({"index": index, "delta": {}, "logprobs": None, "finish_reason": "abort"})
        if include_usage:
            yield sse({"id": response_id, "object": "chat.completion.chunk", "created": created,
                       "model": state.model_name, "choices": [],
                       "usage": usage(info.prompt_tokens, info.output_tokens or 0)})
    except Exception as exc:  # the status line is gone; report in-band
        yield sse_error(exc)
    finally:
        for stream in streams:  # a client gone before the outputs were read must not keep its blocks
            stream.abort()
    yield SSE_DONE
