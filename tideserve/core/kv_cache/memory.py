"""Memory probes: how much memory the engine may still use, on CPU or CUDA, behind one function."""

from __future__ import annotations

from pathlib import Path

import torch


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


def _meminfo(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_memory_bytes(device: torch.device) -> int:
    """Bytes the engine could still take: CUDA free memory; on CPU the cgroup headroom or MemAvailable."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    available = _meminfo("MemAvailable") or 8 * 2**30
    limit = _read_int("/sys/fs/cgroup/memory.max") or _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")
    if limit is not None and limit < 2**60:
        used = _read_int("/sys/fs/cgroup/memory.current") or _read_int(
            "/sys/fs/cgroup/memory/memory.usage_in_bytes") or 0
        available = min(available, max(0, limit - used))
    return available
