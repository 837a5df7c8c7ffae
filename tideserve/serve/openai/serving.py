"""What chat and text completions share: the server's state, request checks, sampling parameters,
running engine requests (with metrics and abort on disconnect) and SSE framing.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from tideserve.engine.async_engine import AsyncEngine, RequestStream
from tideserve.engine.input_processor import EngineRequest
from tideserve.errors import InvalidParameterError
from tideserve.outputs import RequestOutput
from tideserve.pooling_params import PoolingParams
from tideserve.sampling_params import SamplingParams
from tideserve.serve.config import ServerConfig
from tideserve.serve.metrics import ServerMetrics
from tideserve.serve.openai.errors import OpenAIError, bad_request, error_body, from_exception
from tideserve.serve.openai.fields import EndpointFields, refuse_unsupported
from tideserve.serve.openai.protocol import EmbeddingRequest, SamplingRequest
from tideserve.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger(__name__)
T = TypeVar("T")
# Request ids from a header or a body: safe in logs and response ids.
REQUEST_ID_PATTERN = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


@dataclass
class RequestInfo:
    """Per-HTTP-request facts the access log line reports; handlers fill the token counts."""

    request_id: str
    method: str
    path: str
    client: str
    start: float = field(default_factory=time.monotonic)
    status: int = 500
    prompt_tokens: int | None = None
    output_tokens: int | None = None


@dataclass
class ServerState:
    """One app's state: its engine (None while loading), settings, metrics and lifecycle flags."""

    config: ServerConfig
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    engine: AsyncEngine | None = None
    served_names: list[str] = field(default_factory=list)
    load_error: str | None = None
    draining: bool = False
    in_flight: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    _ignored_logged: set[str] = field(default_factory=set)

    def attach(self, engine: AsyncEngine) -> None:
        """Serve ``engine``: names, metrics and the stats listener are set up here."""
        name = self.config.served_model_name
        self.served_names = [n for n in (name or "").split(",") if n] or [engine.model_name]
        self.metrics.attach_engine(self.served_names[0], engine.stats, engine.cache_info())
        engine.add_stats_listener(self.metrics.on_engine_stats)
        self._token_str = functools.lru_cache(maxsize=65536)(
            lambda tid: engine.tokenizer.decode([tid], skip_special_tokens=False))
        self.engine = engine

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    @property
    def chat_template(self) -> str | None:
        """The server's --chat-template (None: the model's own)."""
        return self.config.chat_template

    def check_model(self, requested: str | None) -> None:
        if requested and requested not in self.served_names:
            raise OpenAIError(404, f"The model `{requested}` does not exist; this server serves "
                                   f"{', '.join(repr(n) for n in self.served_names)}.", "model")

    def token_str(self, token_id: int) -> str:
        return self._token_str(token_id)

    def log_ignored(self, fields: Sequence[str]) -> None:
        """Warn about unknown request fields, once per field name for the life of the server."""
        new = [f for f in fields if f not in self._ignored_logged]
        if new:
            self._ignored_logged.update(new)
            logger.warning("The following fields were present in the request but ignored: %s", sorted(new))


# Sleep mode's own routes: they must reach an engine that is asleep (to wake it, or to ask).
SLEEP_PATHS = frozenset({"/sleep", "/wake_up", "/is_sleeping"})


def unavailable_reason(state: ServerState, path: str | None = None) -> str | None:
    """Why the server cannot take a request to ``path`` now (loading, draining, dead engine, asleep),
    or None."""
    if state.draining:
        return "The server is shutting down and no longer accepts requests."
    if state.load_error is not None:
        return f"The model failed to load: {state.load_error}"
    if state.engine is None:
        return "The model is still loading; retry when /health returns 200."
    if not state.engine.is_healthy:
        dead = state.engine.dead_error
        reason = f" ({type(dead).__name__}: {dead})" if dead is not None else ""
        return f"The engine is not running{reason}; the server must be restarted."
    if path not in SLEEP_PATHS and state.engine.is_sleeping:
        return (f"The engine is asleep (sleep level {state.engine.sleep_level}): it serves no requests until "
                "it is woken with POST /wake_up.")
    stall = state.config.engine_stall_timeout
    running_for = state.engine.step_running_for()
    if stall and running_for > stall:
        return (f"The engine is stalled: its current step has run for {running_for:.1f} s, longer than "
                f"engine_stall_timeout={stall:g} s (--engine-stall-timeout); requests are not progressing.")
    return None


# ---------------------------------------------------------------------- checks
# Request-shape checks only: every limit of the engine (context length, samples, logprobs, token ids,
# priority, salt) is checked once, by the engine's input processor, when ``submit`` hands it the request.
def check_logprobs(k: int | None, param: str) -> None:
    """A logprobs field the request spells its own way (top_logprobs) must not be negative."""
    if k is not None and k < 0:
        raise bad_request(f"{param} must be an integer >= 0, got {k}.", param)


def check_common(state: ServerState, req: SamplingRequest, fields: EndpointFields) -> None:
    """Checks both endpoints share: model, a model that generates, unknown fields (logged), refused
    fields, best_of with stream."""
    state.check_model(req.model)
    refused = state.engine.embedding_only_message()
    if refused is not None:
        raise bad_request(refused)
    if req.ignored_fields():
        state.log_ignored(req.ignored_fields())
    refuse_unsupported(req, fields)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options can only be set when stream is true.", "stream_options")
    if req.stream and req.best_of is not None and req.best_of > req.n:
        raise bad_request(f"best_of is not supported with stream: the best {req.n} of {req.best_of} samples "
                          "are known only when all have finished (OpenAI refuses this too); stream with "
                          "best_of unset or equal to n.", "best_of")


def structured_outputs_from(req: SamplingRequest) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the field that set it, from whichever of response_format,
    structured_outputs or the guided_* fields carries one; more than one is a 400."""
    found: list[tuple[str, dict]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "structural_tag":
        raise bad_request("response_format type 'structural_tag' is not supported by this server; use "
                          "json_schema, json_object or structured_outputs.", "response_format")
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise bad_request("response_format of type 'json_schema' needs json_schema.schema (the JSON "
                              "schema the output must match).", "response_format.json_schema")
        # Closed objects, as OpenAI's structured outputs (a strict schema must close every object) and
        # vLLM's default grammar backend (xgrammar, strict mode) give: a schema that lists its properties
        # gets those, and a small model does not add undeclared ones until max_tokens cuts the output.
        # An object that wants more says additionalProperties itself.
        found.append(("response_format.json_schema.schema", {"json": fmt.json_schema.json_schema,
                                                              "disable_additional_properties": True}))
    so = req.structured_outputs
    if so is not None:
        given = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                 "json_object": so.json_object or None}
        given = {k: v for k, v in given.items() if v is not None}
        if len(given) > 1:
            raise bad_request("You can only use one kind of constraints for structured outputs ('json', "
                              f"'regex', 'choice', 'grammar' or 'json_object'); got {', '.join(given)}.",
                              "structured_outputs")
        options = {"disable_any_whitespace": so.disable_any_whitespace,
                   "disable_additional_properties": so.disable_additional_properties}
        found.append(("structured_outputs", {**given, **options}))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, {key: value}))
    if not found:
        return None, None
    if len(found) > 1:
        raise bad_request("You can only use one kind of constraints for structured outputs; the request sets "
                          f"{' and '.join(name for name, _ in found)}.", found[1][0])
    field_name, kwargs = found[0]
    try:
        return StructuredOutputsParams(**kwargs), field_name
    except ValueError as exc:
        raise bad_request(_rename(str(exc), field_name), field_name) from exc


async def compile_structured_outputs(state: ServerState, params: StructuredOutputsParams, field_name: str) -> None:
    """Compile the constraint before the request is submitted (in a worker thread, bounded in time), so a
    schema that cannot be enforced is a 400 and the engine thread only ever meets cached grammars."""
    try:
        await asyncio.to_thread(state.engine.structured_output.compile, params)
    except ValueError as exc:
        raise bad_request(_rename(str(exc), field_name), field_name) from exc


def _rename(message: str, field_name: str) -> str:
    """Engine messages name ``structured_outputs.<kind>``; name the request field that was sent instead."""
    if field_name == "structured_outputs" or not message.startswith("structured_outputs"):
        return message
    head, _, rest = message.partition(" ")
    return f"{field_name}{':' if head.endswith(':') else ''} {rest}"


def sampling_params(req: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None,
                    structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    """SamplingParams from a request; its ValueError names the parameter (turned into a 400)."""
    return SamplingParams(
        n=req.n,
        best_of=req.best_of,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logit_bias=req.logit_bias or None,
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words or None,
        structured_outputs=structured_outputs,
    )


def truncate_prompt(state: ServerState, req: SamplingRequest | EmbeddingRequest, token_ids: list[int]) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last N tokens (truncation_side "right": the first N);
    -1 means max_model_len. Without it, a prompt that does not fit is a 400."""
    k = req.truncate_prompt_tokens
    if k is None:
        return token_ids
    limit = state.engine.max_model_len
    if k == -1:
        k = limit
    elif k < 1:
        raise bad_request(f"truncate_prompt_tokens must be -1 (max_model_len) or an integer >= 1, got {k}.",
                          "truncate_prompt_tokens")
    elif k > limit:
        raise bad_request(f"truncate_prompt_tokens value ({k}) is greater than max_model_len ({limit}). "
                          "Please, select a smaller truncation size.", "truncate_prompt_tokens")
    if len(token_ids) <= k:
        return token_ids
    return token_ids[:k] if req.truncation_side == "right" else token_ids[-k:]


def resolve_request_id(raw: Request, info: RequestInfo, req: SamplingRequest | EmbeddingRequest) -> str:
    """The body's request_id names the request when no X-Request-Id header does (vLLM's order)."""
    if req.request_id is not None and "x-request-id" not in raw.headers:
        if not REQUEST_ID_PATTERN.match(req.request_id):
            raise bad_request("request_id must be 1-128 characters from A-Z a-z 0-9 . _ : -, got "
                              f"{req.request_id[:140]!r}.", "request_id")
        info.request_id = req.request_id
    return info.request_id


def token_id_str(token_id: int) -> str:
    """return_tokens_as_token_ids: a token as "token_id:N", for tokens that are not valid UTF-8 alone."""
    return f"token_id:{token_id}"


def logprob_token_str(state: ServerState, req: SamplingRequest):
    """How logprobs write a token: its text, or "token_id:N" with return_tokens_as_token_ids."""
    return token_id_str if req.return_tokens_as_token_ids else state.token_str


def safe_logprob(value: float | None) -> float | None:
    """JSON has no -inf: clamp like vLLM does."""
    if value is None:
        return None
    return max(value, -9999.0) if not math.isnan(value) else -9999.0


# ---------------------------------------------------------------------- running requests
async def submit(state: ServerState, prompts: Sequence[tuple[str | None, list[int]]],
                 params: SamplingParams | PoolingParams, request_id: str,
                 req: SamplingRequest | EmbeddingRequest,
                 names: Mapping[str, str] | None = None) -> list[RequestStream]:
    """Check every prompt through the engine's input processor (``names``: the request's names for the
    engine's parameters), then add one engine request per prompt (ids ``request_id``, or ``request_id-i``
    for a batch), with the request's priority and cache salt.

    All or nothing: nothing is added unless every prompt passes, and if one is refused when added, those
    already added are aborted.
    """
    names = dict(names or {})
    prompt_field = names.get("prompt", "prompt")

    def process_all() -> list[EngineRequest]:
        checked = []
        for i, (text, token_ids) in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            try:
                checked.append(state.engine.process_inputs(
                    text or token_ids, params, rid, prompt_token_ids=token_ids, priority=req.priority,
                    cache_salt=req.cache_salt, names=names, max_n=state.config.max_n))
            except InvalidParameterError as exc:
                if len(prompts) > 1 and exc.param == prompt_field:  # say which prompt of the batch
                    raise bad_request(f"{prompt_field}[{i}]: {exc}", prompt_field) from exc
                raise
        return checked

    requests = await asyncio.to_thread(process_all)  # long prompts must not stall the event loop
    streams: list[RequestStream] = []
    try:
        for request in requests:
            streams.append(await state.engine.add(request))
    except BaseException:
        for s in streams:
            s.abort()
        raise
    return streams


async def merged(state: ServerState, streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, cumulative output) from several streams as they come; times each request.

    Closing the iterator (a disconnect, an error) aborts every stream that has not finished.
    """
    timers = [state.metrics.timer() for _ in streams]
    last: list[RequestOutput | None] = [None] * len(streams)
    try:
        if len(streams) == 1:
            async for out in streams[0]:
                timers[0].on_output(out)
                last[0] = out
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out, None))
            except Exception as exc:  # handed to the consumer
                queue.put_nowait((i, None, exc))
            queue.put_nowait((i, None, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, out, exc = await queue.get()
                if exc is not None:
                    raise exc
                if out is None:
                    remaining -= 1
                    continue
                timers[i].on_output(out)
                last[i] = out
                yield i, out
        finally:
            for t in tasks:
                t.cancel()
    finally:
        for stream, timer, out in zip(streams, timers, last):
            stream.abort()
            reasons = [c.finish_reason for c in out.outputs] if out is not None and out.finished else []
            timer.finish(_overall_reason(reasons))


async def final_outputs(state: ServerState, raw: Request, streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """Each stream's finished output, in order, for a non-streaming response. A client that disconnects
    first aborts them all (ClientDisconnected); a request the server ended early is a 503."""

    async def collect() -> list[RequestOutput | None]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async with aclosing(merged(state, streams)) as outputs:
            async for i, out in outputs:
                finals[i] = out
        return finals

    finals = await until_disconnected(raw, collect())
    if any(out is None or not out.finished for out in finals):
        raise OpenAIError(503, "The request was aborted by the server before it finished.")
    return finals


def _overall_reason(reasons: list[str | None]) -> str:
    if not reasons or any(r in (None, "abort") for r in reasons):
        return "abort"
    return "length" if "length" in reasons else "stop"


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first; then cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # the client is gone; its error has no reader
        pass
    raise ClientDisconnected()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(exc: BaseException) -> str:
    """An error after the stream started: the status is already 200, so it travels as an event."""
    err = from_exception(exc)
    return sse(error_body(err.status, err.message, err.param, err.err_type))
