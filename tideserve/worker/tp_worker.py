"""A tensor-parallel rank other than the driver: ``python -m tideserve.worker.tp_worker``.

The driver (rank 0, the engine's own process) starts one of these per other rank with the env://
variables set (worker/parallel_state.py). The rank loads the same checkpoint, keeps its shard
(model/tensor_parallel.py), builds its own ``KVCacheStorage`` over its KV heads and a ``ModelRunner``, then
repeats what the driver tells it, in the driver's order: each step's ``SchedulerOutput`` (plus the tokens
the driver sampled in the previous step) and every move of the KV storage (create, resize, compaction
copies, block-size change, swap tier). So block ids mean the same bytes on every rank, and the forward
pass's collectives line up. The rank never samples.

A rank ends when the driver says so, when its connection to the driver breaks, or when its parent dies
(a watchdog thread), so a killed server leaves no rank behind. Any
error inside a command ends the process: the driver's next collective then fails at once (instead of
waiting for a timeout) and the driver reports the rank's exit.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger("tideserve.worker.tp_worker")

PARENT_PID_ENV = "TIDESERVE_TP_PARENT_PID"
DEVICE_ENV = "TIDESERVE_TP_DEVICE"
THREADS_ENV = "TIDESERVE_TP_THREADS"


@dataclass
class WorkerSetup:
    """What every rank builds from (sent by the driver once the group is up)."""

    model_path: str
    dtype: str  # torch dtype name, e.g. "float32"
    kv_dtype: str
    block_size: int
    seed: int
    attention_backend: str = "auto"
    log_level: int = logging.INFO


class TensorParallelWorker:
    """One rank's model shard, KV storage and runner, and the commands the driver sends it."""

    def __init__(self, group: Any, setup: WorkerSetup, device: torch.device) -> None:
        from tideserve.model.loader import load_model
        from tideserve.model.tensor_parallel import shard_model
        from tideserve.worker.kv_store import KVCacheStorage, KVLayout
        from tideserve.worker.model_runner import ModelRunner

        torch.manual_seed(setup.seed)
        loaded = load_model(setup.model_path, setup.dtype, device, "none")
        model = shard_model(loaded.model, group)
        del loaded
        arch = model.arch  # the part's own: its KV heads are the ones this rank caches
        layout = KVLayout(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim,
                          getattr(torch, setup.kv_dtype))
        self.group = group
        self.storage = KVCacheStorage(layout, device, setup.block_size)
        self.runner = ModelRunner(model, self.storage, device, setup.attention_backend)
        self.runner.samples = False

    # ----------------------------------------------------------------- commands (names match the driver's)
    def execute(self, out: Any, sampled: dict[str, int]) -> None:
        for request_id, token in sampled.items():  # what the driver sampled in the previous step
            state = self.runner.requests.get(request_id)
            if state is not None:
                state.token_ids.append(token)
        self.runner.execute(out)

    def apply_moves(self, moves: list[tuple[int, int]]) -> None:
        self.runner.apply_moves(moves)

    def forget_finished(self) -> None:
        self.runner.forget_finished()

    def profile(self, num_tokens: int, max_num_seqs: int) -> None:
        self.group.gather(self.runner.profile_activation_bytes(num_tokens, max_num_seqs))

    def create_store(self, num_blocks: int, reserve_bytes: int, static: bool) -> None:
        self.storage.create_store(num_blocks, reserve_bytes, static)

    def resize(self, num_blocks: int) -> None:
        try:
            self.storage.resize(num_blocks)
            error = None
        except RuntimeError as exc:  # KVStoreGrowError: reported, the driver rolls every rank back
            error = str(exc)
        self.group.gather(error)

    def change_block_size(self, block_size: int) -> None:
        self.storage.change_block_size(block_size)

    def allocate_swap(self, num_blocks: int) -> None:
        self.storage.allocate_swap(num_blocks)

    def release_idle_swap(self) -> None:
        self.storage.release_idle_swap()

    def release_freed_memory(self) -> None:
        self.runner.platform.release_freed_memory()

    def probe(self) -> None:
        platform = self.runner.platform
        self.group.gather((os.uname().nodename, platform.available_bytes(), platform.total_bytes(),
                           self.storage.layout.token_bytes))


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
    setup: WorkerSetup = group.receive()
    logging.getLogger().setLevel(setup.log_level)
    try:
        worker = TensorParallelWorker(group, setup, device)
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which raises it
        logger.exception("rank %d could not start", info.rank)
        worker, error = None, f"{type(exc).__name__}: {exc}"
    group.gather(error)
    if worker is None:
        return 1
    with torch.inference_mode():
        while True:
            name, args = group.receive()
            if name == "shutdown":
                return 0
            getattr(worker, name)(*args)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # a broken connection to the driver, or a failed command: exit, the driver reports it
        logger.exception("tensor-parallel rank stopped")
        os._exit(1)
