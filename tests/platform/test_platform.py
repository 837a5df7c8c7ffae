"""One object per device answers what differs between devices: the CPU's answers, the device names
accepted, and a test double (a fake device of a chosen memory size) that the engine budgets from."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tideserve import LLM, SamplingParams
from tideserve.model.loader import resolve_dtype
from tideserve.platform import CpuPlatform, CudaPlatform, Platform, current_platform, platform_for, resolve_device
from tideserve.platform.host_memory import reset_peak_rss

GiB = 2**30
MiB = 2**20


class FakeDevice(Platform):
    """A device with ``memory`` bytes of which the process holds ``used``; it computes on the host (the
    engine's tensors stay on the CPU), but its memory is what the test says."""

    device_name = "fake"
    host_memory = True
    computes_on_host = True

    def __init__(self, memory: int, used: int = GiB, peak: int = 64 * MiB) -> None:
        super().__init__(torch.device("cpu"))
        self.memory, self.used, self.peak = memory, used, peak
        self.released = 0

    def available_bytes(self) -> int:
        return max(0, self.memory - self.used)

    def total_bytes(self) -> int:
        return self.memory

    def used_by_process_bytes(self) -> int:
        return self.used

    def describe(self) -> str:
        return f"fake device, {self.memory / GiB:.2f} GiB"

    def measure_peak_bytes(self, run: Callable[[], Any]) -> int:
        run()
        return self.peak

    def release_freed_memory(self) -> None:
        self.released += 1

    def auto_dtype(self) -> torch.dtype:
        return torch.float32


def test_one_shared_platform_per_device() -> None:
    cpu = platform_for("cpu")
    assert isinstance(cpu, CpuPlatform) and cpu is platform_for(torch.device("cpu"))
    assert cpu.host_memory and cpu.computes_on_host and not cpu.async_host_copies
    gpu = platform_for("cuda:1")  # made without touching CUDA: only its answers need a GPU
    assert isinstance(gpu, CudaPlatform) and gpu.device == torch.device("cuda:1")
    assert not gpu.host_memory and not gpu.computes_on_host and gpu.async_host_copies
    assert current_platform() is platform_for(resolve_device("auto"))


@pytest.mark.parametrize("name", ["tpu", "mps", "cpu:x"])
def test_unknown_devices_are_a_value_error_naming_the_value(name: str) -> None:
    with pytest.raises(ValueError, match=rf"device must be auto, cpu or cuda\[:N\], got '{name}'"):
        resolve_device(name)
    with pytest.raises(ValueError, match="device must be auto, cpu or cuda"):
        LLM(device=name)  # before anything is loaded


def test_cpu_answers() -> None:
    cpu = CpuPlatform()
    assert cpu.total_bytes() >= cpu.available_bytes() > 0 and cpu.used_by_process_bytes() > 0
    assert cpu.auto_dtype() in (torch.bfloat16, torch.float32) and cpu.auto_dtype() == resolve_dtype("auto", "cpu")
    # The GGUF-blocks exception to "the KV cache follows the model" is the CPU's alone.
    assert cpu.auto_kv_dtype(torch.float16, "none") == torch.float16
    assert CudaPlatform(torch.device("cuda")).auto_kv_dtype(torch.float32, "gguf") == torch.float32
    cpu.release_freed_memory()  # never raises


def test_cpu_keeps_a_gguf_blocks_cache_in_bfloat16_wherever_the_native_kernels_run(monkeypatch) -> None:
    """Half the bytes decode attention reads pays on AVX2 too (no fast bf16 there): only the kernels decide."""
    from tideserve import native
    from tideserve.platform import cpu as cpu_module

    monkeypatch.setattr(cpu_module, "_cpu_has_fast_bf16", lambda: False)  # as on an AVX2-only CPU
    monkeypatch.setattr(native, "load_library", lambda: object())
    assert CpuPlatform().auto_kv_dtype(torch.float32, "gguf") == torch.bfloat16
    assert CpuPlatform().auto_kv_dtype(torch.float32, "none") == torch.float32  # a float model keeps its dtype
    assert CpuPlatform().auto_kv_dtype(torch.bfloat16, "gguf") == torch.bfloat16
    monkeypatch.setattr(native, "load_library", lambda: None)  # no compiler: torch's attention, float32 cache
    assert CpuPlatform().auto_kv_dtype(torch.float32, "gguf") == torch.float32


def test_cpu_peak_of_a_run_sees_its_allocation() -> None:
    calls = []

    def run() -> None:
        calls.append(torch.ones(64 * MiB // 4).sum())  # 64 MiB touched, then freed

    peak = CpuPlatform().measure_peak_bytes(run)
    if not reset_peak_rss():  # no resettable high-water mark here: nothing is run, the estimate decides
        assert peak == 0 and not calls
        return
    assert len(calls) == 1 and peak >= 32 * MiB


@pytest.mark.slow
def test_a_fake_device_is_what_the_engine_budgets_from(make_llm, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tideserve.engine.builder")
    device = FakeDevice(memory=3 * GiB)
    llm = make_llm(dtype="float32", max_model_len=128, memory_probe=device)
    engine = llm.engine
    assert "memory probe: fake device, 3.00 GiB" in caplog.text
    assert engine.pool.account.available_bytes == 2 * GiB
    budget_blocks = engine.pool.account.budget_bytes // engine.pool.bytes_per_block
    assert 0 < engine.kv_manager.num_blocks <= engine.pool.max_blocks <= budget_blocks
    engine.pool._resize(engine.pool.max_blocks, "test")  # as if a burst had grown it to its ceiling
    grown = engine.kv_manager.num_blocks
    device.used = device.memory - engine.pool.account.margin_bytes // 2  # something else took the memory
    engine.step()
    assert engine.kv_manager.num_blocks < grown


def test_an_engine_turning_idle_hands_freed_memory_back_once(make_llm, monkeypatch) -> None:
    """The engine keeps a step's activations in the allocator between steps (tune_allocator), so when the
    last request ends the pool's upkeep returns what they freed, once per busy spell."""
    from tideserve.worker.worker import Worker

    calls: list[object] = []
    llm = make_llm(dtype="float32", max_model_len=128)
    monkeypatch.setattr(Worker, "release_freed_memory", lambda worker: calls.append(worker.device))
    CpuPlatform(torch.device("cpu")).tune_allocator()  # idempotent; never raises
    engine = llm.engine
    engine.maintain()
    assert calls == []  # a fresh engine was never busy
    llm.generate("The capital of France is", SamplingParams(max_tokens=3))
    engine.maintain()
    engine.maintain()
    assert calls == [engine.executor.driver_worker.runner.device]
