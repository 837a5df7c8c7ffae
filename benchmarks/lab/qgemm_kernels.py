"""The quantized linear kernels against each other, per format and batch size, in one process.

For each format and row count it times the row kernels, the matrix-vector kernel (AVX2) and the tiles
(AVX2's or AMX), each forced in turn and interleaved, over enough distinct weight copies that they come
from DRAM, as a decode step's do; on AVX2 the matrix-vector kernel and the tiles run over the file's rows
and over the interleaved layout (x8, what a loaded model keeps) where the format has one. Then it times a
whole batch-1 step's products of the embedded model's shapes (30 layers of q|k|v, o, gate|up and down,
plus the LM head, ~96 MB), with the matrix-vector kernel off and on. Figures are best of ``--repeats``
(this kind of machine is noisy: quote ranges).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/lab/qgemm_kernels.py --rows 1,2,3,4,8,12,16,20
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

# (format, out_features, in_features) of a layer, as in the embedded SmolLM2 (K-quants: the down projection)
LAYERS = {"q4_0": (3072, 576), "q4_1": (3072, 576), "q5_0": (3072, 576), "q5_1": (3072, 576),
          "q8_0": (49152, 576), "q2_k": (576, 1536), "q3_k": (576, 1536), "q4_k": (576, 1536), "q5_k": (576, 1536),
          "q6_k": (576, 1536), "iq4_nl": (3072, 576), "iq4_xs": (576, 1536)}
STEP_SHAPES = [("q4_1", 960, 576), ("q4_1", 576, 576), ("q4_1", 3072, 576), ("q4_1", 576, 1536)]


def weights(qtype: str, n: int, k: int, min_bytes: int, gen: torch.Generator,
            layout: str = "rows") -> list[tuple[quant.QMat, torch.Tensor]]:
    """Distinct copies of one quantized [n, k] weight in ``layout``, together at least min_bytes (so: from
    DRAM)."""
    mats, total, keep = [], 0, []
    while total < min_bytes or not mats:
        data, _ = quantized_pair(torch.randn(n, k, generator=gen) * 0.05, qtype)
        if layout != "rows":
            data = quant.relayout(qtype, data, k, layout)
        keep.append(data)
        mats.append(quant.make_qmat([(qtype, data)], k, None, [layout]))
        total += data.numel() * data.element_size()
    return list(zip(mats, keep))


def force(kernel: str) -> None:
    """Route every product through one kernel: "rows", "gemv" or "tiles" (a " x8" suffix names the layout)."""
    kernel = kernel.split()[0]
    quant.set_gemv(kernel == "gemv")
    quant.set_tile_min_rows(1 if kernel == "tiles" else 1 << 30)


def best_time(mats, x: torch.Tensor, kernel: str, timings: dict[str, float]) -> None:
    """Time ``kernel`` ("[isa:]rows|gemv|tiles[ x8]") once over every copy, keeping the best."""
    isa, _, name = kernel.rpartition(":")
    force(name)
    with quant.forced_isa(isa or quant.cpu_isa()):
        t = time.perf_counter()
        for mat, _ in mats:
            quant.qmatmul(x, mat)
        timings[kernel] = min(timings.get(kernel, float("inf")), time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=",".join(LAYERS))
    ap.add_argument("--rows", default="1,2,3,4,8,12,16,20", help="comma-separated batch sizes")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--min-mb", type=float, default=48.0, help="weight bytes per case (past the L3)")
    ap.add_argument("--isas", default=None,
                    help="comma-separated paths to compare in the same rounds (e.g. avx2,avx512; default: the "
                         "CPU's best)")
    args = ap.parse_args()
    if not quant.available():
        raise SystemExit("the native kernels could not be built here")
    platform_for("cpu").tune_allocator()
    gen = torch.Generator().manual_seed(0)
    isa = quant.qgemm_isa()
    isas = args.isas.split(",") if args.isas else [isa]
    kernels = []
    for path in isas:
        prefix = f"{path}:" if len(isas) > 1 else ""
        kernels += [f"{prefix}rows", *([f"{prefix}gemv"] if path in ("avx2", "avx512") else []),
                    *([f"{prefix}tiles"] if path in ("avx2", "avx512", "amx") else [])]
    print(f"path {isa}; threads {torch.get_num_threads()}; kernels compared: {', '.join(kernels)}")
    print(f"default plan: {quant.kernels_summary()}")
    row_counts = [int(r) for r in args.rows.split(",")]
    try:
        for qtype in args.formats.split(","):
            n, k = LAYERS[qtype]
            mats = weights(qtype, n, k, int(args.min_mb * 1e6), gen)
            nbytes = sum(data.numel() * data.element_size() for _, data in mats)
            interleaved = quant.preferred_layout(qtype) == "x8"
            mats_x8 = weights(qtype, n, k, int(args.min_mb * 1e6), gen, "x8") if interleaved else []
            for rows in row_counts:
                x = torch.randn(rows, k, generator=gen)
                timings: dict[str, float] = {}
                for _ in range(args.repeats):
                    for kernel in kernels:
                        best_time(mats, x, kernel, timings)
                        if interleaved and not kernel.endswith("rows"):  # the row kernels would copy x8 back
                            best_time(mats_x8, x, f"{kernel} x8", timings)
                cells = "  ".join(f"{kr} {t * 1e3 / len(mats):7.3f} ms {nbytes / t / 1e9:5.1f} GB/s"
                                  for kr, t in timings.items())
                quant.set_gemv(True)
                quant.set_tile_min_rows(0)
                print(f"{qtype} {n}x{k} M={rows:<3} (default: {quant.kernel_for(rows, qtype):10}) {cells}")
        # A whole batch-1 step's products, distinct weights per layer as in the model.
        steps = {layout: [m for qtype, n, k in STEP_SHAPES for _ in range(30)
                          for m in weights(qtype, n, k, 0, gen, layout)]
                 + weights("q8_0", 49152, 576, 0, gen, layout)
                 for layout in (["rows", "x8"] if any(k.endswith("gemv") for k in kernels) else ["rows"])}
        nbytes = sum(data.numel() * data.element_size() for _, data in steps["rows"])
        xs = {k: torch.randn(1, k, generator=gen) for k in (576, 1536)}
        best = {name: float("inf") for kernel in kernels if not kernel.endswith("tiles")
                for name in ([kernel, f"{kernel} x8"] if kernel.endswith("gemv") else [kernel])}
        for _ in range(args.repeats):
            for kernel in best:
                path, _, name = kernel.rpartition(":")
                force(name)
                step = steps["x8" if kernel.endswith("x8") else "rows"]
                with quant.forced_isa(path or isa):
                    t = time.perf_counter()
                    for mat, _ in step:
                        quant.qmatmul(xs[mat.k], mat)
                    best[kernel] = min(best[kernel], time.perf_counter() - t)
        print(f"batch-1 step's {len(steps['rows'])} products ({nbytes / 1e6:.0f} MB): " + "  ".join(
            f"{kernel} {t * 1e3:.2f} ms {nbytes / t / 1e9:.1f} GB/s" for kernel, t in best.items()))
    finally:
        quant.set_gemv(True)
        quant.set_tile_min_rows(0)


if __name__ == "__main__":
    main()
