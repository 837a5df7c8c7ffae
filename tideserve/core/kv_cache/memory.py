"""Memory probes: how much memory the engine may still use, on CPU or CUDA, behind one interface.

CPU, CUDA and a test double answer the same two questions, so the elastic pool's decisions can be
tested with a fake machine. On CPU the answer is the cgroup headroom when a limit is set (containers),
else the kernel's MemAvailable; on CUDA it is the device's free memory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

import torch


class MemoryProbe(Protocol):
    def available_bytes(self) -> int:
        """Bytes that could still be taken now."""

    def total_bytes(self) -> int:
        """Bytes of the whole device, or of the process's memory limit."""

    def used_by_process_bytes(self) -> int:
        """Bytes this process holds on the device (CPU: resident set)."""


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _kib_field(path: str, key: str) -> int | None:
    """A "Key:   123 kB" line of a /proc file, in bytes (None when absent or unreadable)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _meminfo(key: str) -> int | None:
    return _kib_field("/proc/meminfo", key)


def process_rss_bytes() -> int:
    return _kib_field("/proc/self/status", "VmRSS") or 0


class SystemMemoryProbe:
    """The real machine: CUDA device memory, or host memory (cgroup-aware)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _cgroup_limit(self) -> int | None:
        limit = _read_int("/sys/fs/cgroup/memory.max") or _read_int(
            "/sys/fs/cgroup/memory/memory.limit_in_bytes")
        return limit if limit is not None and limit < 2**60 else None

    def available_bytes(self) -> int:
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            return int(free)
        available = _meminfo("MemAvailable") or 0
        limit = self._cgroup_limit()
        if limit is not None:
            used = _read_int("/sys/fs/cgroup/memory.current") or _read_int(
                "/sys/fs/cgroup/memory/memory.usage_in_bytes") or 0
            available = min(available, max(0, limit - used))
        return available

    def total_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.mem_get_info(self.device)[1])
        total = _meminfo("MemTotal") or 0
        limit = self._cgroup_limit()
        return min(total, limit) if limit is not None else total

    def used_by_process_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_reserved(self.device))
        return process_rss_bytes()


def reset_peak_rss() -> bool:
    """Reset the kernel's resident-set high-water mark (VmHWM) so a profiling run can read its own peak."""
    try:
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    return _kib_field("/proc/self/status", "VmHWM") or 0


def available_memory_bytes(device: torch.device) -> int:
    return SystemMemoryProbe(device).available_bytes()
