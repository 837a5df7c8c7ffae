"""What a benchmark report says about the machine: the CPU's SIMD/matrix flags, which quantized-kernel
path tideserve takes there, and the measured matmul ceiling per dtype on the model's own shapes.

The ceiling is what the engine's batched decode step is judged against ("≥ 50% of the machine's matmul
rate for the dtype used"): the best of a few repeats of one GEMM of the step's largest layer (the fused
gate|up projection) at 64 and 256 rows, through the kernel each dtype uses in the engine (torch's
float32 and bfloat16 GEMMs (oneDNN, AMX where present), fbgemm's int8 layer, tideserve's block
kernels (q4_1 and q8_0: every GGUF format shares their tile path)).

    .venv/bin/python benchmarks/machine.py [--model X.gguf] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path
from typing import Any

import torch

FLAGS_OF_INTEREST = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
                     "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_summary() -> dict[str, Any]:
    """Model name and the flags that decide the kernels (from /proc/cpuinfo)."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    from tideserve.native import quant

    return {"cpu": model, "flags": [f for f in FLAGS_OF_INTEREST if f in flags],
            "tideserve_quant_kernels": quant.qgemm_isa() or "unavailable"}


def _best(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def matmul_ceiling(hidden: int, intermediate: int, qtypes: tuple[str, ...] = ("q4_1", "q8_0"),
                   rows: tuple[int, ...] = (64, 256)) -> dict[str, dict[int, float]]:
    """GFLOPS (2 M N K / time, best of 7) of x [M, hidden] times the gate|up weight [2 intermediate, hidden]."""
    from tideserve.model.layers.quant.weights import Int8Weight, QuantWeight
    from tideserve.native import quant

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(2 * intermediate, hidden, generator=gen) * 0.05
    wb = w.bfloat16()
    kernels: dict[str, Any] = {"float32": lambda x: torch.nn.functional.linear(x, w),
                               "bfloat16": lambda x: torch.nn.functional.linear(x.bfloat16(), wb)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            int8 = Int8Weight(w)
            kernels["int8 (fbgemm)"] = int8
        except RuntimeError:
            pass
    if quant.available() and hidden % 32 == 0:
        for qtype in qtypes:  # the block kernels of the GGUF formats (all formats share the tile path)
            kernels[f"{qtype} (tideserve, {quant.qgemm_isa()})"] = QuantWeight.from_float(w, qtype=qtype)
    out: dict[str, dict[int, float]] = {}
    for name, fn in kernels.items():
        out[name] = {}
        for m in rows:
            x = torch.randn(m, hidden, generator=gen)
            with torch.inference_mode():
                t = _best(lambda x=x, fn=fn: fn(x))
            out[name][m] = 2 * m * w.shape[0] * hidden / t / 1e9
    return out


def describe(hidden: int, intermediate: int, threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    summary = cpu_summary()
    summary["threads"] = threads
    summary["matmul_gflops"] = {k: {str(m): round(v, 1) for m, v in d.items()}
                                for k, d in matmul_ceiling(hidden, intermediate).items()}
    summary["matmul_shape"] = f"[M, {hidden}] x [{hidden}, {2 * intermediate}]"
    return summary


def markdown(summary: dict[str, Any]) -> str:
    rates = "; ".join(f"{k} " + ", ".join(f"{v} GFLOPS at M={m}" for m, v in d.items())
                      for k, d in summary["matmul_gflops"].items())
    return (f"CPU: {summary['cpu']}; flags: {' '.join(summary['flags'])}; tideserve's quantized kernels: "
            f"{summary['tideserve_quant_kernels']}. Measured matmul ceiling ({summary['threads']} threads, "
            f"{summary['matmul_shape']}, best of 7): {rates}.")


def model_shape(model: str | None) -> tuple[int, int]:
    """(hidden, intermediate) of a model file or directory."""
    from tideserve.model.loader import resolve_model_path

    path, _ = resolve_model_path(model)
    if path.is_file():
        from tideserve.model.arch_config import ArchConfig
        from tideserve.model.loader.gguf_index import read_gguf_index

        arch = ArchConfig.from_gguf_metadata(read_gguf_index(str(path)))
    else:
        from tideserve.model.loader.hf import read_arch_config

        arch = read_arch_config(path)
    return arch.hidden_size, arch.intermediate_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    hidden, intermediate = model_shape(args.model)
    summary = describe(hidden, intermediate, args.threads)
    print(json.dumps(summary, indent=2))
    print(markdown(summary))


if __name__ == "__main__":
    main()
