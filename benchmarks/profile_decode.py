"""Where one batched decode step spends its time, and how close its matmuls come to the machine's rate.

Fills a batch of ``--batch`` requests (prompts of ``--prompt-len`` tokens) and lets them all reach decode.
Then, in each of ``--rounds`` rounds, it times ``--steps`` engine steps (median step time, output tok/s) and
the step's linear layers alone at the same shapes: in float32, bfloat16 and int8 (torch's kernels), and
through the loaded model's own layers (its quantized blocks where it has them: the dtype the step uses).
That gives the "fraction of the matmul rate": the step's matmul FLOPs over the step time, against the rate
the same GEMMs reach alone, i.e. their time alone over the step's. It is taken per round, since a shared
host's speed moves by the minute, and reported as the median and range over rounds. Then ``--steps`` steps
are split into phases (``phase_ms_per_step``: the native decode forward's own phases as it times them -
norms, each product, rotary and the cache store, attention - then the LM head and the rest), and a last
``--steps`` are profiled with torch.profiler (top operators by self CPU time: the Python path's view).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/profile_decode.py --batch 64 --steps 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import torch


def linear_shapes(model) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of every matrix a decode step multiplies by, LM head included."""
    from tideserve.model.layers.linear import Linear

    shapes = [(name, m.in_features, m.out_features) for name, m in model.named_modules() if isinstance(m, Linear)]
    shapes.append(("lm_head", model.arch.hidden_size, model.arch.vocab_size))
    return shapes


def time_gemm(m: int, k: int, n: int, kind: str, repeats: int = 7) -> float:
    """Median time of one [m, k] x [k, n] product: float32, bfloat16, or our int8 layer."""
    if kind == "int8":
        from tideserve.model.layers.quant.weights import Int8Weight

        x = torch.randn(m, k)
        fn = Int8Weight(torch.randn(n, k))
        run = lambda: fn(x)  # noqa: E731
    else:
        dtype = getattr(torch, kind)
        x = torch.randn(m, k, dtype=dtype)
        w = torch.randn(n, k, dtype=dtype)
        run = lambda: torch.nn.functional.linear(x, w)  # noqa: E731
    return median_time(run, repeats, warmup=2)


def median_time(run, repeats: int, warmup: int) -> float:
    """Median wall time of ``run()`` over ``repeats`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_own_matmuls(model, batch: int, repeats: int = 7) -> float:
    """Median time of the step's own matmul kernels run alone at ``batch`` rows: every Linear of the
    loaded model (its quantized blocks, its int8 or float weight: whatever the step multiplies by) and the
    LM head, one after another as the step calls them, each on a fresh random input. The ceiling of the
    dtype the engine uses, on the same machine at the same time as the step."""
    from tideserve.model.layers.linear import Linear

    layers = [m for m in model.modules() if isinstance(m, Linear)]
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    inputs = [torch.randn(batch, m.in_features, dtype=dtype) for m in layers]
    hidden = torch.randn(batch, model.arch.hidden_size, dtype=dtype)

    def run() -> None:
        with torch.inference_mode():
            for m, x in zip(layers, inputs):
                m(x)
            model.compute_logits(hidden)

    return median_time(run, repeats, warmup=1)


def time_phases(engine, model, steps: int) -> dict[str, float]:
    """Milliseconds per step in each phase, over ``steps`` more steps: the native forward's own phases (a
    profiler sees that call as one function; empty on the Python path, which the profile table covers), the
    LM head, and the rest of the step (sampling, scheduling, the Python around them)."""
    native_forward = getattr(model, "native_decode", None)
    if native_forward is None:
        return {}
    lm_head = []
    compute_logits = model.compute_logits

    def timed_logits(*a, **k):
        t0 = time.perf_counter()
        out = compute_logits(*a, **k)
        lm_head.append(time.perf_counter() - t0)
        return out

    model.compute_logits = timed_logits
    native_forward.time_phases()
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            engine.step()
    finally:
        wall = time.perf_counter() - t0
        seconds = native_forward.phase_seconds()
        native_forward.time_phases(False)
        del model.compute_logits  # the instance attribute goes; the method is the class's again
    seconds["lm_head"] = sum(lm_head)
    seconds["rest"] = wall - sum(seconds.values())
    return {name: round(s / steps * 1e3, 2) for name, s in seconds.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8, help="steps timed per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of steps then GEMMs alone (see below)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--fixed-threads", action="store_true", help="turn the thread governor off")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from tideserve import LLM, SamplingParams

    kwargs = {"dtype": args.dtype, "max_model_len": args.prompt_len + (args.rounds + 3) * args.steps + 64,
              "max_num_seqs": args.batch, "enable_prefix_caching": False,
              "adaptive_threads": not args.fixed_threads, "kv_cache_dtype": args.kv_cache_dtype}
    if args.quantization:
        kwargs["quantization"] = args.quantization
    llm = LLM(args.model, **kwargs)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=(args.rounds + 3) * args.steps + 32, ignore_eos=True)
    for i in range(args.batch):
        ids = [(i * 7919 + j * 104729) % 40000 + 100 for j in range(args.prompt_len)]
        engine.add_request(ids, params, prompt_token_ids=ids)
    # Prefill everything, then wait until every request decodes (one token per step).
    while len(engine.scheduler.running) < args.batch or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    for _ in range(min(16, args.steps)):  # past the pool's growth at the first block boundary
        engine.step()

    model = engine.executor.driver_worker.runner.model
    shapes = linear_shapes(model)
    flops = sum(2 * args.batch * k * n for _, k, n in shapes)
    shape_counts = Counter((k, n) for _, k, n in shapes)  # the layers repeat a few shapes
    # Rounds: a round times --steps engine steps, then each kind's GEMMs at the step's shapes. On a shared
    # host the machine's speed moves by the minute, so a step and a ceiling measured minutes apart do not
    # compare; within a round they were measured under the same conditions, and each round gives a fraction.
    rounds = []
    all_steps: list[float] = []
    for _ in range(args.rounds):
        step_times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - t0)
        all_steps += step_times
        gemm = {kind: sum(count * time_gemm(args.batch, k, n, kind, repeats=3)
                          for (k, n), count in shape_counts.items())
                for kind in ("float32", "bfloat16", "int8")}
        gemm["own kernels"] = time_own_matmuls(model, args.batch, repeats=3)
        rounds.append((statistics.median(step_times), gemm))
    step = statistics.median(st for st, _ in rounds)

    phases = time_phases(engine, model, args.steps)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top)

    kinds = list(rounds[0][1])
    # The step's matmul FLOPs over its whole duration, against each kernel's rate alone: per round, the
    # kernels' time alone over the step's time ("own kernels": the loaded model's layers themselves, i.e.
    # the dtype the step uses).
    fractions = {k: sorted(g[k] / st for st, g in rounds) for k in kinds}
    gemm = {k: statistics.median(g[k] for _, g in rounds) for k in kinds}
    achieved = flops / step
    result = {
        "batch": args.batch, "prompt_len": args.prompt_len, "threads": torch.get_num_threads(),
        "thread_changes": engine.thread_governor.num_changes if engine.thread_governor else None,
        "model_dtype": str(model.dtype if hasattr(model, "dtype") else next(model.parameters()).dtype),
        "rounds": args.rounds,
        "step_ms_median": step * 1e3, "step_ms_spread": [min(all_steps) * 1e3, max(all_steps) * 1e3],
        "step_ms_per_round": [round(st * 1e3, 2) for st, _ in rounds],
        "output_tok_s": args.batch / step,
        "matmul_gflop_per_step": flops / 1e9,
        "step_matmul_gflops": achieved / 1e9,
        "isolated_gemm_ms": {k: v * 1e3 for k, v in gemm.items()},
        "isolated_gemm_gflops": {k: flops / v / 1e9 for k, v in gemm.items()},
        "fraction_of_matmul_rate": {k: statistics.median(v) for k, v in fractions.items()},
        "fraction_of_matmul_rate_range": {k: [round(v[0], 3), round(v[-1], 3)] for k, v in fractions.items()},
        "phase_ms_per_step": phases,
    }
    print(table)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result | {"profile": table}, f, indent=2)


if __name__ == "__main__":
    main()
