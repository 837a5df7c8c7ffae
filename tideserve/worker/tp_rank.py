"""A tensor-parallel rank other than the driver: ``python -m tideserve.worker.tp_rank``.

The driver (rank 0, the engine's own process: worker/tp_executor.py) starts one of these per other rank
with the env:// variables set (worker/parallel_state.py). The rank loads the same checkpoint, keeps its
shard (model/tensor_parallel.py), builds the same ``Worker`` as the driver over it, and then runs every
collective call the driver sends, in the driver's order, answering when asked. So block ids mean the same
bytes on every rank, and the forward pass's collectives line up. The rank never samples.

A rank ends when the driver says so, when its connection to the driver breaks, or when its parent dies
(a watchdog thread), so a killed server leaves no rank behind. An error in a call the driver waits on is
sent back with the answer; an error in one it does not wait on ends the process, and the driver's next
collective then fails at once (instead of waiting for a timeout) and reports the rank's exit.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger("tideserve.worker.tp_rank")

PARENT_PID_ENV = "TIDESERVE_TP_PARENT_PID"
DEVICE_ENV = "TIDESERVE_TP_DEVICE"
THREADS_ENV = "TIDESERVE_TP_THREADS"


@dataclass
class RankSetup:
    """What every other rank builds its worker from (sent by the driver once the group is up)."""

    model_path: str
    dtype: str  # torch dtype name, e.g. "float32"
    kv_dtype: str
    block_size: int
    seed: int
    attention_backend: str = "auto"
    log_level: int = logging.INFO
    worker_extension_cls: str | None = None


@dataclass
class Call:
    """One collective call: ``method(worker, *args, **kwargs)``; ``reply``: the driver gathers answers."""

    method: str | Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    reply: bool = True


@dataclass
class Outcome:
    """A call's answer on one rank: its value, or the exception it raised."""

    value: Any = None
    error: BaseException | None = None

    @classmethod
    def of(cls, run: Callable[[], Any]) -> Outcome:
        try:
            return cls(run())
        except Exception as exc:  # noqa: BLE001 - carried back to the driver, which raises it
            return cls(error=exc)

    def portable(self) -> Outcome:
        """Itself, or (when it cannot be pickled) an error that says what it was."""
        try:
            pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)
            return self
        except Exception as exc:  # noqa: BLE001 - any pickling failure
            what = f"{type(self.error).__name__}: {self.error}" if self.error is not None else f"answer ({exc})"
            return Outcome(error=RuntimeError(f"a tensor-parallel rank could not send back its {what}"))


def build_worker(setup: RankSetup, group: Any, device: torch.device) -> Any:
    """This rank's worker over its shard of the checkpoint."""
    from tideserve.model.loader import load_model
    from tideserve.model.tensor_parallel import shard_model
    from tideserve.worker.worker import worker_class

    def load() -> torch.nn.Module:
        return shard_model(load_model(setup.model_path, setup.dtype, device, "none").model, group)

    torch.manual_seed(setup.seed)
    return worker_class(setup.worker_extension_cls)(load(), device, getattr(torch, setup.kv_dtype),
                                                    setup.attention_backend, rank=group.rank,
                                                    block_size=setup.block_size, reload=load)


def _die_with_parent(parent_pid: int) -> None:
    """Never outlive the driver: a watchdog exits once the process is re-parented. (Not prctl's
    PR_SET_PDEATHSIG: it fires when the *thread* that started the rank ends, and the server builds its
    engine on a loading thread that ends once the model is up.)"""
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="tideserve-tp-parent-watch", daemon=True).start()


def main() -> int:
    from tideserve.platform import platform_for
    from tideserve.worker.executor import bind
    from tideserve.worker.parallel_state import RendezvousInfo, TensorParallelGroup

    parent = os.environ.get(PARENT_PID_ENV)
    if parent:
        _die_with_parent(int(parent))
    info = RendezvousInfo.from_env()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {info.rank} %(levelname)s %(name)s: "
                                                   "%(message)s")
    if os.environ.get(THREADS_ENV):
        torch.set_num_threads(int(os.environ[THREADS_ENV]))
    platform = platform_for(os.environ.get(DEVICE_ENV, "cpu"))
    device = platform.device_for_rank(info.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = TensorParallelGroup(info, platform.distributed_backend, device)
    setup: RankSetup = group.receive()
    logging.getLogger().setLevel(setup.log_level)
    try:
        worker = build_worker(setup, group, device)
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which raises it
        logger.exception("rank %d could not start", info.rank)
        worker, error = None, f"{type(exc).__name__}: {exc}"
    group.gather(error)
    if worker is None:
        return 1
    with torch.inference_mode():
        while True:
            call: Call | None = group.receive()
            if call is None:
                return 0
            outcome = Outcome.of(lambda call=call: bind(worker, call.method)(*call.args, **call.kwargs))
            if call.reply:
                group.gather(outcome.portable())
            elif outcome.error is not None:
                raise outcome.error


if __name__ == "__main__":
    # Run the package's copy of this module, not ``__main__``: the answers this rank pickles back must name
    # classes the driver can find (tideserve.worker.tp_rank.Outcome).
    from tideserve.worker import tp_rank

    try:
        sys.exit(tp_rank.main())
    except Exception:  # a broken connection to the driver, or a failed call: exit, the driver reports it
        logger.exception("tensor-parallel rank stopped")
        os._exit(1)
