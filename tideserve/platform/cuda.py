"""A CUDA GPU: the device's own memory, peaks from torch's caching allocator, bfloat16 where supported."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tideserve.platform.interface import Platform


class CudaPlatform(Platform):
    device_name = "cuda"
    async_host_copies = True
    attention_backends = ("triton", "torch")
    graph_capture = True
    maps_device_memory = True
    distributed_backend = "nccl"

    def device_for_rank(self, rank: int) -> torch.device:
        """One GPU per tensor-parallel rank: rank r on the r-th visible device (CUDA_VISIBLE_DEVICES picks
        which ones), as vLLM places its ranks on one node."""
        return torch.device("cuda", rank)

    def available_bytes(self) -> int:
        free, _total = torch.cuda.mem_get_info(self.device)
        return int(free)

    def total_bytes(self) -> int:
        return int(torch.cuda.mem_get_info(self.device)[1])

    def used_by_process_bytes(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def describe(self) -> str:
        return f"CUDA device memory ({self.device})"

    def memory_scope(self) -> str:
        """The GPU itself (its UUID where torch reports one): every process on it shares its memory."""
        props = torch.cuda.get_device_properties(self.device)
        return f"cuda:{getattr(props, 'uuid', None) or props.name + ':' + str(self.device.index or 0)}"

    def measure_peak_bytes(self, run: Callable[[], Any]) -> int:
        """The allocator's peak over ``run`` (kernels finished on both sides), minus what was allocated."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        run()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - before

    def release_freed_memory(self) -> None:
        """The caching allocator keeps freed blocks for reuse; other processes see them only once emptied."""
        torch.cuda.empty_cache()

    def auto_dtype(self) -> torch.dtype:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
