"""``POST /v1/chat/completions``: messages through the model's chat template, streaming and not.

A stream opens with one ``{"role": "assistant"}`` delta per choice (so clients see the response start
while the request may still wait for a slot), then content deltas (and ``tool_calls`` deltas when tools
are called, see tool_calls.py); each choice's last chunk carries its ``finish_reason``; with
``stream_options.include_usage`` a final chunk has empty choices and the usage. ``response_format`` and
the other structured-output fields are compiled into a grammar before the request is submitted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tideserve.serve.openai.errors import bad_request
from tideserve.serve.openai.fields import CHAT_FIELDS
from tideserve.serve.openai.logprobs import chat_logprobs, padded, prompt_logprobs_json
from tideserve.serve.openai.protocol import ChatCompletionRequest, usage
from tideserve.serve.openai.reasoning import (
    ReasoningDeltaStream,
    reasoning_markers,
    reasoning_parser,
    split_reasoning,
    with_reasoning,
)
from tideserve.serve.openai.reasoning_parsers import ReasoningParser
from tideserve.serve.openai.serving import (
    SSE_DONE,
    RequestInfo,
    ServerState,
    check_common,
    check_logprobs,
    compile_structured_outputs,
    final_outputs,
    logprob_token_str,
    merged,
    resolve_request_id,
    sampling_params,
    sse,
    sse_error,
    structured_outputs_from,
    submit,
    truncate_prompt,
)
from tideserve.serve.openai.tool_calls import (
    ToolDeltaStream,
    ToolPlan,
    markers_are_special,
    message_with_calls,
    plan_tools,
    strip_stop_token_text,
)
from tideserve.tokenizer.chat_template import ChatTemplateError, reads_variable

logger = logging.getLogger(__name__)


def encode_messages(state: ServerState, req, add_special_tokens: bool | None = None,
                    tools: list[dict] | None = None) -> list[int]:
    """Messages rendered with the request's chat template, else the server's (--chat-template), else the
    model's; a template error is a 400 naming the field to blame."""
    template = req.chat_template or state.chat_template
    variables = dict(req.chat_template_kwargs or {})
    effort = getattr(req, "reasoning_effort", None)
    if effort is not None:
        variables["reasoning_effort"] = effort
    try:
        if effort is not None and not reads_variable(template or state.engine.tokenizer.chat_template or "",
                                                     "reasoning_effort"):
            raise ChatTemplateError("reasoning_effort is not supported: the chat template does not read "
                                    "`reasoning_effort`, so it would not change the reply.", "reasoning_effort")
        return state.engine.tokenizer.encode_chat(
            req.messages, add_generation_prompt=req.add_generation_prompt, add_special_tokens=add_special_tokens,
            chat_template=template, chat_template_kwargs=variables or None,
            continue_final_message=req.continue_final_message, documents=req.documents, tools=tools)
    except ValueError as exc:
        param = getattr(exc, "param", None) or ("tools" if str(exc).startswith("tools") else "messages")
        raise bad_request(str(exc), param) from exc


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request,
                                 info: RequestInfo) -> Response:
    check_common(state, req, CHAT_FIELDS)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
    top_k = (req.top_logprobs or 0) if req.logprobs else None
    check_logprobs(top_k, "top_logprobs")
    check_logprobs(req.prompt_logprobs, "prompt_logprobs")
    if req.max_completion_tokens is not None:
        max_tokens, max_tokens_param = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_tokens_param = req.max_tokens, "max_tokens"
    request_id = resolve_request_id(raw, info, req)
    constraint, constraint_field = structured_outputs_from(req)
    tokenizer = state.engine.tokenizer
    plan = plan_tools(req, state.config.enable_auto_tool_choice, state.config.tool_call_parser, tokenizer,
                      constraint is not None)
    if plan.structured_outputs is not None:
        constraint, constraint_field = plan.structured_outputs, "tools"
    reasoner = reasoning_parser(state.config.reasoning_parser)
    if reasoner is None and req.include_reasoning is False:
        raise bad_request("include_reasoning false needs a reasoning parser (--reasoning-parser): without one "
                          "the reasoning the model writes stays in the content.", "include_reasoning")
    if reasoner is not None and markers_are_special(reasoner, tokenizer):
        plan = replace(plan, keep_special_tokens=True)
    # Rendering and encoding long chats must not stall the event loop.
    token_ids = await asyncio.to_thread(encode_messages, state, req, req.add_special_tokens, plan.tools)
    token_ids = truncate_prompt(state, req, token_ids)
    if constraint is not None:
        await compile_structured_outputs(state, constraint, constraint_field)
    try:
        params = sampling_params(req, max_tokens, top_k, req.prompt_logprobs, structured_outputs=constraint)
    except ValueError as exc:
        if str(exc).startswith("max_tokens") and max_tokens_param != "max_tokens":
            raise bad_request(str(exc).replace("max_tokens", max_tokens_param, 1), max_tokens_param) from exc
        raise
    if plan.keep_special_tokens:
        params.skip_special_tokens = False  # the parser reads markers that are special tokens
    if reasoner is not None and params.structured_outputs is not None:
        params.reasoning_markers = reasoning_markers(reasoner, tokenizer)  # the grammar skips the thinking
    if state.config.log_prompts:
        logger.info("request_id=%s messages=%r", request_id, req.messages)
    info.prompt_tokens = len(token_ids)
    names = {"prompt": "messages", "max_tokens": max_tokens_param, "logprobs": "top_logprobs"}
    streams = await submit(state, [(None, token_ids)], params, request_id, req, names)
    response_id = f"chatcmpl-{request_id}"
    echo = _echo_text(req)
    if req.stream:
        return StreamingResponse(_stream(state, req, streams, response_id, info, top_k, token_ids, echo, plan,
                                         reasoner),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    final, = await final_outputs(state, raw, streams)
    token_str = logprob_token_str(state, req)
    choices = []
    for c in final.outputs:
        logprobs = None
        if top_k is not None:
            logprobs = chat_logprobs(c.token_ids, padded(c.logprobs, len(c.token_ids)), top_k, token_str)
        text = strip_stop_token_text(plan, tokenizer, c.text, c.token_ids, c.finish_reason)
        reasoning, text = split_reasoning(reasoner, text)
        message, finish_reason = message_with_calls(plan, text, c.finish_reason)
        if reasoner is not None:
            message = with_reasoning(message, reasoning, req.include_reasoning)
        if echo:
            message["content"] = echo + (message.get("content") or "")
        choice = {"index": c.index, "message": message,
                  "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": c.stop_reason}
        if req.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        choices.append(choice)
    # Every sample's tokens count, best_of's discarded ones included (OpenAI bills them too).
    info.output_tokens = final.num_generated_tokens
    body = {"id": response_id, "object": "chat.completion", "created": int(time.time()),
            "model": state.model_name, "choices": choices,
            "usage": usage(info.prompt_tokens, info.output_tokens)}
    body.update(_prompt_extras(state, req, final, token_ids))
    return JSONResponse(body)


def _echo_text(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's content when it is the assistant's (the text the reply
    continues), else nothing."""
    if not req.echo or not req.messages:
        return ""
    last = req.messages[-1]
    content = last.get("content") if isinstance(last, dict) and last.get("role") == "assistant" else None
    if isinstance(content, list):
        content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _prompt_extras(state: ServerState, req: ChatCompletionRequest, out, token_ids: list[int]) -> dict:
    """Response-level prompt fields: prompt_logprobs, and prompt_token_ids with return_token_ids."""
    extras = {}
    if req.prompt_logprobs is not None:
        entries = padded(out.prompt_logprobs, len(token_ids))
        extras["prompt_logprobs"] = prompt_logprobs_json(entries, logprob_token_str(state, req))
    if req.return_token_ids:
        extras["prompt_token_ids"] = token_ids
    return extras


@dataclass
class _ChoiceState:
    deltas: ReasoningDeltaStream
    text_len: int = 0
    num_tokens: int = 0
    done: bool = False


async def _stream(state: ServerState, req: ChatCompletionRequest, streams, response_id: str,
                  info: RequestInfo, top_k: int | None, prompt_token_ids: list[int], echo: str, plan: ToolPlan,
                  reasoner: ReasoningParser | None):
    """Chunks: one role delta per choice (with prompt_token_ids under return_token_ids), the echoed text
    if any, content or tool-call deltas (the first output chunk carries prompt_logprobs when asked), a
    final usage chunk with stream_options.include_usage."""
    created = int(time.time())
    tokenizer = state.engine.tokenizer
    choices = [_ChoiceState(ReasoningDeltaStream(reasoner, ToolDeltaStream(plan), req.include_reasoning))
               for _ in range(req.n)]
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    token_str = logprob_token_str(state, req)
    prompt_logprobs_sent = req.prompt_logprobs is None

    def chunk(choice: dict, **extra) -> str:
        payload = {"id": response_id, "object": "chat.completion.chunk", "created": created,
                   "model": state.model_name, "choices": [choice], **extra}
        if include_usage:
            payload["usage"] = usage(info.prompt_tokens, info.output_tokens or 0) if continuous else None
        return sse(payload)

    try:
        prompt_ids = {"prompt_token_ids": prompt_token_ids} if req.return_token_ids else {}
        for index in range(req.n):
            yield chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}, **prompt_ids)
            if echo:
                yield chunk({"index": index, "delta": {"content": echo}, "logprobs": None, "finish_reason": None})
        async with aclosing(merged(state, streams)) as outputs:
            async for _, out in outputs:
                for c in out.outputs:
                    st = choices[c.index]
                    if st.done:
                        continue
                    num_tokens = len(c.token_ids)
                    if not (len(c.text) > st.text_len or num_tokens > st.num_tokens or c.finish_reason):
                        continue
                    text = strip_stop_token_text(plan, tokenizer, c.text, c.token_ids, c.finish_reason)
                    delta = st.deltas.delta(text, finished=c.finish_reason is not None)
                    logprobs = None
                    if top_k is not None:
                        logprobs = chat_logprobs(c.token_ids[st.num_tokens:num_tokens],
                                                 padded(c.logprobs, num_tokens)[st.num_tokens:], top_k,
                                                 token_str)
                    finished = c.finish_reason is not None
                    if ((plan.parser is not None or reasoner is not None) and not delta and logprobs is None
                            and not finished and not req.return_token_ids and prompt_logprobs_sent):
                        st.text_len, st.num_tokens = len(c.text), num_tokens
                        continue  # text held back by a parser (a marker or a call's name is not complete yet)
                    choice = {"index": c.index, "delta": delta, "logprobs": logprobs,
                              "finish_reason": st.deltas.finish_reason(c.finish_reason),
                              "stop_reason": c.stop_reason}
                    if req.return_token_ids:
                        choice["token_ids"] = list(c.token_ids[st.num_tokens:num_tokens])
                    extra = {}
                    if not prompt_logprobs_sent:
                        extra, prompt_logprobs_sent = _prompt_extras(state, req, out, prompt_token_ids), True
                        extra.pop("prompt_token_ids", None)
                    st.text_len, st.num_tokens = len(c.text), num_tokens
                    st.done = c.finish_reason is not None
                    info.output_tokens = sum(ch.num_tokens for ch in choices)
                    yield chunk(choice, **extra)
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
