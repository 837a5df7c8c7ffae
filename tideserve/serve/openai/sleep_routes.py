"""Sleep mode's routes (vLLM's): ``POST /sleep?level=1|2``, ``POST /wake_up[?tags=weights|kv_cache]``,
``GET /is_sleeping``.

An idle server that is put to sleep releases its KV pool and its weights (docs/api.md, "Sleep mode")
and keeps listening: ``/health/live`` stays 200 while ``/health/ready`` (and ``/health``) answer 503, so
a router stops sending it traffic, and every other request gets a 503 naming sleep until ``/wake_up``
has brought everything back. Sleeping with requests in flight is refused with a 409 (nothing is drained
or aborted): the caller waits for them, or aborts them, and asks again. The server must have been
started with ``--enable-sleep-mode``; otherwise these routes answer 400 naming the flag.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse, Response

from tideserve.serve.openai.errors import bad_request
from tideserve.serve.openai.serving import ServerState

Tag = Literal["weights", "kv_cache"]
TAGS: tuple[Tag, ...] = ("weights", "kv_cache")


def add_sleep_routes(app: FastAPI, state: ServerState) -> None:
    def engine():
        if not state.engine.sleep_mode_enabled:
            raise bad_request("Sleep mode is not enabled: start the server with --enable-sleep-mode to use /sleep "
                              "and /wake_up.")
        return state.engine

    @app.post("/sleep")
    async def sleep(level: Annotated[int, Query(ge=1, le=2, description="1: keep a host copy of GPU weights; "
                                                                       "2: drop them, reload from the model file")] = 1
                    ) -> Response:
        await engine().sleep(level)
        return JSONResponse({"is_sleeping": True, "level": level})

    @app.post("/wake_up")
    async def wake_up(tags: Annotated[list[Tag] | None, Query(description="what to bring back (default both)")]
                      = None) -> Response:
        await engine().wake_up(list(tags or TAGS))
        return JSONResponse({"is_sleeping": state.engine.is_sleeping})

    @app.get("/is_sleeping")
    async def is_sleeping() -> Response:
        return JSONResponse({"is_sleeping": state.engine.is_sleeping})
