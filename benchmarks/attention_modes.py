"""What attention's invariant mode costs on this CPU: the native decode and prefill attention kernels, per
call, in three modes, interleaved call by call:

- ``avx2``: the kernels capped at AVX2 (attn_rows.h's forms: what batch invariance used on every CPU before
  attention had a shared AVX-512 form);
- ``fastest``: the CPU's best path with the invariant mode off (``--no-batch-invariant``);
- ``invariant``: the CPU's best path in the invariant mode (the default: on AVX-512 BF16 CPUs with a
  bfloat16 cache, decode and prefill in the vdpbf16ps arithmetic).

SmolLM2-135M's heads (9 query heads over 3 KV heads of 64) on a bfloat16 cache, one thread, process time
(so another process on the host slows both sides alike), median of ``--repeats`` calls per mode:

    .venv/bin/python benchmarks/attention_modes.py --contexts 300 1200 --batches 1 16 --prompts 256 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from tideserve import native

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
MODES = {"avx2": ("avx2", False), "fastest": ("auto", False), "invariant": ("auto", True)}


def per_call_us(calls: dict[str, Callable[[], object]], repeats: int, inner: int) -> dict[str, float]:
    """Median process time per call of each mode's call, the modes interleaved repeat by repeat."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            isa, invariant = MODES[name]
            native.set_isa(isa)
            native.set_attention_invariant(invariant)
            start = time.process_time()
            for _ in range(inner):
                call()
            times[name].append((time.process_time() - start) / inner * 1e6)
    native.set_isa("auto")
    native.set_attention_invariant(False)
    return {name: round(statistics.median(t), 1) for name, t in times.items()}


def decode_calls(context: int, batch: int) -> dict[str, Callable[[], object]]:
    gen = torch.Generator().manual_seed(0)
    per = context // BLOCK + 1
    k = torch.randn(batch * per, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    v = torch.randn(batch * per, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    tables = torch.randperm(batch * per, generator=gen).view(batch, per)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    lens = torch.full((batch,), context, dtype=torch.int64)
    out = torch.empty_like(q)
    call = lambda: native.paged_decode_attention(q, k, v, tables, lens, HEAD_DIM**-0.5, out, num_threads=1)  # noqa: E731
    return dict.fromkeys(MODES, call)


def prefill_calls(tokens: int) -> dict[str, Callable[[], object]]:
    gen = torch.Generator().manual_seed(0)
    per = tokens // BLOCK + 1
    k = torch.randn(per * BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    v = torch.randn(per * BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    tables = torch.arange(per).view(1, per)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen)
    out = torch.empty_like(q)
    zero, count = torch.tensor([0]), torch.tensor([tokens])
    call = lambda: native.paged_prefill_attention(q, k, v, tables, BLOCK, zero, count, zero,  # noqa: E731
                                                  HEAD_DIM**-0.5, out, num_threads=1)
    return dict.fromkeys(MODES, call)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[300, 1200], help="keys per request, decode")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="requests per decode call")
    ap.add_argument("--prompts", type=int, nargs="+", default=[256, 1024], help="prompt tokens, prefill")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    if native.load_library() is None:
        raise SystemExit("the native kernels are not available here")
    print(f"# ISA {native.isa()}; invariant attention on a bfloat16 cache: "
          f"{native.attention_isa(torch.bfloat16, HEAD_DIM)} path")
    for context in args.contexts:
        for batch in args.batches:
            row = per_call_us(decode_calls(context, batch), args.repeats, inner=20)
            print(json.dumps({"decode": {"context": context, "batch": batch}, "us_per_call": row}))
    for tokens in args.prompts:
        row = per_call_us(prefill_calls(tokens), args.repeats, inner=3)
        print(json.dumps({"prefill": {"tokens": tokens}, "us_per_call": row}))


if __name__ == "__main__":
    main()
