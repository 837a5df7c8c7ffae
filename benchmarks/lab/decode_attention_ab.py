"""Two builds of decode attention alternated call by call in one process, with the KV cache placed so that its
memory and its arithmetic can be told apart: this tree's kernel against another checkout's (``--base``, e.g. a
``git worktree`` of an earlier commit, or one with an experiment applied).

Why: a batch's decode attention reads every request's keys and values once per layer, and on a shared host
the cores' speed moves within seconds, so two runs minutes apart compare two machines (``kernel_ab.py`` and
``prefill_attention_ab.py`` do the same for the products and prefill attention). One call is a decode step's
attention: ``--layers`` caches used in turn, ``--batch`` requests of ``--context`` keys, SmolLM2's heads (9 query
heads over 3 KV heads of 64), blocks of 16, a float32 query as the engine's decode forward passes it.
``--placements`` says where the blocks lie:

- ``shuffled``: each request's blocks scattered over the pool (the engine's case after a while);
- ``consecutive``: each request's blocks one after another (the hardware prefetchers' best case);
- ``hot``: every request reads the same blocks, which stay in L2: the arithmetic alone;
- ``one-layer``: shuffled, but every layer reads the first layer's cache, which then stays in L3.

The figures are each build's median time and effective bandwidth (the K/V bytes the call must read over its
time), the median of the per-pair ratios and the ratio of total times; the outputs are compared bit for bit.

    git worktree add ../base HEAD~1
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/lab/decode_attention_ab.py --base ../base \\
        --placements shuffled,consecutive,hot,one-layer
"""

# ruff: noqa: B023  (each placement's call closure runs within its own iteration, through alternate())

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_ab import alternate, build_base, report  # noqa: E402  (the other checkout's kernels, the A/B loop)

from tideserve import native  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
PLACEMENTS = ("shuffled", "consecutive", "hot", "one-layer")


def block_tables(placement: str, batch: int, blocks: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, blocks] block ids into a pool of batch * blocks (+1) blocks, laid out as ``placement`` says."""
    if placement == "consecutive":
        return torch.arange(batch * blocks).view(batch, blocks).contiguous()
    if placement == "hot":
        return torch.arange(blocks).repeat(batch, 1).contiguous()
    return torch.randperm(batch * blocks, generator=gen).view(batch, blocks).contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, type=Path, help="the other checkout (its tideserve/native sources)")
    ap.add_argument("--placements", default="shuffled,hot", help=f"comma-separated, of {', '.join(PLACEMENTS)}")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=256, help="keys per request")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-dtype", default="bfloat16", choices=("bfloat16", "float8_e4m3fn", "float32"))
    ap.add_argument("--pairs", type=int, default=9)
    args = ap.parse_args()
    ours = native.load_library()
    if ours is None:
        raise SystemExit("the native kernels could not be built here")
    threads = torch.get_num_threads()
    kv_dtype = getattr(torch, args.kv_dtype)
    gen = torch.Generator().manual_seed(0)
    blocks = -(-args.context // BLOCK)
    shape = (args.batch * blocks + 1, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape, generator=gen).to(kv_dtype), torch.randn(shape, generator=gen).to(kv_dtype))
              for _ in range(args.layers)]
    q = torch.randn(args.batch, HEADS, HEAD_DIM, generator=gen)
    lens = torch.full((args.batch,), args.context, dtype=torch.int64)
    kv_bytes = args.layers * 2 * args.batch * args.context * KV_HEADS * HEAD_DIM * caches[0][0].element_size()
    print(f"{args.batch} requests x {args.context} keys x {args.layers} layers, {args.kv_dtype} cache "
          f"({kv_bytes / 1e6:.0f} MB a call), threads {threads}")
    with tempfile.TemporaryDirectory() as tmp:
        base = build_base(args.base, Path(tmp), ("ts_paged_decode",))
        libs = {"base": base, "this tree": ours}
        for placement in args.placements.split(","):
            if placement not in PLACEMENTS:
                raise SystemExit(f"unknown placement {placement!r}: one of {', '.join(PLACEMENTS)}")
            tables = block_tables(placement, args.batch, blocks, gen)
            layers = [caches[0]] * args.layers if placement == "one-layer" else caches

            def attend(name: str, lib: ctypes.CDLL) -> torch.Tensor:
                out = torch.empty_like(q)
                for k, v in layers:
                    if lib.ts_paged_decode(q.data_ptr(), q.stride(0), 0, k.data_ptr(), v.data_ptr(),
                                           native.CACHE_DTYPE_CODES[kv_dtype], tables.data_ptr(), blocks,
                                           lens.data_ptr(), out.data_ptr(), out.stride(0), 0, args.batch, HEADS,
                                           KV_HEADS, HEAD_DIM, BLOCK, HEAD_DIM ** -0.5, threads):
                        raise SystemExit(f"{name}: the kernel failed")
                return out

            times, outs = alternate(libs, attend, args.pairs)
            rates = ", ".join(f"{name} {kv_bytes / statistics.median(t[1:]) / 1e9:.1f} GB/s"
                              for name, t in times.items())
            report(f"{placement} ({rates})", times, outs)


if __name__ == "__main__":
    main()
