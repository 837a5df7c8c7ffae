"""benchmarks/cotenancy.py --device cuda, the parts that need no GPU: the limit held as a ballast, the static
split of two instances at --gpu-memory-utilization 0.45, and what counts as an OOM on a GPU (a server that
died, a CUDA out-of-memory error in its log; a pool growth that failed and backed off is counted apart).
The run itself needs a GPU: benchmarks/gpu_check.sh runs it."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

from tests.serve.test_cotenancy import load_benchmark

MiB, GiB = 2**20, 2**30


def test_gpu_defaults_and_the_static_split_flags():
    bench = load_benchmark()
    args = bench.parse_args(["--device", "cuda"])
    assert args.modes == ["elastic", "joint", "static"] and "--device cuda" in args.server_args
    assert bench.parse_args([]).server_args == "--dtype float32 --max-model-len 1024"  # the CPU run is unchanged
    sizing = SimpleNamespace(static_kv_bytes=123)
    assert bench.mode_flags("static", args, sizing) == ["--kv-cache-memory", "123"]
    whole = bench.parse_args(["--device", "cuda", "--gpu-room", "whole"])
    assert bench.mode_flags("static", whole, sizing) == ["--gpu-memory-utilization", "0.45"]
    assert bench.mode_flags("elastic", whole, None) == ["--kv-cache-shrink-delay", "2.0"]


def test_the_static_split_is_what_0_45_of_the_limit_leaves_each_server():
    bench = load_benchmark()
    tokenizer = SimpleNamespace(encode=lambda text: text.split())
    burst = bench.build_bursts(tokenizer, 8, 64, 32, 1)[0]
    cal = bench.Calibration(kv_bytes_per_token=1000, block_size=16, activation_bytes=100 * MiB,
                            margin_bytes=256 * MiB, fresh_usage_bytes=3 * GiB, idle_usage_bytes=4 * GiB,
                            idle_pool_bytes=[64 * MiB, 64 * MiB])
    args = bench.parse_args(["--device", "cuda"])
    sizing = bench.compute_sizing(burst, cal, args, total_bytes=80 * GiB)
    assert sizing.limit_bytes == 4 * GiB + 456 * MiB + sizing.room_bytes  # idle + 2 activations + margin
    non_kv_one = (4 * GiB - 128 * MiB) / 2
    assert sizing.static_kv_bytes == int(0.45 * sizing.limit_bytes - non_kv_one - 100 * MiB)
    cpu = bench.compute_sizing(burst, cal, bench.parse_args([]))  # the cgroup run keeps its own split
    assert cpu.static_kv_bytes == int(0.97 * cpu.room_bytes / 2)
    whole = bench.compute_sizing(burst, cal, bench.parse_args(["--device", "cuda", "--gpu-room", "whole"]),
                                 total_bytes=80 * GiB)
    assert whole.limit_bytes == 80 * GiB and whole.room_bytes == 80 * GiB - 4 * GiB - 456 * MiB


class FakeTorch:
    """The few torch.cuda calls GpuMemory makes, over a device of ``total`` bytes of which ``used`` are taken."""

    uint8 = "uint8"

    def __init__(self, total: int, used: int) -> None:
        self.total, self.used, self.held = total, used, 0
        self.cuda = SimpleNamespace(mem_get_info=lambda device: (self.total - self.used - self.held, self.total),
                                    empty_cache=self._empty_cache)

    def _empty_cache(self) -> None:
        pass

    def empty(self, n: int, dtype, device):
        self.held = n
        return SimpleNamespace(n=n)


def gpu_memory(bench, fake: FakeTorch):
    mem = object.__new__(bench.GpuMemory)
    mem._torch, mem.device, mem.total_bytes = fake, "cuda:0", fake.total
    mem._ballast, mem.ballast_bytes, mem.servers = None, 0, []
    return mem


def test_the_limit_is_a_ballast_of_the_device_less_the_limit():
    bench = load_benchmark()
    fake = FakeTorch(total=80 * GiB, used=5 * GiB)
    mem = gpu_memory(bench, fake)
    assert mem.usage() == 5 * GiB
    mem.set_limit(12 * GiB)
    assert mem.ballast_bytes == fake.held == 68 * GiB
    assert mem.usage() == 5 * GiB and fake.cuda.mem_get_info(None)[0] == 7 * GiB  # the servers see 12 - 5 GiB free
    mem.set_limit(None)
    fake.held = 0
    assert mem.ballast_bytes == 0


def test_ooms_on_a_gpu_are_deaths_and_cuda_oom_errors_and_growth_failures_count_apart(tmp_path: Path):
    bench = load_benchmark()
    mem = gpu_memory(bench, FakeTorch(80 * GiB, 0))
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("INFO ok\nWARNING KV pool growth 10 -> 900 blocks failed (out of device memory mapping 1 MiB of KV "
                 "memory (cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY)); staying at 10 blocks\n")
    b.write_text("ERROR torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    mem.servers = [SimpleNamespace(proc=SimpleNamespace(poll=lambda: None), log_path=a),
                   SimpleNamespace(proc=SimpleNamespace(poll=lambda: -9), log_path=b)]
    assert mem.counters() == {"oom_kills": 2, "limit_hits": 1, "kernel_peak": 0}


def test_the_report_names_the_gpu_and_the_static_split():
    bench = load_benchmark()
    mode = {"mode": "elastic", "ttft_mean_ms": 10.0, "ttft_p99_ms": 20.0, "output_tok_s_median_burst": 100.0,
            "output_tok_s_overall": 90.0, "preemptions": 0.0, "swap_ins": 0.0, "oom_kills": 0, "alive": [True, True],
            "failed": 0, "bursts": [{"recovery_s": 1.0}], "peak_pool_bytes": [GiB, GiB], "peak_cgroup_bytes": 5 * GiB,
            "limit_bytes": 6 * GiB, "limit_hits": 2}
    result = {"command": "x", "cpu": "c", "gpu": {"name": "H100", "total_bytes": 80 * GiB, "room": "auto"},
              "config": vars(argparse.Namespace(gap=5.0)), "modes": {"elastic": mode}, "ratios": {},
              "workload": {"num_requests": 8, "prompt_tokens_min": 60, "prompt_tokens_max": 64,
                           "prompt_tokens_mean": 62.0, "shared_prefix_tokens": 16, "output_tokens": 32,
                           "num_bursts": 2},
              "calibration": {"kv_bytes_per_token": 1000, "block_size": 16, "idle_usage_bytes": GiB,
                              "fresh_usage_bytes": GiB, "idle_pool_bytes": [0, 0], "activation_bytes": 0,
                              "margin_bytes": 0},
              "sizing": {"burst_kv_bytes": GiB, "burst_prompt_kv_bytes": GiB, "room_bytes": GiB, "limit_bytes": 6 * GiB,
                         "limit_overridden": False, "static_kv_bytes": GiB // 2, "memory_binds": True}}
    text = bench.format_report(result)
    assert "gpu: H100 (80.0 GiB), limit held by a ballast" in text
    assert "--gpu-memory-utilization 0.45 each (of the limit: 512 MiB of KV each)" in text
    assert "| OOMs (deaths + CUDA OOM errors) |" in text and "peak GPU use / limit MiB" in text
    assert "failed and backed off (the device had no memory for them), per mode: elastic 2" in text
