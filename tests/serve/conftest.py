"""Fixtures for the server tests: one loaded model per session, engines built on it, and uvicorn servers
on free loopback ports running in threads (one per module where possible: the model takes ~10 s to load).

Every wait here is bounded, so a broken server fails a test instead of hanging the run.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Self

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

MAX_MODEL_LEN = 512


@pytest.fixture(scope="session")
def make_engine(shared_model) -> Iterator[Callable[..., object]]:
    """Build AsyncEngines over the shared model (float32, small pool); all are shut down at the end."""
    from tideserve.engine.async_engine import AsyncEngine
    from tideserve.engine.llm_engine import EngineArgs

    engines = []

    def make(max_queue: int | None = None, **kwargs) -> AsyncEngine:
        args = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "num_blocks": 256, "max_num_seqs": 32,
                **kwargs}
        args = EngineArgs(**args)
        engine = AsyncEngine.from_loaded(args, *shared_model(args), max_queue=max_queue)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown(timeout=5)


@pytest.fixture(scope="session")
def shared_engine(make_engine):
    """The engine most server tests share (requests from different tests never overlap)."""
    return make_engine()


class ServerThread:
    """A uvicorn server for ``app`` on a free loopback port, in a daemon thread."""

    def __init__(self, app) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        config = uvicorn.Config(app, log_config=None, access_log=False, log_level="warning",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def state(self):
        return self.app.state.tideserve

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="session")
def server_thread() -> type[ServerThread]:
    return ServerThread


def _wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="session")
def wait_until() -> Callable[..., None]:
    """``wait_until(predicate, timeout=10, what=...)``: poll until true, fail after the timeout."""
    return _wait_until


@pytest.fixture(scope="session")
def hermes_server(shared_engine):
    """A server run as ``--enable-auto-tool-choice --tool-call-parser hermes`` over the shared engine
    (tool_choice "auto" parses ``<tool_call>`` blocks); shared by every test that needs the flags."""
    from tideserve.serve.config import ServerConfig
    from tideserve.serve.openai.server import build_app

    config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with ServerThread(build_app(config, engine=shared_engine)) as s:
        yield s


# Per-module clients of a per-module server on the shared engine: a module that needs another server
# configuration defines its own ``server`` fixture, and these follow it. A module's TIMEOUT, if it has
# one, bounds its clients' calls.
def _timeout(request: pytest.FixtureRequest) -> float:
    return float(getattr(request.module, "TIMEOUT", 60.0))


@pytest.fixture(scope="module")
def server(shared_engine, server_thread):
    from tideserve.serve.config import ServerConfig
    from tideserve.serve.openai.server import build_app

    with server_thread(build_app(ServerConfig(), engine=shared_engine)) as s:
        yield s


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.state.model_name


@pytest.fixture(scope="module")
def client(server, request):
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0, timeout=_timeout(request)) as c:
        yield c


@pytest.fixture(scope="module")
def http(server, request):
    import httpx

    with httpx.Client(base_url=server.url, timeout=_timeout(request)) as c:
        yield c
