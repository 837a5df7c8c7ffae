"""The mapped KV store on a GPU (tideserve/worker/cuda_kv_store.py): what it holds, what a resize costs, and
whether CUDA graphs survive resizes. Prints one line per figure and writes them as JSON.

1. store     which store an elastic engine's pool lives in (``KV store: ...``: the mapped range, or the
             copying one and why)
2. graphs    a decode run captures its graphs; the pool then grows, shrinks and grows again; the same run
             again: graphs captured, graphs recaptured, tokens equal or not
3. capacity  the pool grown at once to everything the device allows (the controller's ceiling, free memory
             less the margin), blocks and GiB mapped; then a static engine at --gpu-memory-utilization 0.9:
             its blocks, and the ratio
4. resize    a store of the model's layout alone, grown by 1, 4 and 16 GiB (where they fit) and shrunk back,
             best of 3: milliseconds, and milliseconds per GiB

    python3 benchmarks/gpu_kv_store.py [--model DIR] --json $OUT/kv-store.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from tideserve import LLM, SamplingParams
from tideserve.worker.cuda_kv_store import MappedKVStore

GiB = 2**30
PROMPTS = ["The capital of France is", "List three colours:", "Once upon a time", "def fibonacci(n):",
           "Water boils at", "The largest planet is", "In 1969,", "My favourite recipe"]


def say(text: str) -> None:
    print(f"kv-store: {text}", flush=True)


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def engine_figures(args: argparse.Namespace, out: dict) -> None:
    """Steps 1-3 on one elastic engine, then the static engine."""
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm = LLM(model=args.model, dtype="bfloat16", device="cuda", max_model_len=args.max_model_len,
              enable_prefix_caching=False)
    engine = llm.engine
    worker = engine.executor.driver_worker
    store = worker.kv_storage.device_store
    args.layout = worker.kv_storage.layout  # for step 4
    out["store"] = {"type": type(store).__name__, "describe": store.describe()}
    say(f"store {type(store).__name__}: {store.describe()}")

    want = tokens(llm.generate(PROMPTS, greedy))
    graphs = worker.runner.graphs
    captures = graphs.num_captures if graphs is not None else 0
    pool = engine.pool
    resizes = []
    for target in (pool.geometry.num_blocks + 2000, max(pool.min_blocks, 16), pool.geometry.num_blocks + 8000):
        start = time.perf_counter()
        ok = pool._resize(target, "probe")
        torch.cuda.synchronize()
        resizes.append({"to_blocks": target, "ok": ok, "ms": (time.perf_counter() - start) * 1e3})
    again = tokens(llm.generate(PROMPTS, greedy))
    recaptured = (graphs.num_captures - captures) if graphs is not None else None
    out["graphs"] = {"captured_before": captures, "recaptured_after_resizes": recaptured,
                     "invalidations": graphs.num_invalidations if graphs is not None else None,
                     "resizes": resizes, "tokens_equal": again == want}
    say(f"graphs: {captures} captured, {recaptured} recaptured after {len(resizes)} resizes "
        f"({out['graphs']['invalidations']} invalidations); tokens equal after the resizes: {again == want}")

    reachable = pool._reachable_blocks()
    start = time.perf_counter()
    grown = pool._resize(reachable, "probe: everything the device allows")
    torch.cuda.synchronize()
    grow_s = time.perf_counter() - start
    elastic_blocks = pool.geometry.num_blocks
    mapped = getattr(store, "mapped_bytes", pool.pool_bytes)
    free_after = torch.cuda.mem_get_info()[0]
    out["capacity"] = {"elastic_blocks": elastic_blocks, "block_size": pool.geometry.block_size,
                       "bytes_per_block": pool.bytes_per_block, "mapped_bytes": mapped, "grew": grown,
                       "grow_s": grow_s, "device_free_after_bytes": free_after}
    say(f"capacity: elastic pool grown to {elastic_blocks} blocks ({pool.pool_bytes / GiB:.2f} GiB, "
        f"{mapped / GiB:.2f} GiB mapped) in {grow_s * 1e3:.0f} ms; device free after: {free_after / GiB:.2f} GiB")
    store.close()
    engine.shutdown()
    del llm, engine, worker, store, pool, graphs
    gc.collect()
    torch.cuda.empty_cache()

    static = LLM(model=args.model, dtype="bfloat16", device="cuda", max_model_len=args.max_model_len,
                 gpu_memory_utilization=0.9)
    static_blocks = static.engine.kv_manager.num_blocks
    ratio = elastic_blocks / static_blocks
    out["capacity"].update({"static_0_9_blocks": static_blocks, "ratio": ratio})
    say(f"capacity: static --gpu-memory-utilization 0.9 pool {static_blocks} blocks; mapped/static "
        f"{ratio:.3f} (want >= 0.95)")
    static.engine.shutdown()
    del static
    gc.collect()
    torch.cuda.empty_cache()


def resize_figures(args: argparse.Namespace, out: dict) -> None:
    """Step 4: a store alone, in the layout of the engine's KV (its layers, heads and dtype)."""
    layout = getattr(args, "layout", None)
    if layout is None:
        say("resize: skipped, the engine did not start")
        return
    block_size = 16
    per_gib = GiB // layout.block_bytes(block_size)
    free = torch.cuda.mem_get_info()[0]
    store, why = MappedKVStore.try_create(layout, torch.device("cuda"), block_size, 1, 20 * GiB)
    if store is None:
        out["resize"] = {"error": why}
        say(f"resize: no mapped store ({why})")
        return
    rows = []
    for gib in (1, 4, 16):
        if gib * GiB > free - 4 * GiB:
            continue
        grow, shrink = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            store.resize(1 + gib * per_gib)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            store.resize(1)
            t2 = time.perf_counter()
            grow.append(t1 - t0)
            shrink.append(t2 - t1)
        row = {"gib": gib, "grow_ms": min(grow) * 1e3, "shrink_ms": min(shrink) * 1e3,
               "grow_ms_per_gib": min(grow) * 1e3 / gib, "shrink_ms_per_gib": min(shrink) * 1e3 / gib}
        rows.append(row)
        say(f"resize: {gib:>2} GiB grow {row['grow_ms']:.1f} ms ({row['grow_ms_per_gib']:.1f} ms/GiB), shrink "
            f"{row['shrink_ms']:.1f} ms ({row['shrink_ms_per_gib']:.1f} ms/GiB)")
    out["resize"] = {"granularity": store.granularity, "row_bytes": store.plan.row_bytes, "rows": rows}
    store.close()


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.model is None:
        from tideserve.model.loader import default_model_path

        args.model = str(default_model_path())
    out: dict = {"device": torch.cuda.get_device_name()}
    try:
        engine_figures(args, out)
    finally:
        resize_figures(args, out)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
