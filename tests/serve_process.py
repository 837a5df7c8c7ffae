"""Start ``tideserve serve`` as a subprocess for tests that need a real process (signals, child ranks)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

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


@contextmanager
def serving_openai(args: list[str], log_dir: Path, load_timeout: float = 180) -> Iterator[tuple[Any, str, IO[str]]]:
    """(openai client, base url, log) of ``tideserve serve <args>`` as a module fixture holds it: started, and
    stopped on exit, its log kept in ``log_dir`` for the tests to read."""
    import openai

    log = (log_dir / "serve.log").open("w+")
    proc, url = start_serve(args, log, dict(os.environ), load_timeout=load_timeout)
    try:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120, max_retries=0), url, log
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
