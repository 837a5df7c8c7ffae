"""``POST /v1/completions``: text prompts, batches of prompts and token-id prompts, ``echo`` with prompt
logprobs (how evaluation harnesses score multiple-choice tasks), streaming and non-streaming.

With a batch of P prompts and n samples, choice ``i * n + j`` is sample j of prompt i, as in OpenAI's API.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tideserve.outputs import RequestOutput
from tideserve.serve.openai.errors import bad_request
from tideserve.serve.openai.fields import COMPLETION_FIELDS
from tideserve.serve.openai.logprobs import CompletionLogprobs, padded, prompt_logprobs_json
from tideserve.serve.openai.protocol import CompletionRequest, usage
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

logger = logging.getLogger(__name__)


@dataclass
class _Prompt:
    text: str  # what echo returns
    token_ids: list[int]


def _split_prompts(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty.", "prompt")
    return list(prompt)


def _tokenize(state: ServerState, req: CompletionRequest) -> list[_Prompt]:
    prompts = []
    for i, prompt in enumerate(_split_prompts(req.prompt)):
        try:
            text, token_ids = state.engine.tokenize_prompt(prompt, req.add_special_tokens)
        except ValueError as exc:  # the input processor's words; a batch says which prompt
            single = isinstance(req.prompt, str) or prompt is req.prompt
            raise bad_request(str(exc) if single else f"prompt[{i}]: {exc}", "prompt") from exc
        truncated = truncate_prompt(state, req, token_ids)
        if text is None or len(truncated) != len(token_ids):
            text = state.engine.tokenizer.decode(truncated, skip_special_tokens=False)
        prompts.append(_Prompt(text, truncated))
    return prompts


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request,
                            info: RequestInfo) -> Response:
    check_common(state, req, COMPLETION_FIELDS)
    check_logprobs(req.logprobs, "logprobs")
    check_logprobs(req.prompt_logprobs, "prompt_logprobs")
    request_id = resolve_request_id(raw, info, req)
    constraint, constraint_field = structured_outputs_from(req)
    prompts = await asyncio.to_thread(_tokenize, state, req)  # long prompts must not stall the event loop
    if constraint is not None:
        await compile_structured_outputs(state, constraint, constraint_field)
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo and req.logprobs is not None:
        prompt_logprobs = req.logprobs
    # With max_tokens=0 and prompt logprobs the engine still runs the prefill: the prompt is scored alone.
    params = sampling_params(req, req.max_tokens, req.logprobs, prompt_logprobs, structured_outputs=constraint)
    if state.config.log_prompts:
        logger.info("request_id=%s prompts=%r", request_id, [p.text for p in prompts])
    info.prompt_tokens = sum(len(p.token_ids) for p in prompts)
    streams = await submit(state, [(None, p.token_ids) for p in prompts], params, request_id, req)
    response_id = f"cmpl-{request_id}"
    if req.stream:
        return StreamingResponse(_stream(state, req, prompts, streams, response_id, info),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    finals = await final_outputs(state, raw, streams)
    choices = []
    for i, out in enumerate(finals):
        prompt = prompts[i]
        for c in out.outputs:
            choice = {
                "index": i * req.n + c.index,
                "text": prompt.text + c.text if req.echo else c.text,
                "logprobs": _logprobs(state, req, prompt, out, c, echo=req.echo),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            choices.append(_with_extras(state, req, choice, prompt, out, list(c.token_ids), first=True))
    # Every sample's tokens count, best_of's discarded ones included (OpenAI bills them too).
    info.output_tokens = sum(out.num_generated_tokens for out in finals)
    body = {"id": response_id, "object": "text_completion", "created": int(time.time()),
            "model": state.model_name, "choices": choices,
            "usage": usage(info.prompt_tokens, info.output_tokens)}
    return JSONResponse(body)


def _with_extras(state: ServerState, req: CompletionRequest, choice: dict, prompt: _Prompt, out: RequestOutput,
                 token_ids: list[int], first: bool) -> dict:
    """vLLM's optional choice fields: prompt_logprobs, and with return_token_ids the prompt's and the
    (new) output's token ids. Prompt fields go in a choice's first chunk only."""
    if first and req.prompt_logprobs is not None:
        entries = padded(out.prompt_logprobs, len(prompt.token_ids))
        choice["prompt_logprobs"] = prompt_logprobs_json(entries, logprob_token_str(state, req))
    if req.return_token_ids:
        if first:
            choice["prompt_token_ids"] = prompt.token_ids
        choice["token_ids"] = token_ids
    return choice


def _logprobs(state: ServerState, req: CompletionRequest, prompt: _Prompt, out: RequestOutput, c,
              echo: bool, start: int = 0, builder: CompletionLogprobs | None = None) -> dict | None:
    """Logprobs of output tokens [start:], preceded by the prompt's when echoing."""
    if req.logprobs is None:
        return None
    builder = builder or CompletionLogprobs(req.logprobs, logprob_token_str(state, req))
    end = len(c.token_ids)
    token_ids = list(c.token_ids[start:end])
    entries = padded(c.logprobs, end)[start:]
    if echo:
        prompt_entries = padded(getattr(out, "prompt_logprobs", None), len(prompt.token_ids))
        token_ids = prompt.token_ids + token_ids
        entries = prompt_entries + entries
    return builder.build(token_ids, entries)


@dataclass
class _ChoiceState:
    text_len: int = 0
    num_tokens: int = 0
    echoed: bool = False
    done: bool = False
    started: bool = False  # a chunk was sent (the prompt's fields go in the first)
    builder: CompletionLogprobs | None = None


async def _stream(state: ServerState, req: CompletionRequest, prompts: list[_Prompt], streams,
                  response_id: str, info: RequestInfo):
    created = int(time.time())
    n = req.n
    choices = [_ChoiceState(builder=CompletionLogprobs(req.logprobs or 0, logprob_token_str(state, req)))
               for _ in range(len(prompts) * n)]
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    completion_tokens = [0] * len(choices)

    def chunk(choice: dict) -> str:
        payload = {"id": response_id, "object": "text_completion", "created": created,
                   "model": state.model_name, "choices": [choice]}
        if include_usage:
            payload["usage"] = usage(info.prompt_tokens, sum(completion_tokens)) if continuous else None
        return sse(payload)

    try:
        async with aclosing(merged(state, streams)) as outputs:
            async for i, out in outputs:
                prompt = prompts[i]
                for c in out.outputs:
                    index = i * n + c.index
                    st = choices[index]
                    if st.done:
                        continue
                    delta = c.text[st.text_len:]
                    num_tokens = len(c.token_ids)
                    echo_now = req.echo and not st.echoed
                    if not (delta or num_tokens > st.num_tokens or c.finish_reason or echo_now):
                        continue
                    logprobs = _logprobs(state, req, prompt, out, c, echo_now, st.num_tokens, st.builder)
                    completion_tokens[index] = num_tokens
                    info.output_tokens = sum(completion_tokens)
                    text = (prompt.text + delta) if echo_now else delta
                    new_ids = list(c.token_ids[st.num_tokens:num_tokens])
                    first = not st.started
                    st.text_len, st.num_tokens, st.echoed = len(c.text), num_tokens, st.echoed or echo_now
                    st.done, st.started = c.finish_reason is not None, True
                    yield chunk(_with_extras(state, req, {"index": index, "text": text, "logprobs": logprobs,
                                                          "finish_reason": c.finish_reason,
                                                          "stop_reason": c.stop_reason},
                                             prompt, out, new_ids, first))
        for index, st in enumerate(choices):
            if not st.done:  # aborted by the server (not by this client, who would not be reading)
                yield chunk({"index": index, "text": "", "logprobs": None, "finish_reason": "abort",
                             "stop_reason": None})
        if include_usage:
            yield sse({"id": response_id, "object": "text_completion", "created": created,
                       "model": state.model_name, "choices": [],
                       "usage": usage(info.prompt_tokens, sum(completion_tokens))})
    except Exception as exc:  # the status line is gone; report in-band
        yield sse_error(exc)
    finally:
        for stream in streams:  # a client gone before the outputs were read must not keep its blocks
            stream.abort()
    yield SSE_DONE
