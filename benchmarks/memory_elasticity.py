"""Memory elasticity of one engine, measured where users meet it.

Scenario "served": a real ``tideserve serve`` process gets a burst of chat requests (prompts of about
``--prompt-len`` tokens, half of them sharing a long system prompt), then nothing. /metrics is sampled
every 0.25 s: pool bytes, used and cached blocks, block size, process RSS. Reported: how long after the
last request the pool was back at its floor (the floor plus the cached prefixes it keeps), the idle
pool against the blocks its cached prefixes need, and how far RSS fell.

Scenario "throughput": the same burst offline, elastic pool against a static pool of the elastic run's
peak size (what a user who knew the peak would reserve; given as a block count, so the static engine keeps
the same max_num_seqs), interleaved and repeated. Reported: output tok/s of each and their ratio,
preemptions, and the time the elastic pool spent resizing.

    .venv/bin/python benchmarks/memory_elasticity.py --out out/memory-elasticity
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

MiB = 2**20
SYSTEM = ("You are the support assistant of a large online bookshop. Be polite, answer in at most three "
          "sentences, never invent order numbers, and escalate refunds above fifty euros. ") * 4
WORDS = "the of and to in a is that for it as with was on be by this are from at or an tide ferry".split()


def user_text(i: int, tokens: int) -> str:
    return f"Customer {i} writes: " + " ".join(WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(tokens))


def chat_messages(i: int, prompt_len: int, system_tokens: int) -> list[dict]:
    """Every other request shares the system prompt; all end up near prompt_len tokens."""
    if i % 2 == 0:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user_text(i, prompt_len -
                                                                                            system_tokens)}]
    return [{"role": "user", "content": user_text(i, prompt_len)}]


def scrape(url: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10, trust_env=False).text.splitlines():
        if line and not line.startswith("#"):
            name, _, number = line.rpartition(" ")
            values[name.split("{", 1)[0]] = float(number)
    return values


async def served_burst(url: str, model: str, n: int, prompt_len: int, output_len: int, system_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=900, trust_env=False) as client:
        async def one(i: int) -> int:
            r = await client.post("/v1/chat/completions", json={
                "model": model, "messages": chat_messages(i, prompt_len, system_tokens), "max_tokens": output_len,
                "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(i) for i in range(n)))
        return {"seconds": time.perf_counter() - start, "output_tokens": sum(tokens)}


def scenario_served(args) -> dict:
    from tideserve.bench.launch import ServerProcess, free_port

    port = free_port()
    cmd = [sys.executable, "-m", "tideserve.cli", "serve", "--port", str(port), "--dtype", args.dtype,
           "--max-model-len", str(args.max_model_len), "--kv-cache-shrink-delay", str(args.shrink_delay)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    samples: list[dict] = []
    with ServerProcess(cmd, port, env=env, ready_timeout_s=300, name="tideserve-elastic") as srv:
        url = srv.base_url
        model = httpx.get(url + "/v1/models", trust_env=False).json()["data"][0]["id"]
        t0 = time.perf_counter()

        def sample(phase: str) -> dict:
            m = scrape(url)
            row = {"t": time.perf_counter() - t0, "phase": phase, "pool_bytes": m["vllm:kv_cache_pool_bytes"],
                   "pool_blocks": m["vllm:kv_cache_pool_blocks"], "used_blocks": m["vllm:kv_cache_used_blocks"],
                   "cached_blocks": m["vllm:kv_cache_cached_blocks"], "block_size": m["vllm:kv_cache_block_size"],
                   "rss_bytes": m["process_resident_memory_bytes"],
                   "fragmentation": m["vllm:fragmentation_ratio"], "preemptions": m["vllm:num_preemptions_total"]}
            samples.append(row)
            return row

        before = sample("idle")
        time.sleep(1.0)
        stop = False

        async def sampler() -> None:
            while not stop:
                await asyncio.to_thread(sample, "burst")
                await asyncio.sleep(0.25)

        async def run() -> dict:
            nonlocal stop
            task = asyncio.create_task(sampler())
            result = await served_burst(url, model, args.num_requests, args.prompt_len, args.output_len,
                                        args.system_tokens)
            stop = True
            await task
            return result

        burst = asyncio.run(run())
        ended = time.perf_counter() - t0
        back_at = None
        while time.perf_counter() - t0 < ended + args.idle_seconds:
            row = sample("idle")
            per_block = row["pool_bytes"] / max(1, row["pool_blocks"])
            # The floor: the reserve (rounded up to whole blocks of the current size) or the kept cache.
            floor = max(before["pool_bytes"], row["cached_blocks"] * per_block) + per_block
            if back_at is None and row["pool_bytes"] <= floor:
                back_at = row["t"]
            time.sleep(0.25)
        last = samples[-1]
    peak = max(samples, key=lambda r: r["pool_bytes"])
    return {
        "burst": burst, "burst_output_tok_s": burst["output_tokens"] / burst["seconds"],
        "floor_bytes": before["pool_bytes"], "peak_pool_bytes": peak["pool_bytes"],
        "seconds_to_floor_after_last_request": None if back_at is None else back_at - ended,
        "idle_pool_blocks": last["pool_blocks"], "idle_cached_blocks": last["cached_blocks"],
        "floor_blocks": before["pool_blocks"],
        "idle_pool_over_cache": last["pool_blocks"] / max(1.0, last["cached_blocks"]),
        "rss_before": before["rss_bytes"], "rss_peak": max(r["rss_bytes"] for r in samples),
        "rss_idle_after": last["rss_bytes"], "preemptions": last["preemptions"], "samples": samples,
        "command": " ".join(cmd[1:]),
    }


def scenario_throughput(args) -> dict:
    from tideserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    runs: dict[str, list[dict]] = {"elastic": [], "static": []}
    peak_bytes = peak_blocks = None
    for _ in range(args.repeats):
        for mode in ("elastic", "static"):
            kwargs = dict(dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.num_requests,
                          block_size=16)
            if mode == "static":  # the same number of blocks (num_blocks keeps max_num_seqs as it is)
                kwargs["num_blocks"] = peak_blocks
            llm = LLM(**kwargs)
            tok = llm.tokenizer
            system_tokens = len(tok.encode_chat([{"role": "system", "content": SYSTEM}]))
            prompts = [tok.encode_chat(chat_messages(i, args.prompt_len, system_tokens))
                       for i in range(args.num_requests)]
            start = time.perf_counter()
            llm.generate(prompts, params)
            seconds = time.perf_counter() - start
            engine = llm.engine
            if mode == "elastic" and peak_bytes is None:
                peak_bytes = engine.pool.pool_bytes  # the pool is at its peak right after the burst
                peak_blocks = engine.kv_manager.num_blocks
            runs[mode].append({"seconds": seconds, "tok_s": args.num_requests * args.output_len / seconds,
                               "preemptions": engine.scheduler.num_preemptions, "resizes": engine.pool.num_resizes,
                               "resize_seconds": engine.pool.resize_seconds, "pool_bytes": engine.pool.pool_bytes})
            del llm, engine
    med = {m: statistics.median(r["tok_s"] for r in rs) for m, rs in runs.items()}
    return {"runs": runs, "static_pool_bytes": peak_bytes, "median_tok_s": med,
            "elastic_over_static": med["elastic"] / med["static"]}


def plot(served: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = served["samples"]
    t = [x["t"] for x in s]
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.plot(t, [x["pool_bytes"] / MiB for x in s], label="KV pool")
    ax.plot(t, [x["rss_bytes"] / MiB for x in s], linestyle=":", label="process RSS")
    ax.set(title="tideserve serve: burst, then idle", xlabel="s", ylabel="MiB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=384)
    ap.add_argument("--system-tokens", type=int, default=0, help="0: measure with the model's tokenizer")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--shrink-delay", type=float, default=5.0)
    ap.add_argument("--idle-seconds", type=float, default=20.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-served", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--out", default="out/memory-elasticity")
    args = ap.parse_args()
    if not args.system_tokens:
        from tideserve.model.loader import default_model_path
        from tideserve.tokenizer.tokenizer import load_tokenizer

        tok = load_tokenizer(default_model_path())
        args.system_tokens = len(tok.encode_chat([{"role": "system", "content": SYSTEM}]))
    results: dict = {"args": vars(args)}
    if not args.skip_served:
        s = results["served"] = scenario_served(args)
        print(f"served: burst of {args.num_requests} chats ({args.prompt_len}-token prompts, half sharing a "
              f"{args.system_tokens}-token system prompt, {args.output_len} output tokens) in "
              f"{s['burst']['seconds']:.1f} s; pool {s['floor_bytes'] / MiB:.1f} -> {s['peak_pool_bytes'] / MiB:.1f}"
              f" MiB; back at the floor {s['seconds_to_floor_after_last_request']} s after the last request "
              f"(shrink delay {args.shrink_delay} s); idle pool {s['idle_pool_blocks']:.0f} blocks for "
              f"{s['idle_cached_blocks']:.0f} cached-prefix blocks + a floor of {s['floor_blocks']:.0f}; RSS "
              f"{s['rss_before'] / MiB:.0f} -> {s['rss_peak'] / MiB:.0f} -> {s['rss_idle_after'] / MiB:.0f} MiB; "
              f"preemptions {s['preemptions']:.0f}")
    if not args.skip_throughput:
        t = results["throughput"] = scenario_throughput(args)
        print(f"throughput: elastic {t['median_tok_s']['elastic']:.1f} tok/s, static pool of the elastic peak "
              f"({t['static_pool_bytes'] / MiB:.0f} MiB) {t['median_tok_s']['static']:.1f} tok/s: ratio "
              f"{t['elastic_over_static']:.3f} (medians of {args.repeats} interleaved runs)")
        for mode, rs in t["runs"].items():
            print(f"  {mode}: " + ", ".join(f"{r['tok_s']:.1f} tok/s ({r['resizes']} resizes, "
                                            f"{r['resize_seconds'] * 1e3:.0f} ms resizing)" for r in rs))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    if "served" in results:
        plot(results["served"], out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
