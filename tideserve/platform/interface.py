"""The questions whose answers differ by device, asked of one object per device.

Everything outside ``tideserve/platform`` asks a ``Platform`` instead of testing ``device.type``, so a new
accelerator is one new subclass, and a test double (a fake device with a memory size the test chooses)
answers the same questions as the real machine. A platform is also a ``MemoryProbe``: the elastic pool
reads its budget from it.

Capabilities are plain class attributes, named for what the caller does with them (view a tensor with
numpy, pin a host buffer), not for the device: a caller never needs to know which device it runs on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch


class Platform(ABC):
    """One device's answers: memory probe, peak measurement, releasing memory, dtypes and capabilities."""

    device_name: ClassVar[str]
    """torch's name for the device ("cpu", "cuda"): what error messages and logs call it."""
    host_memory: ClassVar[bool] = False
    """Its tensors are host memory: numpy may view them without a copy (the sampler's bitmask paths), the
    KV pool may be one reserved host address range (worker/kv_store.py), and the host swap tier takes from
    the same memory the probe counts."""
    computes_on_host: ClassVar[bool] = False
    """The model runs on the host's cores: tideserve's CPU kernels (native/, fbgemm's int8) apply, and the
    adaptive thread governor sizes torch's threads (engine/threads.py)."""
    async_host_copies: ClassVar[bool] = False
    """Copies between host and device may be asynchronous: host buffers that feed it (the swap tier) are
    pinned, and the device consumes host-to-device copies in stream order."""
    attention_backends: ClassVar[tuple[str, ...]] = ("torch",)
    """The attention backends that can run here, best first: ``--attention-backend auto`` takes the first
    whose kernels fit the model (model/attention/selector.py); torch's SDPA runs everywhere."""
    maps_device_memory: ClassVar[bool] = False
    """Its driver can reserve a range of device addresses and map device memory into it in steps (CUDA's
    virtual memory management): the elastic KV pool is then such a range, resized without a copy
    (worker/cuda_kv_store.py), where the driver and its binding allow it at run time."""
    graph_capture: ClassVar[bool] = False
    """Decode-only steps can be captured once and replayed as a graph (CUDA graphs,
    worker/cuda_graphs.py); ``--enforce-eager`` turns it off."""
    forward_slab_tokens: ClassVar[int | None] = None
    """Most tokens one forward pass takes: a larger step runs as several passes over consecutive slabs of
    its flat batch (each request's tokens in order, so a slab reads the keys of the slabs before it from the
    cache, as a chunked prefill does). On the host, a 4,096-token pass writes each layer's activations out
    of the caches (tens of MiB per matmul) and reads them back; slabs keep them in cache, as llama.cpp's
    micro-batches do. None: one pass per step, whatever its size (GPUs, whose wide matmuls want the
    tokens)."""
    distributed_backend: ClassVar[str] = "gloo"
    """The ``torch.distributed`` backend tensor-parallel ranks on this device join (gloo for host tensors,
    NCCL between GPUs); the ranks' control messages always travel over gloo."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"

    def device_for_rank(self, rank: int) -> torch.device:
        """The device tensor-parallel rank ``rank`` computes on (the host: every rank shares it)."""
        return self.device

    # ----------------------------------------------------------------- memory probe (core's MemoryProbe)
    @abstractmethod
    def available_bytes(self) -> int:
        """Bytes that could still be taken now."""

    @abstractmethod
    def total_bytes(self) -> int:
        """Bytes of the whole device, or of the process's memory limit."""

    @abstractmethod
    def used_by_process_bytes(self) -> int:
        """Bytes this process holds on the device (CPU: resident set)."""

    @abstractmethod
    def describe(self) -> str:
        """What bounds the probe's answers, for the start-up log."""

    def memory_scope(self) -> str | None:
        """A name for the memory this probe reads, the same in every process that shares it (a cgroup's
        limit, the host, a GPU): engines under one scope coordinate their growths through a memory ledger
        (platform/memory_ledger.py). None: nothing to coordinate with."""
        return None

    # ----------------------------------------------------------------- measuring and releasing
    @abstractmethod
    def measure_peak_bytes(self, run: Callable[[], Any]) -> int:
        """Bytes at the peak of ``run()`` above what the process held before it (a profiling forward).

        A device whose peak cannot be read returns 0, and may do so without calling ``run``: the caller's
        lower bound from shapes then decides.
        """

    @abstractmethod
    def release_freed_memory(self) -> None:
        """Hand memory freed by the process back to the system or the device (after a pool shrinks, and
        when the engine turns idle)."""

    def tune_allocator(self) -> None:
        """Settle the process's allocator for a step's short-lived activations; once, when an engine starts.
        Nothing to do unless a device says otherwise."""
        return None

    # ----------------------------------------------------------------- dtypes
    @abstractmethod
    def auto_dtype(self) -> torch.dtype:
        """The model dtype ``--dtype auto`` picks: the fastest this device runs well."""

    def auto_kv_dtype(self, model_dtype: torch.dtype, quantization: str) -> torch.dtype:
        """The KV cache dtype ``--kv-cache-dtype auto`` picks: the model's, unless the device knows better."""
        return model_dtype
