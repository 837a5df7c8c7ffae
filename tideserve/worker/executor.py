"""How the engine reaches its workers: one call, ``collective_rpc(method, *args)``, run on every rank.

The shape of vLLM's executor (and of nano-vllm's ``ModelRunner.call``): an operation on the weights or the
KV storage is one ``Worker`` method, and the executor runs it on each rank with the same arguments, rank 0
(the engine's own process) included. ``UniprocExecutor`` holds the one worker of a single-process engine
and calls it directly; ``TensorParallelExecutor`` (worker/tp_executor.py) sends the call to the other
ranks' processes first, runs it on its own worker, and gathers the answers.

``method`` is a ``Worker`` function (``Worker.resize_kv_cache``: checked by the type checker, renamed with
the code) or the name of a worker method, such as one a ``worker_extension_cls`` adds; it is called as
``method(worker, *args, **kwargs)``. With ``unique_reply_rank`` only that rank's answer comes back, and
no other rank is waited for (a step's output: only rank 0 samples). Otherwise every rank's answer comes
back in rank order; an exception on any rank is raised after every rank has answered, so the ranks stay
in step for the next call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from tideserve.worker.worker import Worker

Method = str | Callable[..., Any]


def bind(worker: Worker, method: Method) -> Callable[..., Any]:
    """``method`` as a callable on ``worker``: a function takes the worker first, a name is looked up."""
    if isinstance(method, str):
        try:
            return getattr(worker, method)
        except AttributeError:
            raise ValueError(f"the worker has no method {method!r}: a method a collective call names must be "
                             "defined on Worker or on the worker_extension_cls class.") from None
    return lambda *args, **kwargs: method(worker, *args, **kwargs)


class Executor(ABC):
    """The engine's only way to its workers (see the module docstring)."""

    world_size: int
    driver_worker: Worker  # rank 0's worker, in the engine's process: for inspection, never for operations

    @abstractmethod
    def collective_rpc(self, method: Method, *args: Any, kwargs: dict[str, Any] | None = None,
                       unique_reply_rank: int | None = None) -> Any:
        """Run ``method`` on every rank; every rank's answer in rank order, or only ``unique_reply_rank``'s."""

    def check_health(self) -> None:
        """Raise when a rank is gone (the engine cannot run another step); nothing to check in-process."""
        return None

    def shutdown(self) -> None:
        """Stop the workers' processes, if any; the executor is unusable afterwards."""
        return None


class UniprocExecutor(Executor):
    """One process, one worker: a collective call is a plain call."""

    world_size = 1

    def __init__(self, worker: Worker) -> None:
        self.driver_worker = worker

    def collective_rpc(self, method: Method, *args: Any, kwargs: dict[str, Any] | None = None,
                       unique_reply_rank: int | None = None) -> Any:
        if unique_reply_rank not in (None, 0):
            raise ValueError(f"unique_reply_rank={unique_reply_rank} is not a rank of a single-process engine.")
        result = bind(self.driver_worker, method)(*args, **(kwargs or {}))
        return result if unique_reply_rank is not None else [result]
