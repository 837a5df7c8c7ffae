"""Orchestrator probes and router load signals (tideserve/serve/openai/probes.py), over HTTP.

Liveness stays 200 through a long load and through a drain (so Kubernetes never kills a pod for either)
and turns 503 only when the engine is dead; readiness is 200 only while the server takes traffic; /load
and /get_load count the API requests in flight. None of them needs the API key."""

from __future__ import annotations

import threading

import httpx
import pytest
from starlette.testclient import TestClient

from tideserve.serve.config import ServerConfig
from tideserve.serve.openai.server import build_app

TIMEOUT = 60.0


def error_message(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == status and set(err) == {"message", "type", "param", "code"}
    return err["message"]


def test_a_long_load_is_alive_but_not_ready(make_engine, wait_until):
    release = threading.Event()

    def load():
        assert release.wait(30)
        return make_engine(num_blocks=32, max_num_seqs=1)

    with TestClient(build_app(ServerConfig(), engine_factory=load)) as c:
        live = c.get("/health/live")
        assert live.status_code == 200 and live.json() == {"status": "alive", "phase": "loading"}
        assert "still loading" in error_message(c.get("/health/ready"), 503)
        assert c.get("/health/ready").headers["retry-after"] == "5"
        assert c.get("/health").status_code == 503  # unchanged: vLLM's /health
        release.set()
        wait_until(lambda: c.get("/health/ready").status_code == 200, 30, "the model to load")
        assert c.get("/health/ready").json() == {"status": "ready"}
        assert c.get("/health/live").json()["phase"] == "serving"
        health = c.get("/health")
        assert health.status_code == 200 and health.content == b""


def test_a_failed_load_is_not_alive(wait_until):
    def load():
        raise ValueError("model file is corrupt")

    with TestClient(build_app(ServerConfig(), engine_factory=load)) as c:
        wait_until(lambda: c.app.state.tideserve.load_error is not None, 10, "the load to fail")
        assert "model file is corrupt" in error_message(c.get("/health/live"), 503)
        assert "model file is corrupt" in error_message(c.get("/health/ready"), 503)


@pytest.fixture(scope="module")
def keyed_server(shared_engine, server_thread):
    """A server that requires an API key: probes and load routes must still answer without one."""
    with server_thread(build_app(ServerConfig(api_keys=("sk-test",)), engine=shared_engine)) as s:
        yield s


def test_probes_and_load_need_no_api_key(keyed_server):
    with httpx.Client(base_url=keyed_server.url, timeout=TIMEOUT) as http:
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 401
        assert http.get("/health/live").status_code == 200
        assert http.get("/health/ready").status_code == 200
        assert http.get("/load").json() == {"server_load": 0}
        assert http.get("/get_load").json() == {"load": 0}


def test_load_counts_requests_in_flight(keyed_server, wait_until):
    headers = {"Authorization": "Bearer sk-test"}
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=keyed_server.url, timeout=TIMEOUT) as http:
        with http.stream("POST", "/v1/completions", json=body, headers=headers) as one, \
                http.stream("POST", "/v1/completions", json=body, headers=headers) as two:
            lines = [one.iter_lines(), two.iter_lines()]  # kept: a dropped iterator closes its stream
            assert all(next(it).startswith("data: ") for it in lines)
            assert http.get("/load").json() == {"server_load": 2}
            assert http.get("/get_load").json() == {"load": 2}
        # Closing the streams aborts both requests.
        wait_until(lambda: http.get("/get_load").json() == {"load": 0}, 10, "the load to drop to 0")
        assert http.get("/load").json() == {"server_load": 0}


def test_draining_is_alive_but_not_ready(keyed_server):
    state = keyed_server.state
    with httpx.Client(base_url=keyed_server.url, timeout=TIMEOUT) as http:
        state.draining = True  # what SIGTERM sets (tests/serve/test_drain.py drives the real signal)
        try:
            assert http.get("/health/live").json() == {"status": "alive", "phase": "draining"}
            assert "shutting down" in error_message(http.get("/health/ready"), 503)
        finally:
            state.draining = False
        assert http.get("/health/ready").status_code == 200


def test_a_dead_engine_is_not_alive(make_engine, server_thread, wait_until):
    engine = make_engine(max_num_seqs=1, num_blocks=32)
    with server_thread(build_app(ServerConfig(), engine=engine)) as s, \
            httpx.Client(base_url=s.url, timeout=TIMEOUT) as http:
        assert http.get("/health/live").status_code == 200

        def broken_step():
            raise RuntimeError("simulated device failure")

        engine.engine.step = broken_step
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
        assert r.status_code == 503
        wait_until(lambda: not engine.is_healthy, 5, "the engine to be marked dead")
        assert "simulated device failure" in error_message(http.get("/health/live"), 503)
        assert "simulated device failure" in error_message(http.get("/health/ready"), 503)
