"""The memory the KV cache may take, read from every worker and counted as one pool.

Every rank holds a share of each block, so the pool can grow only as far as the tightest rank allows.
Each worker reports its own probe (worker/worker.py ``MemoryReport``); the answer here is the smallest
rank's, in the driver's bytes: a rank whose block holds fewer KV heads than the driver's (an uneven
split) has its figures scaled by the driver's bytes per token over its own, and ranks on one host share
its memory in proportion to their bytes per token (for equal shards: the host's memory divided by the
number of ranks on it). With one rank this is that rank's probe, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from tideserve.worker.executor import Executor
from tideserve.worker.worker import MemoryReport, Worker


@dataclass(frozen=True)
class MemoryReading:
    """One reading of the machine, in the driver's bytes."""

    available_bytes: int  # what could still be taken now
    total_bytes: int  # the device, or the process's memory limit
    used_by_process_bytes: int  # what the engine's process holds (CPU: its resident set)


def combine(reports: list[MemoryReport], host_memory: bool) -> MemoryReading:
    """The smallest rank's figures in rank 0's units (see the module docstring)."""
    here, token_bytes = reports[0].host, reports[0].kv_token_bytes
    on_this_host = sum(r.kv_token_bytes for r in reports if r.host == here)
    available, total = [], []
    for report in reports:
        share = on_this_host if host_memory and report.host == here else report.kv_token_bytes
        available.append(report.available_bytes * token_bytes // share)
        total.append(report.total_bytes * token_bytes // share)
    return MemoryReading(min(available), min(total), reports[0].used_by_process_bytes)


class WorkersMemoryProbe:
    """A ``MemoryProbe`` over the executor's workers; ``read`` gives all three figures at one call."""

    def __init__(self, executor: Executor, host_memory: bool) -> None:
        self.executor = executor
        self.host_memory = host_memory  # the ranks' memory is the host's (shared by ranks on one host)

    def read(self) -> MemoryReading:
        return combine(self.executor.collective_rpc(Worker.memory_report), self.host_memory)

    def available_bytes(self) -> int:
        return self.read().available_bytes

    def total_bytes(self) -> int:
        return self.read().total_bytes

    def used_by_process_bytes(self) -> int:
        return self.read().used_by_process_bytes

    def scope(self) -> str | None:
        """What rank 0's memory is shared with (``Platform.memory_scope``), or None."""
        return self.executor.collective_rpc(Worker.memory_report, unique_reply_rank=0).scope

    def describe(self) -> str:
        reports = self.executor.collective_rpc(Worker.memory_report)
        text = reports[0].description
        if len(reports) > 1:
            text += (f"; tensor parallel over {len(reports)} ranks: the smallest rank's answer"
                     + (", host memory shared among its ranks by their KV bytes per token" if self.host_memory
                        else ""))
        return text
