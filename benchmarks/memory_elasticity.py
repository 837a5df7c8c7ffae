"""Memory elasticity: the elastic KV pool against a static pool sized for the burst peak.

Scenario 1 (one engine): idle, then a burst of concurrent requests of mixed lengths (a quarter share a
long system prompt), then idle again. Recorded over time: pool bytes, used blocks, process RSS,
fragmentation, preemptions. Reported: idle footprint (elastic / static), burst throughput, requests
lost, steady-state fragmentation, prefix-cache hit rate and the prefill time it saved.

Scenario 2 (two engines, two processes, one simulated device): the engines burst in turn. With elastic
pools each grows into the memory the other gave back; static pools must split the device in advance.
Reported: the peak concurrent requests each burst ran without preemption, elastic against a static
half-and-half split. The device is simulated (a memory probe over a shared counter of both pools'
bytes) so that memory, not this machine's 24 GiB, is the binding constraint.

    .venv/bin/python benchmarks/memory_elasticity.py --out docs/memory-elasticity
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

MiB = 2**20
SYSTEM = ("You are the support assistant of a large online bookshop. Be polite, answer in at most three "
          "sentences, never invent order numbers, and escalate refunds above fifty euros. ") * 4


@dataclass
class Sample:
    t: float
    phase: str
    pool_bytes: int
    used_blocks: int
    pool_blocks: int
    rss_bytes: int
    fragmentation: float
    running: int
    preemptions: int


def build_workload(tokenizer, num_requests: int, seed: int, min_prompt: int, max_prompt: int,
                   min_out: int, max_out: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length): mixed lengths; every fourth request shares a system prompt."""
    rng = random.Random(seed)
    words = "the of and to in a is that for it as with was on be by this are from at or an".split()
    out = []
    for i in range(num_requests):
        n = rng.randint(min_prompt, max_prompt)
        text = " ".join(rng.choice(words) for _ in range(n))
        if i % 4 == 0:
            ids = tokenizer.encode_chat([{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": text[: n * 2]}])
        else:
            ids = tokenizer.encode(text)[:n]
        out.append((ids, rng.randint(min_out, max_out)))
    return out


class Recorder:
    def __init__(self, engine, t0: float) -> None:
        self.engine = engine
        self.t0 = t0
        self.samples: list[Sample] = []
        self.peak_running = 0
        self.peak_running_without_preemption = 0

    def sample(self, phase: str) -> None:
        from tideserve.core.kv_cache.memory import process_rss_bytes

        e = self.engine
        stats = e.stats()
        running = stats.num_requests_running
        self.peak_running = max(self.peak_running, running)
        if stats.num_preemptions == 0:
            self.peak_running_without_preemption = max(self.peak_running_without_preemption, running)
        self.samples.append(Sample(time.perf_counter() - self.t0, phase, stats.kv_cache_pool_bytes,
                                   e.pool.num_used_blocks(), stats.kv_cache_pool_blocks, process_rss_bytes(),
                                   stats.fragmentation_ratio, running, stats.num_preemptions))


def idle(engine, rec: Recorder, seconds: float, publish=None) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        engine.step()
        if publish:
            publish()
        rec.sample("idle")
        time.sleep(0.05)


def burst(engine, rec: Recorder, workload, publish=None) -> dict:
    from tideserve import SamplingParams

    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                              prompt_token_ids=p) for p, n in workload]
    done: dict[str, int] = {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = len(out.outputs[0].token_ids)
        if publish:
            publish()
        rec.sample("burst")
    elapsed = time.perf_counter() - t0
    generated = sum(done.values())
    return {"requests": len(ids), "completed": len(done), "lost": len(ids) - len(done),
            "seconds": elapsed, "output_tok_s": generated / elapsed}


def make_llm(args, static_bytes: int | None, probe=None, max_model_len: int | None = None,
             max_num_seqs: int | None = None):
    from tideserve import LLM
    from tideserve.core.kv_cache.elastic import ElasticConfig

    kwargs = dict(dtype=args.dtype, max_model_len=max_model_len or args.max_model_len,
                  max_num_seqs=max_num_seqs or args.num_requests, block_size=args.block_size,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    if probe is not None:
        kwargs["memory_probe"] = probe
    if static_bytes is not None:
        kwargs["kv_cache_memory"] = static_bytes
    else:
        kwargs["elastic"] = ElasticConfig(shrink_delay_s=args.shrink_delay, compaction_delay_s=1.0,
                                          margin_floor_bytes=args.margin_floor_mib * MiB)
    return LLM(**kwargs)


# ----------------------------------------------------------------------------- scenario 1
def scenario_single(args) -> dict:
    results = {}
    workload = None
    peak_bytes = None
    for mode in ("elastic", "static"):
        llm = make_llm(args, None if mode == "elastic" else peak_bytes)
        engine = llm.engine
        if workload is None:
            workload = build_workload(llm.tokenizer, args.num_requests, args.seed, 20, args.max_prompt,
                                      min(16, args.max_output), args.max_output)
        rec = Recorder(engine, time.perf_counter())
        idle(engine, rec, args.idle_seconds)
        idle_before = rec.samples[-1]
        stats0 = engine.stats()
        b = burst(engine, rec, workload)
        stats1 = engine.stats()
        idle(engine, rec, args.idle_seconds + args.shrink_delay + 1)
        idle_after = rec.samples[-1]
        steady = [s.fragmentation for s in rec.samples if s.phase == "burst"]
        hits = stats1.prefix_cache_hits - stats0.prefix_cache_hits
        queries = stats1.prefix_cache_queries - stats0.prefix_cache_queries
        prefill_tok_s = sum(len(p) for p, _ in workload) / max(1e-9, b["seconds"])  # rough: whole burst
        results[mode] = {
            "burst": b,
            "idle_pool_bytes_before": idle_before.pool_bytes, "idle_pool_bytes_after": idle_after.pool_bytes,
            "idle_rss_after": idle_after.rss_bytes,
            "peak_pool_bytes": max(s.pool_bytes for s in rec.samples),
            "peak_used_bytes": max(s.used_blocks for s in rec.samples) * engine.pool.bytes_per_block,
            "preemptions": stats1.num_preemptions,
            "fragmentation_median_burst": sorted(steady)[len(steady) // 2] if steady else 0.0,
            "prefix_hit_rate": hits / queries if queries else 0.0, "prefix_hit_tokens": hits,
            "prefill_seconds_saved_estimate": hits / prefill_tok_s if prefill_tok_s else 0.0,
            "samples": [asdict(s) for s in rec.samples],
        }
        if mode == "elastic":
            # The static baseline is sized for the burst's peak, as a user who knew it would size it.
            # (and never below one max_model_len request, which any pool must hold).
            one_request = -(-args.max_model_len // engine.kv_manager.block_size) * engine.pool.bytes_per_block
            peak_bytes = max(int(results["elastic"]["peak_used_bytes"] * 1.05), one_request)
        del llm, engine
    e, s = results["elastic"], results["static"]
    results["summary"] = {
        "idle_footprint_ratio": e["idle_pool_bytes_after"] / s["idle_pool_bytes_after"],
        "burst_throughput_ratio": e["burst"]["output_tok_s"] / s["burst"]["output_tok_s"],
        "lost": e["burst"]["lost"] + s["burst"]["lost"],
    }
    return results


# ----------------------------------------------------------------------------- scenario 2
class SharedDeviceProbe:
    """A simulated device of ``total`` bytes shared by several engines' KV pools (a shared array)."""

    def __init__(self, total: int, pools, index: int) -> None:
        self.total, self.pools, self.index = total, pools, index

    def available_bytes(self) -> int:
        return max(0, self.total - sum(self.pools))

    def total_bytes(self) -> int:
        return self.total

    def used_by_process_bytes(self) -> int:
        return self.pools[self.index]


def _engine_proc(args, index: int, mode: str, pools, turns, queue) -> None:
    import torch

    torch.set_num_threads(1)
    probe = SharedDeviceProbe(args.device_mib * MiB, pools, index)
    static = args.device_mib * MiB // 2 if mode == "static" else None
    llm = make_llm(args, static, probe, args.max_model_len2, args.num_requests2)
    engine = llm.engine

    def publish() -> None:
        pools[index] = engine.pool.pool_bytes

    publish()
    workload = build_workload(llm.tokenizer, args.num_requests2, args.seed + index, args.min_prompt2,
                              args.max_prompt2, args.min_output2, args.max_output2)
    rec = Recorder(engine, time.perf_counter())
    turns[index].wait(timeout=3600)  # wait for my turn
    b = burst(engine, rec, workload, publish)
    stats = engine.stats()
    turns[1 - index].set()  # hand the device over, and give memory back while idle
    idle(engine, rec, args.shrink_delay + 3, publish)
    queue.put({"index": index, "mode": mode, "burst": b, "preemptions": stats.num_preemptions,
               "peak_running": rec.peak_running,
               "peak_running_without_preemption": rec.peak_running_without_preemption,
               "peak_pool_bytes": max(s.pool_bytes for s in rec.samples),
               "samples": [asdict(s) for s in rec.samples]})


def scenario_two_engines(args) -> dict:
    ctx = mp.get_context("spawn")
    results = {}
    for mode in ("elastic", "static"):
        pools = ctx.Array("q", [0, 0], lock=False)
        turns = [ctx.Event(), ctx.Event()]
        queue = ctx.Queue()
        procs = [ctx.Process(target=_engine_proc, args=(args, i, mode, pools, turns, queue)) for i in (0, 1)]
        for p in procs:
            p.start()
            time.sleep(1.0)
        turns[0].set()
        got = [queue.get(timeout=3600) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        results[mode] = sorted(got, key=lambda r: r["index"])
    el = [r["peak_running_without_preemption"] for r in results["elastic"]]
    st = [r["peak_running_without_preemption"] for r in results["static"]]
    results["summary"] = {"elastic_peak_concurrent": el, "static_half_split_peak_concurrent": st,
                          "ratio": [a / b if b else float("inf") for a, b in zip(el, st)]}
    return results


# ----------------------------------------------------------------------------- report
def plot(results: dict, path: Path) -> None:
    """One row per scenario that ran: pool and RSS over time (and fragmentation) for one engine; both
    engines' pools over time, elastic beside static, for two."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [k for k in ("single", "two") if k in results]
    fig, axes = plt.subplots(len(rows), 2, figsize=(12, 3.5 * len(rows)), squeeze=False)
    for row, kind in zip(axes, rows):
        if kind == "single":
            for mode, color in (("elastic", "tab:blue"), ("static", "tab:orange")):
                samples = results["single"][mode]["samples"]
                t = [x["t"] for x in samples]
                row[0].plot(t, [x["pool_bytes"] / MiB for x in samples], color=color, label=f"{mode} pool")
                row[0].plot(t, [x["rss_bytes"] / MiB for x in samples], color=color, linestyle=":",
                            label=f"{mode} process RSS")
                row[1].plot(t, [x["fragmentation"] for x in samples], color=color, label=mode)
            row[0].set(title="One engine: idle, burst, idle", xlabel="s", ylabel="MiB")
            row[1].set(title="Fragmentation ratio", xlabel="s")
        else:
            for ax, mode in zip(row, ("elastic", "static")):
                for r, color in zip(results["two"][mode], ("tab:green", "tab:red")):
                    samples = r["samples"]
                    ax.plot([x["t"] for x in samples], [x["pool_bytes"] / MiB for x in samples], color=color,
                            label=f"engine {r['index']} pool")
                ax.set(title=f"Two engines, {mode} pools", xlabel="s", ylabel="MiB")
        for ax in row:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=400)
    ap.add_argument("--max-output", type=int, default=48)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--max-model-len2", type=int, default=512, help="scenario 2: max_model_len")
    ap.add_argument("--block-size", default="16")
    ap.add_argument("--idle-seconds", type=float, default=3.0)
    ap.add_argument("--shrink-delay", type=float, default=2.0)
    ap.add_argument("--margin-floor-mib", type=int, default=32)
    ap.add_argument("--device-mib", type=int, default=600, help="scenario 2: the simulated device")
    ap.add_argument("--num-requests2", type=int, default=128, help="scenario 2: requests per burst")
    ap.add_argument("--min-output2", type=int, default=48, help="scenario 2: outputs long enough that a "
                    "burst's requests overlap (memory, not the prefill rate, limits concurrency)")
    ap.add_argument("--max-output2", type=int, default=64)
    ap.add_argument("--min-prompt2", type=int, default=60)
    ap.add_argument("--max-prompt2", type=int, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-two", action="store_true")
    ap.add_argument("--skip-single", action="store_true")
    ap.add_argument("--out", default="memory-elasticity")
    args = ap.parse_args()
    args.block_size = "auto" if args.block_size == "auto" else int(args.block_size)

    results = {"args": vars(args)}
    if not args.skip_single:
        results["single"] = scenario_single(args)
        report_single(results["single"])
    if not args.skip_two:
        results["two"] = scenario_two_engines(args)
        t = results["two"]["summary"]
        print(f"two engines: peak concurrent without preemption elastic {t['elastic_peak_concurrent']} vs "
              f"static half split {t['static_half_split_peak_concurrent']} (ratio {t['ratio']})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def report_single(s: dict) -> None:
    print(f"single engine: idle footprint elastic/static = {s['summary']['idle_footprint_ratio']:.3f}, "
          f"burst throughput ratio = {s['summary']['burst_throughput_ratio']:.3f}, lost = {s['summary']['lost']}")
    for mode in ("elastic", "static"):
        r = s[mode]
        print(f"  {mode:8s} idle pool {r['idle_pool_bytes_after'] / MiB:8.1f} MiB, peak pool "
              f"{r['peak_pool_bytes'] / MiB:8.1f} MiB, burst {r['burst']['output_tok_s']:.1f} tok/s "
              f"in {r['burst']['seconds']:.1f}s, preemptions {r['preemptions']}, fragmentation (median "
              f"in burst) {r['fragmentation_median_burst']:.3f}, prefix hit rate {r['prefix_hit_rate']:.3f}"
              f", prefill saved ~{r['prefill_seconds_saved_estimate']:.2f}s")


if __name__ == "__main__":
    main()
