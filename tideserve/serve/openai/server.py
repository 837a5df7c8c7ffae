"""The OpenAI-compatible HTTP server: routes, app assembly, and the process lifecycle.

``build_app`` serves an already-running ``AsyncEngine`` (tests share one loaded model between several
apps) or loads one in the background from a factory, so /health can answer 503 while the model loads
instead of refusing connections. ``run_server`` runs the app under uvicorn with a SIGTERM drain:
new requests get 503, in-flight ones finish (up to ``shutdown_timeout``), then the process exits 0.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from tideserve import __version__
from tideserve.engine.async_engine import AsyncEngine
from tideserve.serve.config import ServerConfig
from tideserve.serve.openai.errors import (
    bad_request,
    error_response,
    install_error_handlers,
    validation_message,
)
from tideserve.serve.openai.json_body import JSONBodyError, load_json
from tideserve.serve.openai.middleware import BodyLimitMiddleware, GateMiddleware, RequestContextMiddleware
from tideserve.serve.openai.probes import add_probe_routes
from tideserve.serve.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from tideserve.serve.openai.serving import ClientDisconnected, RequestInfo, ServerState, unavailable_reason
from tideserve.serve.openai.serving_chat import create_chat_completion, encode_messages
from tideserve.serve.openai.serving_completion import create_completion
from tideserve.serve.openai.serving_embedding import create_embedding
from tideserve.serve.openai.serving_responses import create_response, response_not_stored
from tideserve.serve.openai.sleep_routes import add_sleep_routes

logger = logging.getLogger(__name__)

EngineFactory = Callable[[], AsyncEngine]
M = TypeVar("M", bound=BaseModel)
_CLIENT_CLOSED = 499  # nginx's status for "client closed the request": only ever seen in the access log


def build_app(config: ServerConfig, engine: AsyncEngine | None = None,
              engine_factory: EngineFactory | None = None) -> FastAPI:
    """An app serving ``engine``, or the engine ``engine_factory`` loads in the background (owned:
    shut down with the app)."""
    if (engine is None) == (engine_factory is None):
        raise ValueError("build_app needs exactly one of engine and engine_factory.")
    state = ServerState(config)
    if engine is not None:
        state.attach(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine_factory is not None:
            threading.Thread(target=_load, args=(state, engine_factory), name="tideserve-load",
                             daemon=True).start()
        yield
        if engine_factory is not None and state.engine is not None:
            state.engine.shutdown()

    app = FastAPI(title="tideserve", version=__version__, lifespan=lifespan)
    app.state.tideserve = state
    install_error_handlers(app)
    _add_routes(app, state)
    _describe_bodies(app, state, REQUEST_BODIES)
    add_probe_routes(app, state)  # /health/live, /health/ready, /load, /get_load
    add_sleep_routes(app, state)  # /sleep, /wake_up, /is_sleeping
    route_paths = frozenset(getattr(r, "path", "") for r in app.routes)
    # add_middleware wraps: the last added is the outermost.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    app.add_middleware(GateMiddleware, state=state)
    app.add_middleware(RequestContextMiddleware, state=state, route_paths=route_paths)
    return app


# The routes parse their bodies themselves (parse_body), so FastAPI cannot see them: /openapi.json gets
# each body's pydantic schema from here, which is what clients' generators and the schema fuzzer read.
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}


def _describe_bodies(app: FastAPI, state: ServerState, bodies: dict[str, type[BaseModel]]) -> None:
    """Serve an OpenAPI document with the request-body schemas of ``bodies`` (path -> model), and with
    ``model`` restricted to the served names once the engine is loaded (only then is it cached)."""

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            if state.served_names and "model" in body.get("properties", {}):
                body["properties"]["model"] = {"anyOf": [{"enum": list(state.served_names)}, {"type": "null"}],
                                               "default": None, "title": "Model"}
        if state.served_names:
            app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _load(state: ServerState, factory: EngineFactory) -> None:
    start = time.monotonic()
    try:
        engine = factory()
        state.attach(engine)
    except ValueError as exc:  # a user error (bad path, flags that do not fit): the message says it all
        state.load_error = str(exc)
        return
    except Exception as exc:
        logger.exception("Loading the model failed")
        state.load_error = f"{type(exc).__name__}: {exc}"
        return
    logger.info("Model %r loaded in %.1f s (max_model_len %d); the server is ready", state.model_name,
                time.monotonic() - start, engine.max_model_len)


def _info(request: Request) -> RequestInfo:
    info = request.scope.get("tideserve.request")
    if info is None:  # the app was mounted without its middleware
        info = request.scope["tideserve.request"] = RequestInfo("-", request.method, request.url.path, "-")
    return info


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    @app.get("/ping")
    async def health() -> Response:
        problem = unavailable_reason(state)
        if problem:
            return error_response(503, problem)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [_model_card(state, n) for n in state.served_names]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONResponse:
        state.check_model(model_id)
        return JSONResponse(_model_card(state, model_id))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse_body(request, CompletionRequest)
        return await _guarded(create_completion(state, req, request, _info(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest)
        return await _guarded(create_chat_completion(state, req, request, _info(request)))

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        req = await parse_body(request, ResponsesRequest)
        return await _guarded(create_response(state, req, request, _info(request)))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        req = await parse_body(request, EmbeddingRequest)
        return await _guarded(create_embedding(state, req, request, _info(request)))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        raise response_not_stored(response_id)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        req = await parse_body(request, TokenizeRequest)
        state.check_model(req.model)
        tokenizer = state.engine.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("Give exactly one of prompt and messages.", "prompt")
        if req.messages is not None:  # the chat endpoint's rendering, template overrides included
            explicit = req.add_special_tokens if "add_special_tokens" in req.model_fields_set else None
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            tokens = await asyncio.to_thread(encode_messages, state, req, explicit, tools)
        else:
            try:
                tokens = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            except ValueError as exc:
                raise bad_request(str(exc), "prompt") from exc
        body = {"count": len(tokens), "max_model_len": state.engine.max_model_len, "tokens": tokens}
        if req.return_token_strs:
            body["token_strs"] = tokenizer.convert_ids_to_tokens(tokens)
        return JSONResponse(body)

    if state.config.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info() -> JSONResponse:
            return JSONResponse(_tokenizer_info(state))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        req = await parse_body(request, DetokenizeRequest)
        state.check_model(req.model)
        vocab = state.engine.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"tokens: token id {bad} is out of range: it must be in [0, {vocab}).", "tokens")
        return JSONResponse({"prompt": state.engine.tokenizer.decode(req.tokens, skip_special_tokens=False)})


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body as ``model``, whatever the Content-Type (curl -d sends a form type).

    Parsed here rather than by FastAPI so malformed JSON and type errors get clear 400 messages.
    """
    body = await request.body()
    try:
        data = load_json(body)
    except JSONBodyError as exc:
        raise bad_request(str(exc)) from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(list(exc.errors()))
        raise bad_request(message, param) from exc


async def _guarded(work: Awaitable[Response]) -> Response:
    try:
        return await work
    except ClientDisconnected:
        return Response(status_code=_CLIENT_CLOSED)


def _tokenizer_info(state: ServerState) -> dict:
    """What a client needs to tokenize through /tokenize as the server does: the special tokens, whether
    plain text gets a BOS, the chat template the server renders with, and the context length. vLLM's
    shape, less the tokenizer's load arguments (file paths on the server)."""
    tokenizer = state.engine.tokenizer
    hf = tokenizer.hf

    def token(name: str) -> str | None:
        value = getattr(hf, name, None)
        return None if value is None else str(value)

    return {"tokenizer_class": type(hf).__name__,
            "bos_token": token("bos_token"), "eos_token": token("eos_token"),
            "pad_token": token("pad_token"), "unk_token": token("unk_token"),
            "add_bos_token": tokenizer.adds_bos,
            "chat_template": state.chat_template or tokenizer.chat_template,
            "model_max_length": state.engine.max_model_len}


def _model_card(state: ServerState, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "tideserve",
            "root": state.engine.model_name, "parent": None, "max_model_len": state.engine.max_model_len,
            "permission": []}


# ---------------------------------------------------------------------- process lifecycle
class DrainingServer(uvicorn.Server):
    """uvicorn's Server with a drain on SIGTERM/SIGINT; a second signal exits at once.

    Draining keeps the listener open so new requests get a clear 503 (not a refused connection),
    and exits with status 0 once nothing is in flight or ``shutdown_timeout`` has passed.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = self.state
        if state.draining or state.config.shutdown_timeout == 0 or state.engine is None:
            super().handle_exit(sig, frame)
            return
        state.draining = True
        self.drain_deadline = time.monotonic() + state.config.shutdown_timeout
        logger.info("Received %s: draining %d in-flight requests (up to %.0f s); new requests get 503",
                    signal.Signals(sig).name, state.in_flight, state.config.shutdown_timeout)

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        state = self.state
        if self.drain_deadline is not None:
            if state.in_flight == 0:
                logger.info("Drained: no request in flight; shutting down")
                self.should_exit = True
            elif time.monotonic() >= self.drain_deadline:
                logger.warning("Shutdown timeout reached with %d requests in flight; shutting down",
                               state.in_flight)
                self.should_exit = True
        if state.load_error is not None:
            self.should_exit = True
        return self.should_exit


def _with_frozen_heap(factory: EngineFactory) -> EngineFactory:
    """``factory``, then the objects start-up left (the model's modules, the tokenizer's vocabulary and
    merges, the GGUF metadata's leftovers) moved out of the cyclic collector's sight with ``gc.freeze``.
    A full collection otherwise walks all of them: 2-3% of a 1.7B model's prefill went to the collector,
    none after the freeze. Only for a server process, which holds one engine for its whole life: frozen
    objects are never collected, so a process that builds and drops engines would keep their cycles."""

    def build() -> AsyncEngine:
        engine = factory()
        gc.collect()
        gc.freeze()
        return engine

    return build


def run_server(config: ServerConfig, engine_factory: EngineFactory) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code (1 if the model failed to load)."""
    app = build_app(config, engine_factory=_with_frozen_heap(engine_factory))
    state: ServerState = app.state.tideserve
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_config=None, access_log=False,
                               log_level=config.uvicorn_log_level, timeout_graceful_shutdown=5,
                               timeout_keep_alive=5)
    server = DrainingServer(uv_config, state)
    logger.info("tideserve %s: listening on http://%s:%d while the model loads", __version__, config.host,
                config.port)
    server.run()
    if state.load_error is not None:
        logger.error("Exiting: the model failed to load: %s", state.load_error)
        return 1
    return 0
