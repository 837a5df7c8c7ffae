"""The driver's side of tensor parallelism: start the ranks, and keep them in lockstep with the engine.

Why the driver is rank 0 (not a pure driver process): the engine's process already holds the scheduler,
the KV cache manager and the tokenizer, and on a small machine one process fewer is one fewer set of
threads fighting for cores. So the engine's own ``ModelRunner`` runs rank 0's shard, and the objects the
engine and the pool controller call are wrapped here:

- ``TensorParallelRunner``: every step (the scheduler's ``SchedulerOutput``, grammar matchers stripped,
  plus the tokens the driver sampled in the previous step), every compaction's block moves and every
  profiling pass is sent to the other ranks before rank 0 runs it;
- ``TensorParallelKVStorage``: creating the pool, resizing it (all ranks or none: a rank that cannot
  grow rolls every rank back), changing its block size and the swap tier's moves, on every rank;
- ``TensorParallelMemoryProbe``: the budget is the smallest rank's (each rank reports its probe; ranks
  that share one host's memory divide it).

A rank that exits is seen by a monitor thread and by the next collective (gloo fails as soon as a peer's
connection closes); from then on every call raises ``TensorParallelError`` naming the rank and its exit
status, so the engine loop dies, pending requests fail and the server's /health answers 503. Shutdown
(``close``, garbage collection or interpreter exit) stops every rank and waits for it, bounded.
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
from dataclasses import replace
from typing import Any

import torch

from tideserve.core.scheduler import SchedulerOutput
from tideserve.platform import platform_for
from tideserve.worker.kv_store import KVCacheStorage, KVStoreGrowError
from tideserve.worker.model_runner import ModelRunner, ModelRunnerOutput
from tideserve.worker.parallel_state import RENDEZVOUS_TIMEOUT_S, RendezvousInfo, TensorParallelGroup
from tideserve.worker.tp_worker import DEVICE_ENV, PARENT_PID_ENV, THREADS_ENV, WorkerSetup

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


class TensorParallelExecutor:
    """Starts ranks 1..N-1 as child processes, joins them (env://) and relays the driver's commands."""

    def __init__(self, world_size: int, device: torch.device, setup: WorkerSetup) -> None:
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
            self.procs.append(subprocess.Popen([sys.executable, "-m", "tideserve.worker.tp_worker"], env=env))
        self._finalizer = weakref.finalize(self, _Resources.release, self._resources)
        try:
            self.group = self._resources.group = self._join(RendezvousInfo(addr, port, world_size, 0), device)
            self.group.send(setup)
            errors = [e for e in self.group.gather(None)[1:] if e is not None]
            if errors:
                raise ValueError(f"a tensor-parallel rank could not load the model: {errors[0]}")
        except BaseException:
            self.close()
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

    # ----------------------------------------------------------------- commands
    def run(self, name: str, *args: Any, local: Any = None, reply: bool = False) -> Any:
        """Send ``name(*args)`` to the other ranks, run ``local()`` here; with ``reply``, gather every
        rank's answer (rank 0's is ``local()``'s) and return the list."""
        with self._guard():
            self.group.send((name, args))
            value = local() if local is not None else None
            return self.group.gather(value) if reply else value

    # ----------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Stop every rank (a shutdown message when they can take one, then SIGTERM/SIGKILL), bounded."""
        if self._closed:
            return
        self._closed = True
        group = getattr(self, "group", None)
        if group is not None and self._failure is None:
            with contextlib.suppress(Exception):
                group.send(("shutdown", ()))
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for proc in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.0, deadline - time.monotonic()))
        self._finalizer()  # SIGTERM / SIGKILL whatever is left, reap, drop the process groups
        self.group = None
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)


class TensorParallelRunner:
    """The engine's runner under tensor parallelism: rank 0's ``ModelRunner``, each step mirrored."""

    def __init__(self, local: ModelRunner, executor: TensorParallelExecutor) -> None:
        self._local = local
        self._executor = executor
        self._sampled: dict[str, int] = {}  # the last step's tokens, sent to the ranks with the next one
        self.kv_storage = TensorParallelKVStorage(local.kv_storage, executor)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._local, name)

    @property
    def structured_output(self) -> Any:
        return self._local.structured_output

    @structured_output.setter
    def structured_output(self, value: Any) -> None:
        self._local.structured_output = value

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        message = replace(out, new_requests=[replace(n, structured_output=None) for n in out.new_requests])
        result = self._executor.run("execute", message, self._sampled, local=lambda: self._local.execute(out))
        self._sampled = {rid: s.token_id for rid, s in result.sampled.items()}
        return result

    def apply_moves(self, moves: list[tuple[int, int]]) -> None:
        if moves:
            self._executor.run("apply_moves", moves, local=lambda: self._local.apply_moves(moves))

    def forget_finished(self) -> None:
        self._executor.run("forget_finished", local=self._local.forget_finished)

    def profile_activation_bytes(self, num_tokens: int, max_num_seqs: int) -> int:
        """Every rank measures its own peak; the budget takes the largest."""
        peaks = self._executor.run("profile", num_tokens, max_num_seqs, reply=True,
                                   local=lambda: self._local.profile_activation_bytes(num_tokens, max_num_seqs))
        return max(peaks)


class TensorParallelKVStorage:
    """Rank 0's ``KVCacheStorage``; every change of the pool's geometry happens on every rank."""

    def __init__(self, local: KVCacheStorage, executor: TensorParallelExecutor) -> None:
        self._local = local
        self._executor = executor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._local, name)

    def create_store(self, num_blocks: int, reserve_bytes: int, static: bool) -> None:
        self._executor.run("create_store", num_blocks, reserve_bytes, static,
                           local=lambda: self._local.create_store(num_blocks, reserve_bytes, static))

    def resize(self, num_blocks: int) -> None:
        """All ranks resize or none does: when one cannot get the memory, the others go back."""
        before = self._local.num_blocks
        errors = self._executor.run("resize", num_blocks, reply=True, local=lambda: self._try_resize(num_blocks))
        failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
        if not failed:
            return
        self._executor.run("resize", before, reply=True, local=lambda: self._try_resize(before))
        rank, error = failed[0]
        raise KVStoreGrowError(f"rank {rank}: {error}")

    def _try_resize(self, num_blocks: int) -> str | None:
        if self._local.num_blocks == num_blocks:
            return None
        try:
            self._local.resize(num_blocks)
        except KVStoreGrowError as exc:
            return str(exc)
        return None

    def change_block_size(self, new_block_size: int) -> int:
        return self._executor.run("change_block_size", new_block_size,
                                  local=lambda: self._local.change_block_size(new_block_size))

    def allocate_swap(self, num_swap_blocks: int) -> None:
        self._executor.run("allocate_swap", num_swap_blocks,
                           local=lambda: self._local.allocate_swap(num_swap_blocks))

    def release_idle_swap(self) -> None:
        self._executor.run("release_idle_swap", local=self._local.release_idle_swap)


class TensorParallelMemoryProbe:
    """The smallest rank's answer (core's ``MemoryProbe``), in rank 0's units.

    The pool has one block count on every rank, but a rank's block may hold more KV heads than another's
    (uneven KV-head splits), so each rank's answer is scaled by rank 0's bytes per block over its own;
    ranks on one host share its memory, so there each gets its share in proportion to its bytes per
    block (for equal shards: the host's memory divided by the number of ranks on it).
    """

    def __init__(self, local: Any, executor: TensorParallelExecutor, token_bytes: int) -> None:
        self._local = local
        self._executor = executor
        self._token_bytes = token_bytes  # rank 0's KV bytes per token
        self._total: int | None = None

    def _ask(self) -> tuple[int, int]:
        here = os.uname().nodename
        answers = self._executor.run(
            "probe", reply=True,
            local=lambda: (here, self._local.available_bytes(), self._local.total_bytes(), self._token_bytes))
        shared = self._executor.platform.host_memory
        local_bytes = sum(b for host, _, _, b in answers if host == here)
        available, total = [], []
        for host, avail, tot, kv_bytes in answers:
            per = local_bytes if shared and host == here else kv_bytes
            available.append(avail * self._token_bytes // per)
            total.append(tot * self._token_bytes // per)
        return min(available), min(total)

    def available_bytes(self) -> int:
        available, self._total = self._ask()
        return available

    def total_bytes(self) -> int:
        if self._total is None:
            self._total = self._ask()[1]
        return self._total

    def used_by_process_bytes(self) -> int:
        return self._local.used_by_process_bytes()

    def describe(self) -> str:
        describe = getattr(self._local, "describe", None)
        what = describe() if describe is not None else type(self._local).__name__
        return (f"{what}; tensor parallel over {self._executor.world_size} ranks: the smallest rank's answer, "
                "host memory shared among its ranks by their KV bytes per block")
