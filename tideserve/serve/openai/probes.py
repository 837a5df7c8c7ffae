"""Routes for what runs around the server rather than for clients: orchestrator probes and load signals.

Kubernetes needs two different questions answered, and ``/health`` (vLLM's: 200 once the model is loaded,
503 while loading, draining or dead) answers only the second:

- ``GET /health/live`` (liveness): is this process worth keeping? 200 while the model loads and while a
  SIGTERM drain runs, so neither a long load nor a graceful shutdown gets the pod killed; 503 only when
  the engine has died or the model failed to load, which only a restart cures.
- ``GET /health/ready`` (readiness and startup): may traffic come here? 200 only when the model is
  loaded, the engine is healthy and the server is not draining: the same test as ``/health``.

Routers that balance on load poll one number per replica:

- ``GET /load``: vLLM's shape, ``{"server_load": N}``.
- ``GET /get_load``: the shape vllm-router's ``power_of_two`` policy polls, ``{"load": N}``.

N is the number of API requests in flight on this server (probes, metrics and these routes excluded),
counted when a request arrives, so it is exact at any instant, unlike an engine snapshot taken per step.
All four routes are exempt from the API key (probes and routers carry none) and log at DEBUG.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from tideserve.serve.openai.errors import error_response
from tideserve.serve.openai.serving import ServerState, unavailable_reason

LIVE_PATH = "/health/live"
READY_PATH = "/health/ready"
LOAD_PATHS = ("/load", "/get_load")
PROBE_PATHS = frozenset({LIVE_PATH, READY_PATH, *LOAD_PATHS})


def dead_reason(state: ServerState) -> str | None:
    """Why this process can never serve again (the model failed to load, the engine died), or None."""
    if state.load_error is not None:
        return f"The model failed to load: {state.load_error}"
    if state.engine is not None and not state.engine.is_healthy:
        dead = state.engine.dead_error
        reason = f" ({type(dead).__name__}: {dead})" if dead is not None else ""
        return f"The engine is not running{reason}; the server must be restarted."
    return None


def add_probe_routes(app: FastAPI, state: ServerState) -> None:
    @app.get(LIVE_PATH)
    async def live() -> Response:
        problem = dead_reason(state)
        if problem:
            return error_response(503, problem)
        phase = "draining" if state.draining else "loading" if state.engine is None else "serving"
        return JSONResponse({"status": "alive", "phase": phase})

    @app.get(READY_PATH)
    async def ready() -> Response:
        problem = unavailable_reason(state)
        if problem:
            return error_response(503, problem, headers={"Retry-After": "5"})
        return JSONResponse({"status": "ready"})

    @app.get("/load")
    async def load() -> JSONResponse:
        return JSONResponse({"server_load": state.in_flight})

    @app.get("/get_load")
    async def get_load() -> JSONResponse:
        return JSONResponse({"load": state.in_flight})
