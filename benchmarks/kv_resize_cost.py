"""What a KV pool resize costs: the reserved store (commit / release pages, no copy) against the copying
store (a new tensor per size, the kept blocks copied: the GPU path, and what every resize cost before).

For each pool size S the pool, full of data, grows by half (the elastic pool's growth step) and shrinks
back to S. Reported: milliseconds per GiB that changed, and the extra memory a resize needs (the reserved
store needs none: old and new storage never coexist). The copying store's cost follows the pool's size,
the reserved store's the bytes that change.

    .venv/bin/python benchmarks/kv_resize_cost.py --sizes-gib 0.5,1,2 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tideserve.worker.kv_store import CopyKVStore, KVLayout, ReservedKVStore

GiB = 2**30


def layout_of(name: str) -> KVLayout:
    """The embedded SmolLM2-135M's KV shape: 30 layers, 3 KV heads of 64."""
    return KVLayout(30, 3, 64, getattr(torch, name))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(kind: str, layout: KVLayout, block_size: int, floor_blocks: int, grow_blocks: int) -> tuple[float, float]:
    """(seconds to grow by grow_blocks, seconds to shrink back) for one store kind."""
    if kind == "reserved":
        store = ReservedKVStore(layout, block_size, floor_blocks, reserve_bytes=(floor_blocks + grow_blocks)
                                * layout.block_bytes(block_size) + GiB)
    else:  # as the engine allocated its elastic pool before: torch.empty, committed where written
        store = CopyKVStore(layout, torch.device("cpu"), block_size, floor_blocks)
    for k, v in store.caches:  # the pool holds data (live KV and cached prefixes)
        k.fill_(1.0)
        v.fill_(1.0)
    grow = timed(lambda: store.resize(floor_blocks + grow_blocks))
    for k, _ in store.caches[:1]:
        k[-1].fill_(2.0)  # the pool is used after growing
    shrink = timed(lambda: store.resize(floor_blocks))
    assert float(store.caches[0][0][0, 0, 0, 0]) == 1.0
    return grow, shrink


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-gib", default="0.5,1,2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    layout = layout_of(args.dtype)
    per_block = layout.block_bytes(args.block_size)
    print(f"KV layout {layout}, block {per_block} B; medians of {args.repeats}, the two stores interleaved")
    print("| pool | change | store | grow ms | grow ms/GiB | shrink ms | shrink ms/GiB | extra memory |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    for size in (float(x) for x in args.sizes_gib.split(",")):
        floor = int(size * GiB) // per_block
        blocks = floor // 2
        changed = blocks * per_block / GiB
        runs: dict[str, list[tuple[float, float]]] = {"reserved": [], "copy": []}
        for _ in range(args.repeats):
            for kind in runs:
                runs[kind].append(measure(kind, layout, args.block_size, floor, blocks))
        for kind, values in runs.items():
            g = statistics.median(v[0] for v in values) * 1e3
            s = statistics.median(v[1] for v in values) * 1e3
            extra = "none" if kind == "reserved" else "old + new pool at once"
            print(f"| {size:g} GiB | {changed:g} GiB | {kind} | {g:.0f} | {g / changed:.0f} | {s:.1f} | "
                  f"{s / changed:.1f} | {extra} |")


if __name__ == "__main__":
    main()
