"""Pure ASGI middleware of the server (not BaseHTTPMiddleware, which breaks streaming disconnects).

From the outside in:
- ``RequestContextMiddleware``: request id (``X-Request-Id`` honoured or generated, and returned),
  the in-flight count SIGTERM drains, one access log line and the HTTP metrics per request.
- ``GateMiddleware``: API key (constant-time compare; 401), server state (503 while loading, draining
  or after the engine died), per-key rate limit (429 with Retry-After). Health, metrics, version and
  the docs are exempt.
- ``BodyLimitMiddleware``: bodies over the limit get 413 before the app parses anything (the rest of the
  body is read and dropped first, within bounds, so the client sees the 413 rather than a reset).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import math
import re
import time
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tideserve.serve.openai.errors import error_response
from tideserve.serve.openai.probes import PROBE_PATHS
from tideserve.serve.openai.serving import RequestInfo, ServerState, unavailable_reason

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("tideserve.serve.access")

EXEMPT_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/load", "/docs", "/redoc",
                          "/openapi.json", "/docs/oauth2-redirect"}) | PROBE_PATHS
# Polled by probes and scrapers: their access lines go to DEBUG so they do not drown the real traffic.
QUIET_PATHS = frozenset({"/health", "/ping", "/metrics"}) | PROBE_PATHS
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, state: ServerState, route_paths: frozenset[str]) -> None:
        self.app = app
        self.state = state
        self.route_paths = route_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("x-request-id", "")
        request_id = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        path = scope["path"]
        info = RequestInfo(request_id, scope["method"], path, _client(scope))
        scope["tideserve.request"] = info

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                info.status = message["status"]
                MutableHeaders(scope=message).append("X-Request-Id", info.request_id)  # the body may name it
            await send(message)

        tracked = path not in EXEMPT_PATHS
        if tracked:
            self.state.in_flight += 1
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if tracked:
                self.state.in_flight -= 1
            latency = time.monotonic() - info.start
            handler = path if path in self.route_paths else "other"
            self.state.metrics.observe_http(handler, info.method, info.status, latency)
            level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
            access_logger.log(
                level, "request_id=%s client=%s method=%s path=%s status=%d prompt_tokens=%s "
                "output_tokens=%s latency_ms=%.1f", info.request_id, info.client, info.method, path, info.status,
                "-" if info.prompt_tokens is None else info.prompt_tokens,
                "-" if info.output_tokens is None else info.output_tokens, latency * 1000)


class RateLimiter:
    """Sliding one-minute window of request times per key."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._hits: dict[str, collections.deque[float]] = {}

    def retry_after(self, key: str, now: float | None = None) -> float | None:
        """None when the request may proceed (and is counted), else the seconds to wait."""
        now = time.monotonic() if now is None else now
        hits = self._hits.setdefault(key, collections.deque())
        while hits and hits[0] <= now - 60.0:
            hits.popleft()
        if len(hits) >= self.per_minute:
            return hits[0] + 60.0 - now
        hits.append(now)
        if len(self._hits) > 10_000:  # forget idle keys so addresses cannot grow the table forever
            self._hits = {k: v for k, v in self._hits.items() if v and v[-1] > now - 60.0}
        return None


class GateMiddleware:
    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state
        self.keys = [k.encode() for k in state.config.api_keys]
        self.limiter = RateLimiter(state.config.rate_limit) if state.config.rate_limit else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in EXEMPT_PATHS:
            await self.app(scope, receive, send)
            return
        token = _bearer(Headers(scope=scope).get("authorization", ""))
        if self.keys and not self._valid(token):
            await error_response(401, "Unauthorized: a valid API key is required "
                                      "(header 'Authorization: Bearer <key>').")(scope, receive, send)
            return
        unavailable = unavailable_reason(self.state, scope["path"])
        if unavailable:
            await error_response(503, unavailable, headers={"Retry-After": "5"})(scope, receive, send)
            return
        if self.limiter is not None:
            key = token or f"client:{(scope.get('client') or ('-',))[0]}"
            wait = self.limiter.retry_after(key)
            if wait is not None:
                seconds = max(1, math.ceil(wait))
                await error_response(
                    429, f"Rate limit exceeded: at most {self.limiter.per_minute} requests per minute per key; "
                         f"retry in {seconds} s.", headers={"Retry-After": str(seconds)})(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _valid(self, token: str) -> bool:
        given = token.encode()
        ok = False
        for key in self.keys:  # compare with every key, in constant time each: no early exit
            ok |= hmac.compare_digest(given, key)
        return ok

def _bearer(header: str) -> str:
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


# A body over the limit is still read, and dropped, up to this many bytes within this many seconds: HTTP
# clients send the whole body before they read the response, so answering early and closing would reset
# the connection and the client would never see the 413. Beyond these bounds the connection is closed.
DRAIN_MIN_BYTES = 64 * 2**20
DRAIN_TIMEOUT_S = 10.0


class BodyLimitMiddleware:
    """Buffers the body up to ``max_bytes`` and replays it; larger bodies get 413 once the rest of the body
    has been read and dropped (up to ``drain_bytes`` in total), so the client can read the answer."""

    def __init__(self, app: ASGIApp, max_bytes: int, drain_bytes: int | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.drain_bytes = drain_bytes if drain_bytes is not None else max(DRAIN_MIN_BYTES, 4 * max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            # With "Expect: 100-continue" the client waits for a go-ahead before sending: answer at once.
            if headers.get("expect", "").lower() != "100-continue" and int(declared) <= self.drain_bytes:
                await _drain(receive, self.drain_bytes)
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected while sending the body
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await _drain(receive, self.drain_bytes - size)
                await self._too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # afterwards: wait for the disconnect, as the real receive does

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await error_response(413, f"The request body is larger than the limit of {self.max_bytes} bytes "
                                  "(--max-body-size).", headers={"Connection": "close"})(scope, receive, send)


async def _drain(receive: Receive, budget: int) -> bool:
    """Read and drop the rest of the request body, at most ``budget`` bytes and DRAIN_TIMEOUT_S seconds;
    True when the body ended within those bounds."""

    async def drain() -> bool:
        left = budget
        while left > 0:
            message = await receive()
            if message["type"] != "http.request":
                return False
            left -= len(message.get("body", b""))
            if not message.get("more_body", False):
                return True
        return False

    try:
        return await asyncio.wait_for(drain(), DRAIN_TIMEOUT_S)
    except TimeoutError:
        return False
