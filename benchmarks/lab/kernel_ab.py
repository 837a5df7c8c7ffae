"""Two builds of the quantized products alternated call by call in one process: this tree's kernels against
another checkout's (``--base``, e.g. a ``git worktree`` of an earlier commit), on the same weights and inputs.

Why: on a shared host the cores' speed moves by 2-3x within seconds (``amx_probe.c``), so two
runs minutes apart compare two machines. Alternating each call between the builds puts both in the same
phase; the figures are the median of the per-pair time ratios and the ratio of the total times (what a
workload feels when the cores' phases differ now and then: a change that helps only then moves the total,
not the median), and the outputs are compared bit for bit. The
base build is compiled from the other checkout's sources with this tree's flags; its ``ts_qmat`` layout
must be this tree's. ``TIDESERVE_QGEMM_ISA`` caps both builds' path (``avx2`` on a CPU that has more).

    git worktree add ../base HEAD~1
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/lab/kernel_ab.py --base ../base \\
        --shapes q4_1:3072:576:64,q4_1:3072:576:2048,q8_0:49152:576:64
"""

# ruff: noqa: B023  (each shape's call closure runs within its own iteration, through alternate())

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from gguf_blocks import quantized_pair  # noqa: E402  (the tests' GGUF block writer)

from tideserve import native  # noqa: E402
from tideserve.native import quant  # noqa: E402


def build_base(tree: Path, out_dir: Path, exports: tuple[str, ...] = ("ts_qmatmul_f32",)) -> ctypes.CDLL:
    """The other checkout's kernels, compiled with this tree's flags, with ``exports``' signatures copied from
    this tree's library (the ones the caller alternates)."""
    sources = [tree / "tideserve" / "native" / Path(s).name for s in native.SOURCES]
    target = out_dir / "base_kernels.so"
    subprocess.run([native.find_compiler() or "cc", *native.CFLAGS, *map(str, sources), "-o", str(target), "-lm"],
                   check=True)
    lib = ctypes.CDLL(str(target))
    ours = quant._lib()  # native's library, with quant's signatures set too
    for name in exports:
        fn, ref = getattr(lib, name), getattr(ours, name)
        fn.restype, fn.argtypes = ref.restype, ref.argtypes
    forced = os.environ.get("TIDESERVE_QGEMM_ISA", "").strip().lower()
    if forced:  # the cap quant.py gave this tree's kernels at load, so that both builds run the same path
        lib.ts_qgemm_set_isa.restype, lib.ts_qgemm_set_isa.argtypes = ctypes.c_int, [ctypes.c_int]
        lib.ts_qgemm_set_isa(quant.ISA_NAMES.index(forced))
    return lib


def alternate(libs: dict[str, ctypes.CDLL], call: Callable[[str, ctypes.CDLL], torch.Tensor],
              pairs: int) -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
    """Each build's call timed in turn, ``pairs`` times after one warming pair: its times and last output."""
    times: dict[str, list[float]] = {name: [] for name in libs}
    outs: dict[str, torch.Tensor] = {}
    for _ in range(pairs + 1):
        for name, lib in libs.items():
            t = time.perf_counter()
            outs[name] = call(name, lib)
            times[name].append(time.perf_counter() - t)
    return times, outs


def report(shape: str, times: dict[str, list[float]], outs: dict[str, torch.Tensor], digits: int = 2) -> None:
    """The median of the per-pair ratios, the ratio of total times, and whether the outputs' bits agree."""
    base, ours = times["base"][1:], times["this tree"][1:]
    ratio = statistics.median(b / o for b, o in zip(base, ours))
    print(f"{shape}: base {statistics.median(base) * 1e3:.{digits}f} ms, "
          f"this tree {statistics.median(ours) * 1e3:.{digits}f} ms, "
          f"base / this tree {ratio:.2f} (median of {len(base)} pairs; {sum(base) / sum(ours):.2f} in total "
          f"time), same bits: {torch.equal(outs['base'], outs['this tree'])}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, type=Path, help="the other checkout (its tideserve/native sources)")
    ap.add_argument("--shapes", default="q4_1:3072:576:64,q4_1:576:1536:64,q8_0:49152:576:64,q4_1:3072:576:2048",
                    help="comma-separated format:n:k:m")
    ap.add_argument("--pairs", type=int, default=30, help="alternated calls of each build per shape")
    args = ap.parse_args()
    if not quant.available():
        raise SystemExit("the native kernels could not be built here")
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build_base(args.base, Path(tmp)), "this tree": quant._lib()}
        gen = torch.Generator().manual_seed(0)
        print(f"path {quant.qgemm_isa()}; threads {threads}")
        for shape in args.shapes.split(","):
            qtype, n, k, m = shape.split(":")
            n, k, m = int(n), int(k), int(m)
            data, _ = quantized_pair(torch.randn(n, k, generator=gen) * 0.05, qtype)
            layout = quant.preferred_layout(qtype)
            if layout != "rows":
                data = quant.relayout(qtype, data, k, layout)
            mat = quant.make_qmat([(qtype, data)], k, None, [layout])
            x = torch.randn(m, k, generator=gen)

            def product(name: str, lib: ctypes.CDLL) -> torch.Tensor:
                out = torch.empty(m, n)
                if lib.ts_qmatmul_f32(ctypes.byref(mat), x.data_ptr(), k, m, 0, out.data_ptr(), n, threads):
                    raise SystemExit(f"{name}: the product failed for {shape}")
                return out

            report(shape, *alternate(libs, product, args.pairs), digits=3)


if __name__ == "__main__":
    main()
