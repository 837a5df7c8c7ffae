"""The quantized products' rate at prefill and batched-decode shapes, through the kernel each shape takes
by default (integer tiles from ~8-16 rows on AVX2 / AVX-512 VNNI, AMX tiles where present).

One weight matrix per shape (cache-resident after the first call: this isolates the kernel, unlike a
model's step, whose weights come from DRAM), best of ``--repeats`` calls, in TOPS = 2 m n k / t. To
compare two versions, run it in two checkouts alternately (``git worktree add ../old <commit>``;
``PYTHONPATH=../old python benchmarks/lab/tile_rates.py``) and take medians: this kind of machine is noisy.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/lab/tile_rates.py --rows 16,64,305
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from gguf_blocks import quantized_pair  # noqa: E402  (the tests' GGUF block writer)

from tideserve.native import quant  # noqa: E402
from tideserve.platform import platform_for  # noqa: E402

# format:out_features:in_features. The embedded SmolLM2's q|k|v-sized, down-sized and LM-head products, and
# a 1.7B Llama's q|k|v, down (Q4_K or Q6_K in a Q4_K_M file) shapes.
DEFAULT_SHAPES = "q4_1:3072:576,q4_1:576:1536,q8_0:49152:576,q4_k:6144:2048,q4_k:2048:8192,q6_k:2048:8192"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated format:n:k")
    ap.add_argument("--rows", default="16,64,305", help="comma-separated batch sizes (rows of x)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not quant.available():
        raise SystemExit("the native kernels could not be built here")
    platform_for("cpu").tune_allocator()
    gen = torch.Generator().manual_seed(0)
    print(f"path {quant.qgemm_isa()}; threads {torch.get_num_threads()}; {quant.kernels_summary()}")
    for shape in args.shapes.split(","):
        qtype, n, k = shape.split(":")
        n, k = int(n), int(k)
        data, _ = quantized_pair(torch.randn(n, k, generator=gen) * 0.05, qtype)
        layout = quant.preferred_layout(qtype)
        if layout != "rows":
            data = quant.relayout(qtype, data, k, layout)
        mat = quant.make_qmat([(qtype, data)], k, None, [layout])
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=gen)
            quant.qmatmul(x, mat)
            best = float("inf")
            for _ in range(args.repeats):
                t = time.perf_counter()
                quant.qmatmul(x, mat)
                best = min(best, time.perf_counter() - t)
            print(f"{qtype} {n}x{k} M={m} ({quant.kernel_for(m, qtype)}): {best * 1e3:.2f} ms, "
                  f"{2 * m * n * k / best / 1e12:.3f} TOPS", flush=True)


if __name__ == "__main__":
    main()
