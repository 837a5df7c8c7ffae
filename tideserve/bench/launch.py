"""Start a server under test as a subprocess on a free loopback port, and always stop it.

The comparison script starts ``tideserve serve`` and ``llama-server`` this way, and the live-server tests
reuse it, so every server is measured after the same readiness rule and never outlives its run.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx

logger = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``with ServerProcess(cmd, port) as srv:`` runs ``cmd`` until the block ends.

    Ready means ``GET ready_path`` answered 200 (``/v1/models`` by default: every OpenAI-compatible
    server has it). Output goes to a log file whose tail is quoted when the server dies or times out.
    """

    def __init__(self, cmd: Sequence[str], port: int, *, env: dict[str, str] | None = None,
                 ready_path: str = "/v1/models", ready_timeout_s: float = 300.0,
                 name: str = "server") -> None:
        self.cmd = list(cmd)
        self.port = port
        self.env = {**os.environ, **(env or {})}
        self.ready_path = ready_path
        self.ready_timeout_s = ready_timeout_s
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def __enter__(self) -> Self:
        fd, name = tempfile.mkstemp(prefix=f"{self.name}-", suffix=".log")
        self.log_path = Path(name)
        logger.info("starting %s: %s (log %s)", self.name, " ".join(self.cmd), name)
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        url = self.base_url + self.ready_path
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code, tail = self.proc.returncode, self.log_tail()
                raise RuntimeError(f"{self.name} exited with code {code} before it was ready:\n{tail}")
            try:
                if httpx.get(url, timeout=2.0, trust_env=False).status_code == 200:
                    logger.info("%s is ready at %s", self.name, self.base_url)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} was not ready at {url} within {self.ready_timeout_s:.0f}s:\n"
                           f"{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s: the process we started, nothing else."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
