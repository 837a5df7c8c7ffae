"""Sleep mode over HTTP (vLLM's routes): /sleep, /wake_up, /is_sleeping; while asleep /health/live stays
200, /health/ready and every request answer 503 naming sleep, and the metrics say so; a sleep with a
request in flight is a 409; woken, the server answers as before."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tideserve.serve.config import ServerConfig
from tideserve.serve.openai.server import build_app

pytestmark = pytest.mark.slow  # the model end to end for seconds: `make test` runs it, `-m 'not slow'` does not

BODY = {"prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def server(make_engine, server_thread):
    with server_thread(build_app(ServerConfig(), engine=make_engine(enable_sleep_mode=True))) as s:
        yield s


def metric(http: httpx.Client, name: str) -> float:
    line = next(line for line in http.get("/metrics").text.splitlines() if line.startswith(name + "{"))
    return float(line.rpartition(" ")[2])


def test_sleep_and_wake_over_http(http, model):
    want = http.post("/v1/completions", json={"model": model, **BODY}).json()["choices"][0]["text"]
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert http.post("/sleep", params={"level": 2}).json() == {"is_sleeping": True, "level": 2}
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    assert http.get("/health/live").status_code == 200
    ready = http.get("/health/ready")
    assert ready.status_code == 503 and "asleep (sleep level 2)" in ready.json()["error"]["message"]
    refused = http.post("/v1/completions", json={"model": model, **BODY})
    assert refused.status_code == 503 and "POST /wake_up" in refused.json()["error"]["message"]
    assert metric(http, "vllm:engine_sleep_state") == 2
    assert http.post("/wake_up", params={"tags": "weights"}).json() == {"is_sleeping": True}  # the KV pool waits
    assert http.post("/wake_up", params={"tags": "kv_cache"}).json() == {"is_sleeping": False}
    assert http.get("/health/ready").status_code == 200 and metric(http, "vllm:engine_sleep_state") == 0
    assert http.post("/v1/completions", json={"model": model, **BODY}).json()["choices"][0]["text"] == want


def test_a_sleep_with_a_request_in_flight_is_refused(http, model, server):
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
    done = threading.Event()

    def long_request() -> None:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            c.post("/v1/completions", json=body)
        done.set()

    threading.Thread(target=long_request, daemon=True).start()
    deadline = time.monotonic() + 30
    while server.state.engine.num_active() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    refused = http.post("/sleep", params={"level": 1})
    assert refused.status_code == 409 and "in flight" in refused.json()["error"]["message"]
    assert done.wait(120)
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}


def test_bad_sleep_parameters(http):
    bad = http.post("/sleep", params={"level": 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "level"
    bad = http.post("/wake_up", params={"tags": "gpu"})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("tags")


def test_sleep_routes_name_the_flag_when_sleep_mode_is_off(shared_engine, server_thread):
    with server_thread(build_app(ServerConfig(), engine=shared_engine)) as s, httpx.Client(base_url=s.url) as c:
        refused = c.post("/sleep")
        assert refused.status_code == 400 and "--enable-sleep-mode" in refused.json()["error"]["message"]
        assert c.get("/is_sleeping").json() == {"is_sleeping": False}
