"""The ranks of one tensor-parallel engine, joined through ``torch.distributed`` (env:// rendezvous).

Every rank reads ``MASTER_ADDR``/``MASTER_PORT``, ``WORLD_SIZE`` and ``RANK`` from its environment, as
torchrun's ranks do; rank 0 (the driver, which also runs the scheduler) hosts the TCP store, so ranks may
live on other machines. Two process groups are built over that store, owned by the engine rather than
registered as torch's process-wide default group (so a process may build, drop and rebuild engines):

- ``model``: the collectives inside the forward pass (gloo on CPU, NCCL on CUDA: the platform's
  ``distributed_backend``), with a bounded timeout: ranks run each step in lockstep, so a wait longer
  than ``STEP_TIMEOUT_S`` means a rank hung;
- ``control``: gloo, the driver's messages to the ranks (pickled objects) and their replies; ranks wait
  on it while the engine is idle, so its timeout is effectively unbounded (a driver that dies closes the
  connection, which ends the wait at once).
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

STEP_TIMEOUT_S = 300.0
CONTROL_TIMEOUT = timedelta(days=3650)
RENDEZVOUS_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RendezvousInfo:
    """The env:// variables one rank joins with."""

    master_addr: str
    master_port: int
    world_size: int
    rank: int

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> RendezvousInfo:
        env = os.environ if environ is None else environ
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK") if k not in env]
        if missing:
            raise ValueError(f"a tensor-parallel rank needs {', '.join(missing)} in its environment (env://)")
        return cls(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), int(env["RANK"]))

    def env(self) -> dict[str, str]:
        return {"MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
                "WORLD_SIZE": str(self.world_size), "RANK": str(self.rank)}


class TensorParallelGroup:
    """This rank's view of the group: the forward pass's collectives and the control channel."""

    def __init__(self, info: RendezvousInfo, backend: str, device: torch.device) -> None:
        self.rank = info.rank
        self.world_size = info.world_size
        self.backend = backend
        self.device = device
        self._store = dist.TCPStore(info.master_addr, info.master_port, info.world_size, info.rank == 0,
                                    timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
        step = timedelta(seconds=STEP_TIMEOUT_S)
        model_store = dist.PrefixStore("model/", self._store)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = step
            self.model = dist.ProcessGroupNCCL(model_store, info.rank, info.world_size, options)
        elif backend == "gloo":
            self.model = dist.ProcessGroupGloo(model_store, info.rank, info.world_size, step)
        else:
            raise ValueError(f"distributed backend must be gloo or nccl, got {backend!r}")
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control/", self._store), info.rank,
                                             info.world_size, CONTROL_TIMEOUT)

    # ----------------------------------------------------------------- the forward pass's collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (returned for chaining)."""
        self.model.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` concatenated along the last dimension, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.model.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    # ----------------------------------------------------------------- control messages (gloo, host)
    def _broadcast_bytes(self, payload: bytes | None) -> bytes:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        self.control.broadcast([size], options).wait()
        buffer = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload is not None
                  else torch.empty(int(size), dtype=torch.uint8))
        self.control.broadcast([buffer], options).wait()
        return payload if payload is not None else buffer.numpy().tobytes()

    def send(self, message: Any) -> None:
        """Driver: send ``message`` to every other rank."""
        self._broadcast_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def receive(self) -> Any:
        """Other ranks: the driver's next message (waits while the engine is idle)."""
        return pickle.loads(self._broadcast_bytes(None))

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order, on every rank."""
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(payload)], dtype=torch.int64)
        sizes = [torch.empty(1, dtype=torch.int64) for _ in range(self.world_size)]
        self.control.allgather([sizes], [size]).wait()
        longest = int(max(s.item() for s in sizes))
        buffer = torch.zeros(longest, dtype=torch.uint8)
        buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self.control.allgather([parts], [buffer]).wait()
        return [pickle.loads(p[: int(n.item())].numpy().tobytes()) for p, n in zip(parts, sizes, strict=True)]

    def close(self) -> None:
        """Drop the groups and the store (their C++ side goes now, not at interpreter teardown)."""
        for name in ("model", "control"):
            group = getattr(self, name, None)
            abort = getattr(group, "abort", None)
            if abort is not None:
                try:
                    abort()
                except Exception:  # noqa: BLE001, S110 - best effort: the peers may be gone
                    pass
            setattr(self, name, None)
        self._store = None
