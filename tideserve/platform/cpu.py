"""The CPU: host memory bounded by the process's own cgroup, peaks from the kernel's resident-set
high-water mark, bfloat16 where the cores run it natively."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

from tideserve.platform.host_memory import (
    CgroupMemory,
    host_cgroup_memory,
    peak_rss_bytes,
    process_rss_bytes,
    reset_peak_rss,
)
from tideserve.platform.interface import Platform

# glibc's mallopt parameters (malloc.h) and the values tune_allocator sets: blocks up to 64 MiB come from
# the heap, and the heap is trimmed by free() only past 1 GiB (malloc_trim does it on request).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
ALLOCATOR_MMAP_THRESHOLD = 64 << 20
ALLOCATOR_TRIM_THRESHOLD = 1 << 30


def _cpu_has_fast_bf16() -> bool:
    """bf16 matmuls beat fp32 on CPUs with AMX or AVX512-BF16; elsewhere they are emulated and slower."""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    if any(getattr(torch.cpu, p, lambda: False)() for p in probes):
        return True
    capability = torch.backends.cpu.get_cpu_capability().upper()
    return "AMX" in capability or "BF16" in capability


class CpuPlatform(Platform):
    device_name = "cpu"
    host_memory = True
    computes_on_host = True
    attention_backends = ("cpu-native", "torch")
    # A prefill's matmuls per token, 30 layers of the embedded model on 2 cores of an AMX Xeon: 153 us at
    # 256 and 512 rows per pass, 180 at 1,024, 217 at 4,096 (prefill +20% with 512-token slabs); on an
    # AVX-512 EPYC without AMX the slab size made no difference (docs/benchmarks.md).
    forward_slab_tokens = 512

    def __init__(self, device: torch.device | None = None, cgroup: CgroupMemory | None = None) -> None:
        super().__init__(device if device is not None else torch.device("cpu"))
        self.cgroup = cgroup if cgroup is not None else host_cgroup_memory()

    def available_bytes(self) -> int:
        return self.cgroup.available_bytes()

    def total_bytes(self) -> int:
        return self.cgroup.total_bytes()

    def used_by_process_bytes(self) -> int:
        return process_rss_bytes()

    def describe(self) -> str:
        return self.cgroup.describe()

    def memory_scope(self) -> str:
        """The cgroup level whose limit binds (servers in one container share it), else the host."""
        reading = self.cgroup.read()
        return f"cgroup:{reading.limit_directory}" if reading is not None else "host"

    def measure_peak_bytes(self, run: Callable[[], Any]) -> int:
        """VmHWM after a reset, minus the resident set before: without a resettable high-water mark
        (``/proc/self/clear_refs`` not writable) nothing is run and 0 is returned."""
        before = process_rss_bytes()
        if not reset_peak_rss():
            return 0
        run()
        return max(0, peak_rss_bytes() - before)

    def release_freed_memory(self) -> None:
        """glibc keeps freed heap pages; malloc_trim hands them back to the kernel."""
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass

    def tune_allocator(self) -> None:
        """Keep a step's activations (a 2,048-token prefill allocates tens of MiB per layer) in glibc's heap
        between steps instead of mapping and unmapping them: each fresh mapping is page-faulted and zeroed
        again, which cost a prefill a quarter of its time (docs/benchmarks.md). Freed memory
        then stays in the process until ``release_freed_memory``, which the pool calls when it shrinks and
        whenever the engine turns idle, so an idle server still hands it back. Not glibc: nothing to do."""
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(M_MMAP_THRESHOLD, ALLOCATOR_MMAP_THRESHOLD)
            libc.mallopt(M_TRIM_THRESHOLD, ALLOCATOR_TRIM_THRESHOLD)
        except (OSError, AttributeError):
            pass

    def auto_dtype(self) -> torch.dtype:
        return torch.bfloat16 if _cpu_has_fast_bf16() else torch.float32

    def auto_kv_dtype(self, model_dtype: torch.dtype, quantization: str) -> torch.dtype:
        """The model's dtype, except for a GGUF's own blocks (which compute in float32; chosen by
        ``--quantization auto`` with ``--dtype auto``) where the native kernels run: there the cache is
        bfloat16, half the bytes a decode step's attention reads (and half the memory a token holds).
        That pays on every x86 level, since widening bfloat16 to float32 in registers is one shift: on
        AVX2 (measured with the AVX2 kernels) a batch-64 step went from 84 to 62 ms, a single stream's step
        at 2,000 tokens of context from 6.0-6.3 to 4.1-4.3 ms (docs/benchmarks.md)."""
        from tideserve import native

        if quantization == "gguf" and model_dtype == torch.float32 and native.load_library() is not None:
            return torch.bfloat16
        return model_dtype
