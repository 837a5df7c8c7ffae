"""Intra-op threads that follow the cores actually free, so a busy neighbour slows us down gently.

With OpenMP, every matmul ends at a barrier that waits for the slowest thread; when another process
holds one of our cores, the thread sharing it runs half the time and the whole step waits for it.
Measured on 2 vCPUs with one busy neighbour (docs/benchmarks.md): a batch-64 int8 decode step took
1.32 s with 2 threads and 0.40 s with 1 (0.31 s with 2 threads on a quiet machine). The governor
reads, every few seconds, how many of our CPUs were idle plus how much CPU this process itself used:
that sum is what we could have had, and the thread count follows it (only after two readings agree,
so a short burst does not make it flap).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass
class CpuSample:
    wall_s: float
    idle_s: float  # idle (and iowait) time summed over the CPUs we may run on
    own_s: float  # CPU time this process used, all threads


def read_cpu_sample(cpus: set[int] | None = None) -> CpuSample | None:
    """One reading of /proc/stat and of this process's CPU time; None where /proc is not Linux's."""
    try:
        with open("/proc/stat") as f:
            lines = f.readlines()
    except OSError:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    idle = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        fields = [int(x) for x in rest.split()]
        idle += fields[3] + (fields[4] if len(fields) > 4 else 0)
    t = os.times()
    return CpuSample(time.monotonic(), idle / hz, t.user + t.system)


class ThreadGovernor:
    """Sets torch's intra-op thread count to the cores this process could use, between 1 and max."""

    def __init__(self, max_threads: int | None = None, interval_s: float = 2.0,
                 sampler: Callable[[], CpuSample | None] | None = None,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_threads = max_threads or torch.get_num_threads()
        self.interval_s = interval_s
        try:
            cpus: set[int] | None = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = None
        self._sample = sampler or (lambda: read_cpu_sample(cpus))
        self._set_threads = set_threads
        self._clock = clock
        self._checked_at = float("-inf")
        self.threads = self.max_threads
        self.num_changes = 0
        self._last: CpuSample | None = None
        self._pending: int | None = None

    def observe(self) -> int:
        """Call between steps while busy; returns the thread count in force."""
        if self.max_threads <= 1:
            return self.threads
        now = self._clock()
        if now - self._checked_at < self.interval_s:  # a step costs no /proc read between readings
            return self.threads
        self._checked_at = now
        sample = self._sample()
        if sample is None:
            return self.threads
        last = self._last
        if last is None or sample.wall_s <= last.wall_s:
            self._last = sample
            return self.threads
        self._last = sample
        wall = sample.wall_s - last.wall_s
        usable = ((sample.idle_s - last.idle_s) + (sample.own_s - last.own_s)) / wall
        want = max(1, min(self.max_threads, int(usable + 0.5)))
        if want == self.threads:
            self._pending = None
        elif self._pending == want:
            logger.info("CPU availability: %.1f cores usable; intra-op threads %d -> %d",
                        usable, self.threads, want)
            self._set_threads(want)
            self.threads = want
            self.num_changes += 1
            self._pending = None
        else:
            self._pending = want
        return self.threads
