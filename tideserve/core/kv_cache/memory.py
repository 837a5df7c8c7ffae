"""The memory probe: how much memory the engine may still use, behind one interface.

CPU, CUDA and a test double answer the same questions (``MemoryProbe``), so the elastic pool's decisions
can be tested with a fake machine. The devices' probes are their platforms (tideserve/platform/; the host's
readings of /proc and its cgroup are platform/host_memory.py): the core only reads the numbers, it never
touches the host.
"""

from __future__ import annotations

from typing import Protocol


class MemoryProbe(Protocol):
    def available_bytes(self) -> int:
        """Bytes that could still be taken now."""

    def total_bytes(self) -> int:
        """Bytes of the whole device, or of the process's memory limit."""

    def used_by_process_bytes(self) -> int:
        """Bytes this process holds on the device (CPU: resident set)."""
