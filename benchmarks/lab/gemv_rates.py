"""How fast the matrix-vector kernel (one row of x: a single stream's decode step) reads each format's
weights, in GB/s of weight bytes, from cache and from DRAM.

A decode step at batch 1 reads every weight once, so its time is the weights' bytes over this rate: when
the rate from cache is below what the memory gives, the kernel's instructions bound the step, not DRAM.
``--copies 1`` keeps one matrix in cache (the kernel alone); the default 16 copies (113-165 MB at the
default shape) stream from DRAM as a model's layers do. Weights are laid out as a loaded model keeps them
(quant.preferred_layout). Run with ``OMP_NUM_THREADS=1`` and ``=2`` to see one core's rate and both's.
Figures are the median of ``--repeats`` passes; to compare two versions, run this in two checkouts
alternately (``PYTHONPATH=<checkout>``): the machine is noisy.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lab/gemv_rates.py --formats q4_k,q6_k --copies 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from gguf_blocks import quantized_pair  # noqa: E402  (the tests' GGUF block writer)

from tideserve.native import quant  # noqa: E402
from tideserve.platform import platform_for  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="q4_k,q6_k,q4_1,q8_0")
    ap.add_argument("--shape", default="6144:2048", help="out_features:in_features of each matrix")
    ap.add_argument("--copies", type=int, default=16, help="distinct matrices cycled through (1: in cache)")
    ap.add_argument("--passes", type=int, default=4, help="passes over the copies per timed repeat")
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    if not quant.available():
        raise SystemExit("the native kernels could not be built here")
    platform_for("cpu").tune_allocator()
    n, k = (int(v) for v in args.shape.split(":"))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, k, generator=gen)
    print(f"path {quant.qgemm_isa()}; threads {torch.get_num_threads()}; {n} x {k}, {args.copies} copies")
    for qtype in args.formats.split(","):
        mats, nbytes = [], 0
        for _ in range(args.copies):
            data, _ = quantized_pair(torch.randn(n, k, generator=gen) * 0.05, qtype)
            layout = quant.preferred_layout(qtype)
            if layout != "rows":
                data = quant.relayout(qtype, data, k, layout)
            nbytes += data.numel()
            mats.append((quant.make_qmat([(qtype, data)], k, None, [layout]), data))
        for mat, _ in mats:
            quant.qmatmul(x, mat)
        rates = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(args.passes):
                for mat, _ in mats:
                    quant.qmatmul(x, mat)
            rates.append(args.passes * nbytes / (time.perf_counter() - start) / 1e9)
        print(f"{qtype} ({quant.kernel_for(1, qtype)}, {nbytes / 1e6:.1f} MB): median {statistics.median(rates):.1f} "
              f"GB/s (range {min(rates):.1f}-{max(rates):.1f})", flush=True)


if __name__ == "__main__":
    main()
