"""``tideserve serve`` as a real process: it answers /health once loaded, and on SIGTERM it stops
admitting (503), lets the in-flight request finish, and exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

LOAD_TIMEOUT = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def serve_process(smollm2_gguf_path, tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")  # closed below, after the process
    cmd = [sys.executable, "-m", "tideserve.cli", "serve", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "256", "--num-blocks", "64", "--max-num-seqs", "4", "--shutdown-timeout", "60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + LOAD_TIMEOUT
        while True:
            assert proc.poll() is None, f"server exited early:\n{_read(log)}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"server not healthy after {LOAD_TIMEOUT} s:\n{_read(log)}"
            time.sleep(0.25)
        yield proc, url, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()


def _read(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-4000:]


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
    assert proc.wait(30) == 0, _read(log)
    assert "draining" in _read(log)
