"""Tensor parallelism's executor: start the other ranks, and run every collective call on all of them.

Why the driver is rank 0 (not a pure driver process): the engine's process already holds the scheduler,
the KV cache manager and the tokenizer, and on a small machine one process fewer is one fewer set of
threads fighting for cores. So the engine's own process holds rank 0's ``Worker``, and each other rank
is a process of its own running the same ``Worker`` over its shard (worker/tp_rank.py). A collective
call is pickled to the other ranks over the control channel, run on rank 0's worker, and, unless only
rank 0's answer is wanted, the answers are gathered; an exception on any rank comes back with the
answers and is raised once every rank has answered.

A rank that exits is seen by a monitor thread and by the next collective (gloo fails as soon as a peer's
connection closes); from then on every call raises ``TensorParallelError`` naming the rank and its exit
status, so the engine loop dies, pending requests fail and the server's /health answers 503. Shutdown
(``shutdown``, garbage collection or interpreter exit) stops every rank and waits for it, bounded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from tideserve.platform import platform_for
from tideserve.worker.executor import Executor, Method, bind
from tideserve.worker.parallel_state import RENDEZVOUS_TIMEOUT_S, RendezvousInfo, TensorParallelGroup
from tideserve.worker.tp_rank import DEVICE_ENV, PARENT_PID_ENV, THREADS_ENV, Call, Outcome, RankSetup
from tideserve.worker.worker import Worker

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0
MONITOR_INTERVAL_S = 0.2


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the engine cannot run another step."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Resources:
    """What must be released even if the executor is never closed (garbage collection, interpreter exit):
    the rank processes, and the process groups, whose C++ side must go while the interpreter still runs."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.group: TensorParallelGroup | None = None

    def release(self) -> None:
        _stop_processes(self.procs)
        group, self.group = self.group, None
        if group is not None:
            group.close()


def _stop_processes(procs: list[subprocess.Popen], timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, then SIGKILL after ``timeout``: every rank is reaped, none outlives the engine."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout)


class TensorParallelExecutor(Executor):
    """Starts ranks 1..N-1 as child processes, joins them (env://), builds rank 0's worker in this process
    (``make_driver`` gets the joined group: the driver shards its model over it), and runs collective
    calls on every rank."""

    def __init__(self, world_size: int, device: torch.device, setup: RankSetup,
                 make_driver: Callable[[TensorParallelGroup], Worker]) -> None:
        self.world_size = world_size
        self.platform = platform_for(device)
        self._failure: TensorParallelError | None = None
        self._closed = False
        self._saved_threads: int | None = None
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT") or _free_port())
        threads = None
        if self.platform.computes_on_host:  # ranks share the host's cores
            threads = max(1, (os.cpu_count() or 1) // world_size)
            self._saved_threads = torch.get_num_threads()
            torch.set_num_threads(threads)
        self._resources = _Resources()
        self.procs = self._resources.procs
        base_env = {**os.environ, DEVICE_ENV: device.type, PARENT_PID_ENV: str(os.getpid())}
        if threads is not None:
            base_env[THREADS_ENV] = str(threads)
        for rank in range(1, world_size):
            env = {**base_env, **RendezvousInfo(addr, port, world_size, rank).env()}
            self.procs.append(subprocess.Popen([sys.executable, "-m", "tideserve.worker.tp_rank"], env=env))
        self._finalizer = weakref.finalize(self, _Resources.release, self._resources)
        try:
            self.group = self._resources.group = self._join(RendezvousInfo(addr, port, world_size, 0), device)
            self.group.send(setup)
            driver_error = None
            try:
                self.driver_worker = make_driver(self.group)
            except Exception as exc:  # the others still report before this one is raised
                driver_error = exc
            errors = [e for e in self.group.gather(None)[1:] if e is not None]
            if driver_error is not None:
                raise driver_error
            if errors:
                raise ValueError(f"a tensor-parallel rank could not load the model: {errors[0]}")
        except BaseException:
            self.shutdown()
            raise
        self._monitor = threading.Thread(target=self._watch, name="tideserve-tp-monitor", daemon=True)
        self._monitor.start()
        logger.info("tensor parallel: %d ranks (%s), driver is rank 0, workers pids %s%s", world_size,
                    self.platform.distributed_backend, [p.pid for p in self.procs],
                    f", {threads} threads each" if threads else "")

    def _join(self, info: RendezvousInfo, device: torch.device) -> TensorParallelGroup:
        """Build the groups on a thread, so a rank that dies while starting fails the start at once."""
        result: list[Any] = []
        thread = threading.Thread(target=lambda: result.append(self._try_group(info, device)), daemon=True)
        thread.start()
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
        while thread.is_alive():
            thread.join(MONITOR_INTERVAL_S)
            dead = self._dead_rank()
            if dead is not None:
                raise TensorParallelError(f"{dead} while starting")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"the tensor-parallel ranks did not join within {RENDEZVOUS_TIMEOUT_S:.0f} s")
        if isinstance(result[0], BaseException):
            raise TensorParallelError(f"the tensor-parallel ranks could not join: {result[0]}") from result[0]
        return result[0]

    def _try_group(self, info: RendezvousInfo, device: torch.device) -> TensorParallelGroup | BaseException:
        try:
            return TensorParallelGroup(info, self.platform.distributed_backend, device)
        except BaseException as exc:  # noqa: BLE001 - handed to the joining thread
            return exc

    # ----------------------------------------------------------------- health
    def _dead_rank(self) -> str | None:
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                return f"tensor-parallel rank {rank} (pid {proc.pid}) {_describe_exit(code)}"
        return None

    def _watch(self) -> None:
        while not self._closed and self._failure is None:
            dead = self._dead_rank()
            if dead is not None:
                self._fail(dead)
                return
            time.sleep(MONITOR_INTERVAL_S)

    def _fail(self, what: str) -> TensorParallelError:
        if self._failure is None:
            self._failure = TensorParallelError(
                f"{what}; the engine cannot run without every rank, so pending requests fail: restart it")
            logger.error("%s", self._failure)
        return self._failure

    def check_alive(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise TensorParallelError("the tensor-parallel ranks are shut down")

    @contextlib.contextmanager
    def _guard(self):
        """A collective that fails means a rank is gone: name it (the monitor may need a moment)."""
        self.check_alive()
        try:
            yield
        except TensorParallelError:
            raise
        except RuntimeError as exc:
            deadline = time.monotonic() + 2.0
            dead = self._dead_rank()
            while dead is None and time.monotonic() < deadline:
                time.sleep(0.05)
                dead = self._dead_rank()
            raise self._fail(dead or f"a tensor-parallel collective failed ({exc})") from exc

    def check_health(self) -> None:
        self.check_alive()

    # ----------------------------------------------------------------- collective calls
    def collective_rpc(self, method: Method, *args: Any, kwargs: dict[str, Any] | None = None,
                       unique_reply_rank: int | None = None) -> Any:
        if unique_reply_rank not in (None, 0):
            raise ValueError(f"unique_reply_rank={unique_reply_rank}: only rank 0 answers alone (it is the one "
                             "in the engine's process).")
        reply = unique_reply_rank is None
        kwargs = kwargs or {}
        with self._guard():  # a failed send or gather means a rank is gone; the method's own errors pass
            self.group.send(Call(method, args, kwargs, reply))
            local = Outcome.of(lambda: bind(self.driver_worker, method)(*args, **kwargs))
            outcomes: list[Outcome] = self.group.gather(None) if reply else [local]
        outcomes[0] = local
        for rank, outcome in enumerate(outcomes):
            if outcome.error is not None:
                if rank:
                    outcome.error.add_note(f"raised on tensor-parallel rank {rank}")
                raise outcome.error
        return [outcome.value for outcome in outcomes] if reply else local.value

    # ----------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Stop every rank (a shutdown message when they can take one, then SIGTERM/SIGKILL), bounded."""
        if self._closed:
            return
        self._closed = True
        group = getattr(self, "group", None)
        if group is not None and self._failure is None:
            with contextlib.suppress(Exception):
                group.send(None)  # no more calls
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for proc in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.0, deadline - time.monotonic()))
        self._finalizer()  # SIGTERM / SIGKILL whatever is left, reap, drop the process groups
        self.group = None
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)
