"""Start ``tideserve serve`` as a subprocess for tests that need a real process (signals, child ranks)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import IO

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(log: IO[str]) -> str:
    """The last 4,000 characters the server wrote (for assertion messages)."""
    log.flush()
    log.seek(0)
    return log.read()[-4000:]


def start_serve(args: list[str], log: IO[str], env: dict[str, str], load_timeout: float
                ) -> tuple[subprocess.Popen, str]:
    """(process, base url) of ``tideserve serve <args>`` on a free port, once /health answers 200; the caller
    stops it. Fails with the server's log if it exits or is not healthy within ``load_timeout`` seconds."""
    port = free_port()
    cmd = [sys.executable, "-m", "tideserve.cli", "serve", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + load_timeout
    try:
        while True:
            assert proc.poll() is None, f"server exited early:\n{log_tail(log)}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"server not healthy after {load_timeout} s:\n{log_tail(log)}"
            time.sleep(0.25)
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
