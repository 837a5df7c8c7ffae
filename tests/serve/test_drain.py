"""``tideserve serve`` as a real process: it answers /health once loaded, and on SIGTERM it stops
admitting (503), lets the in-flight request finish, and exits 0."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from serve_process import log_tail, start_serve

pytestmark = pytest.mark.slow  # starts processes: run by `make test`, skipped by `-m "not slow"`

LOAD_TIMEOUT = 120.0


@pytest.fixture
def serve_process(smollm2_gguf_path, tmp_path):
    log = open(tmp_path / "serve.log", "w+")  # closed below, after the process
    proc, url = start_serve(["--dtype", "float32", "--max-model-len", "256", "--num-blocks", "64", "--max-num-seqs",
                             "4", "--shutdown-timeout", "60"], log, {**os.environ, "OMP_NUM_THREADS": "1"},
                            LOAD_TIMEOUT)
    try:
        yield proc, url, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()


def test_sigterm_drains_in_flight_requests(serve_process):
    proc, url, log = serve_process
    body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=url, timeout=60) as http, http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        proc.send_signal(signal.SIGTERM)
        # Draining: the listener stays open and new work is refused with 503.
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "health never turned 503"
            time.sleep(0.05)
        refused = httpx.post(url + "/v1/completions", json={"prompt": "Hi"}, timeout=5)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        # The in-flight request runs to completion.
        events = [first] + [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 24
    assert proc.wait(30) == 0, log_tail(log)
    assert "draining" in log_tail(log)
