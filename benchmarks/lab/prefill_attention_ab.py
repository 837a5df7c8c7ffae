"""Two builds of prefill attention alternated call by call in one process: this tree's kernel against another
checkout's (``--base``, e.g. a ``git worktree`` of an earlier commit), on the same queries and bfloat16 cache.

Why in one process: on a shared host the cores' speed moves by 2-3x within seconds (``amx_probe.c``),
so two runs minutes apart compare two machines (``kernel_ab.py`` does the same for the quantized
products). Each shape is a batch of fresh prompts (spans of equal length, no cached prefix) with SmolLM2's
heads (9 query heads over 3 KV heads of 64) in shuffled blocks of 16; the figures are the median of the
per-pair time ratios and the ratio of total times, and the outputs are compared bit for bit.

    git worktree add ../base HEAD~1
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/lab/prefill_attention_ab.py --base ../base \\
        --shapes 50x82,16x256,4x1024,1x4096
"""

# ruff: noqa: B023  (each shape's call closure runs within its own iteration, through alternate())

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_ab import alternate, build_base, report  # noqa: E402  (the other checkout's kernels, the A/B loop)

from tideserve import native  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, type=Path, help="the other checkout (its tideserve/native sources)")
    ap.add_argument("--shapes", default="50x82,16x256,4x1024,1x4096", help="comma-separated prompts x tokens")
    ap.add_argument("--tokens-per-shape", type=int, default=400,
                    help="pairs per shape: this over the prompt length, at least 6")
    args = ap.parse_args()
    ours = native.load_library()
    if ours is None:
        raise SystemExit("the native kernels could not be built here")
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    print(f"prefill form: {native.prefill_form(torch.bfloat16, HEAD_DIM) or 'float32'}; threads {threads}")
    with tempfile.TemporaryDirectory() as tmp:
        base = build_base(args.base, Path(tmp), ("ts_paged_prefill",))
        libs = {"base": base, "this tree": ours}
        for shape in args.shapes.split(","):
            spans, length = (int(v) for v in shape.split("x"))
            blocks = -(-length // BLOCK)
            cache = (spans * blocks + 1, BLOCK, KV_HEADS, HEAD_DIM)
            k_cache = torch.randn(cache, generator=gen).bfloat16()
            v_cache = torch.randn(cache, generator=gen).bfloat16()
            tables = torch.randperm(spans * blocks, generator=gen).view(spans, blocks).contiguous()
            q = torch.randn(spans * length, HEADS, HEAD_DIM, generator=gen)
            starts = torch.arange(spans, dtype=torch.int64) * length
            lens = torch.full((spans,), length, dtype=torch.int64)
            computed = torch.zeros(spans, dtype=torch.int64)

            def attend(name: str, lib: ctypes.CDLL) -> torch.Tensor:
                out = torch.empty_like(q)
                if lib.ts_paged_prefill(q.data_ptr(), q.stride(0), 0, k_cache.data_ptr(), v_cache.data_ptr(), 1,
                                        KV_HEADS * HEAD_DIM, tables.data_ptr(), blocks, BLOCK, starts.data_ptr(),
                                        lens.data_ptr(), computed.data_ptr(), spans, out.data_ptr(), out.stride(0),
                                        0, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, threads):
                    raise SystemExit(f"{name}: the kernel failed for {shape}")
                return out

            report(shape, *alternate(libs, attend, max(6, args.tokens_per_shape // length)))


if __name__ == "__main__":
    main()
