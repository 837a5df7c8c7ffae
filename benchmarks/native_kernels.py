"""Each native kernel on each instruction-set path this machine has, against the torch operators it replaces.

Shapes are the default model's (SmolLM2-135M: 9 query heads, 3 KV heads of 64, hidden 576, 30 layers). Prefill
attention is one fresh prompt of ``--prompt-len`` tokens, causal, through each backend's own builder. Decode
attention reads a separate KV cache per layer, 30 layers' worth, in turn, as a decode step does, so the cache
is as cold as in a step. The paths are run in interleaved rounds (every path once per round); the figure is
the median over rounds, with the spread (min-max), since the machine may be shared. Attention also gets an
effective bandwidth: the K/V bytes it must read over its time.

The quantized products are a step's 30 MLP down projections (1536 -> 576) in one GGUF block format, used in
turn, for 1 input row (a decode step) and 16 (a batch), against torch's float32 product with the blocks'
dequantized values (what a dequantizing load keeps). The blocks are in the layout a model loaded on this
CPU keeps (interleaved by 8 rows for Q4_K on AVX2 and AVX-512, which the scalar path reads through copies).
``--only`` keeps the cases whose name contains it.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/native_kernels.py --rounds 7 --json out.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/native_kernels.py --rounds 9 --only "down projection"
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tideserve import native
from tideserve.model.attention import BatchLayout, TorchSDPABackend
from tideserve.model.layers.rotary import apply_rotary_
from tideserve.native import quant

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, LAYERS, BLOCK = 9, 3, 64, 576, 30, 16
INTERMEDIATE = 1536  # the MLP's width: a whole number of the K-quants' 256-value units
QUANT_FORMATS = ("q2_k", "q3_k", "iq4_nl", "iq4_xs", "q4_k")


def cpu_description() -> str:
    model, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not flags:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                names = line.split(":", 1)[1].split()
                flags = " ".join(f for f in names if f.startswith(("avx", "amx", "fma", "f16c")))
                break
    except OSError:
        pass
    return f"{model}; {flags}"


def attention_case(batch: int, context: int, dtype: torch.dtype,
                   kv_dtype: torch.dtype | None = None) -> tuple[Callable[[], None], Callable[[], None], int]:
    """(native call, torch call, K/V bytes read per call) over LAYERS caches used in turn; the cache is of
    ``kv_dtype`` (default: ``dtype``), as --kv-cache-dtype makes it."""
    gen = torch.Generator().manual_seed(0)
    blocks = -(-context // BLOCK)
    kv_dtype = kv_dtype or dtype
    caches = [(torch.randn(batch * blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(kv_dtype),
               torch.randn(batch * blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(kv_dtype))
              for _ in range(LAYERS)]
    tables = torch.randperm(batch * blocks, generator=gen)[: batch * blocks].view(batch, blocks).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int64)
    qkv = torch.randn(batch, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    q = qkv[:, :HEADS]
    out = torch.empty(batch, HEADS, HEAD_DIM, dtype=dtype)
    layout = BatchLayout(tables.numpy(), lens.numpy() - 1, np.ones(batch, dtype=np.int64), batch, BLOCK)
    torch_backend = TorchSDPABackend()
    meta = torch_backend.build_metadata(layout)
    empty = torch.empty(0, KV_HEADS, HEAD_DIM, dtype=dtype)
    scale = HEAD_DIM ** -0.5

    def ours() -> None:
        for k, v in caches:
            assert native.paged_decode_attention(q, k, v, tables, lens, scale, out)

    def theirs() -> None:  # the torch backend: one group (equal contexts), gathered blocks, SDPA
        for k, v in caches:
            torch_backend.forward(q, empty, empty, k, v, meta, scale, kv_stored=True)

    kv_bytes = LAYERS * 2 * batch * context * KV_HEADS * HEAD_DIM * caches[0][0].element_size()
    return ours, theirs, kv_bytes


def prefill_case(tokens: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype | None = None) -> tuple[Callable[[], None], Callable[[], None], None]:
    """(cpu-native backend, torch backend) attending one fresh prompt, LAYERS times, through their own
    builders and with the K/V already stored (in ``kv_dtype``, the model's dtype by default), as a prefill
    step runs them."""
    from tideserve.model.attention import CpuNativeBackend

    kv_dtype = kv_dtype or dtype
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    q, k, v = qkv[:, :HEADS], qkv[:, HEADS:HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS:]
    blocks = -(-tokens // BLOCK)
    k_cache = torch.zeros(blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=kv_dtype)
    k_cache.view(-1, KV_HEADS, HEAD_DIM)[:tokens] = k.to(kv_dtype)
    v_cache = torch.zeros_like(k_cache)
    v_cache.view(-1, KV_HEADS, HEAD_DIM)[:tokens] = v.to(kv_dtype)
    layout = BatchLayout.single_prefill(tokens, BLOCK)
    scale = HEAD_DIM ** -0.5
    backends = [CpuNativeBackend("cpu", dtype, kv_dtype, HEADS, KV_HEADS, HEAD_DIM), TorchSDPABackend()]
    metas = [b.build_metadata(layout) for b in backends]

    def run(i: int) -> Callable[[], None]:
        def call() -> None:
            for _ in range(LAYERS):
                backends[i].forward(q, k, v, k_cache, v_cache, metas[i], scale, kv_stored=True)
        return call

    return run(0), run(1), None


def rms_case(rows: int, dtype: torch.dtype) -> tuple[Callable[[], None], Callable[[], None]]:
    x = torch.randn(rows, HIDDEN).to(dtype)
    residual = torch.randn(rows, HIDDEN).to(dtype)
    weight = torch.randn(HIDDEN).to(dtype)

    def ours() -> None:
        for _ in range(2 * LAYERS):
            native.rms_norm(x, weight, 1e-5, residual)

    def theirs() -> None:
        for _ in range(2 * LAYERS):
            F.rms_norm(residual.add_(x), (HIDDEN,), weight, 1e-5)

    return ours, theirs


def rope_case(tokens: int, dtype: torch.dtype) -> tuple[Callable[[], None], Callable[[], None]]:
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = torch.randn(tokens, width).to(dtype)
    positions = torch.arange(tokens) + 100
    freqs = torch.outer(positions.float(), torch.rand(HEAD_DIM // 2))
    cos, sin = freqs.cos().to(dtype)[:, None], freqs.sin().to(dtype)[:, None]
    k_cache = torch.zeros(tokens // BLOCK + 1, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(tokens)
    k_flat, v_flat = k_cache.view(-1, KV_HEADS, HEAD_DIM), v_cache.view(-1, KV_HEADS, HEAD_DIM)

    def ours() -> None:
        for _ in range(LAYERS):
            native.rope_store(qkv, cos, sin, slots, k_cache, v_cache, HEADS, KV_HEADS)

    def theirs() -> None:
        for _ in range(LAYERS):
            qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, HEADS + KV_HEADS, HEAD_DIM)
            apply_rotary_(qk, cos, sin)
            k_flat.index_copy_(0, slots, qk[:, HEADS:])
            v_flat.index_copy_(0, slots, qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(tokens, KV_HEADS, HEAD_DIM))

    return ours, theirs


def qgemm_case(qtype: str, rows: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """(the native kernels over ``qtype`` blocks, torch over their float32 values): LAYERS down projections
    of ``rows`` input rows, each layer's weight distinct, so the weights stream as in a step."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from gguf_blocks import quantized_pair  # the tests' GGUF block writer (gguf cannot write K-quants)

    gen = torch.Generator().manual_seed(2)
    layout = quant.preferred_layout(qtype)
    mats, floats = [], []
    for _ in range(LAYERS):
        data, values = quantized_pair(torch.randn(HIDDEN, INTERMEDIATE, generator=gen) * 0.05, qtype)
        if layout != "rows":
            data = quant.relayout(qtype, data, INTERMEDIATE, layout)
        mats.append(quant.make_qmat([(qtype, data)], INTERMEDIATE, None, [layout]))
        floats.append(values)
    x = torch.randn(rows, INTERMEDIATE, generator=gen)

    def ours() -> None:
        for mat in mats:
            assert quant.qmatmul(x, mat) is not None

    def theirs() -> None:
        for w in floats:
            F.linear(x, w)

    return ours, theirs


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--context", type=int, default=256, help="keys per request for decode attention")
    ap.add_argument("--prompt-len", type=int, default=305, help="tokens of the prompt for prefill attention")
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None, help="run only the cases whose name contains this")
    args = ap.parse_args()
    if native.load_library() is None:
        raise SystemExit("the native kernels could not be built here")
    paths = native.supported_isas()
    cases: dict[str, tuple[Callable[[], None], Callable[[], None], int | None]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        cases[f"prefill attention {name}, one prompt of {args.prompt_len} tokens, {LAYERS} layers"] = prefill_case(
            args.prompt_len, dtype)
        for batch in (1, 64):
            ours, theirs, nbytes = attention_case(batch, args.context, dtype)
            cases[f"decode attention {name}, batch {batch} x {args.context} keys, {LAYERS} layers"] = (ours, theirs,
                                                                                                       nbytes)
        # a float32 model (a GGUF's blocks) over the bf16 cache "auto" gives it, and over --kv-cache-dtype fp8
        for kv_dtype in ((torch.bfloat16, torch.float8_e4m3fn) if dtype == torch.float32 else ()):
            kv_name = "bf16" if kv_dtype == torch.bfloat16 else "fp8"
            cases[f"prefill attention float32 over a {kv_name} cache, one prompt of {args.prompt_len} tokens, "
                  f"{LAYERS} layers"] = prefill_case(args.prompt_len, dtype, kv_dtype)
            for batch in (1, 64):
                ours, theirs, nbytes = attention_case(batch, args.context, dtype, kv_dtype)
                cases[f"decode attention float32 over a {kv_name} cache, batch {batch} x {args.context} keys, "
                      f"{LAYERS} layers"] = (ours, theirs, nbytes)
        for rows in (1, 64):
            cases[f"add + RMSNorm {name}, {rows} x {HIDDEN}, {2 * LAYERS} calls"] = (*rms_case(rows, dtype), None)
            cases[f"rotary + KV store {name}, {rows} tokens, {LAYERS} calls"] = (*rope_case(rows, dtype), None)
    for qtype in QUANT_FORMATS:
        for rows in (1, 16):
            name = f"{qtype} down projection, {rows} x {INTERMEDIATE} -> {HIDDEN}, {LAYERS} layers"
            if args.only is None or args.only in name:
                cases[name] = (*qgemm_case(qtype, rows), None)
    if args.only is not None:
        cases = {name: case for name, case in cases.items() if args.only in name}

    variants = [*paths, "torch"]
    times: dict[str, dict[str, list[float]]] = {case: {v: [] for v in variants} for case in cases}
    for ours, theirs, _ in cases.values():  # warm up every variant once
        for v in variants:
            if v == "torch":
                theirs()
            else:
                native.set_isa(v)
                ours()
    for _ in range(args.rounds):
        for case, (ours, theirs, _) in cases.items():
            for v in variants:
                if v == "torch":
                    times[case][v].append(timed(theirs))
                else:
                    native.set_isa(v)
                    times[case][v].append(timed(ours))
    native.set_isa("auto")

    print(f"CPU: {cpu_description()}; threads {torch.get_num_threads()}; torch {torch.__version__}")
    result = {"cpu": cpu_description(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "rounds": args.rounds, "cases": {}}
    for case, per in times.items():
        nbytes = cases[case][2]
        print(f"\n{case}")
        rows = {}
        for v, ts in per.items():
            med = statistics.median(ts)
            line = f"  {v:>11}: {med * 1e3:8.3f} ms (spread {min(ts) * 1e3:.3f}-{max(ts) * 1e3:.3f})"
            if nbytes:
                line += f"  {nbytes / med / 1e9:6.1f} GB/s of K/V"
            print(line)
            rows[v] = {"median_ms": med * 1e3, "min_ms": min(ts) * 1e3, "max_ms": max(ts) * 1e3,
                       **({"kv_gb_s": nbytes / med / 1e9} if nbytes else {})}
        result["cases"][case] = rows
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
