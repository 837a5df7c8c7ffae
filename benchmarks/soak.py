"""Soak: minutes of steady mixed load on a real ``tideserve serve`` process, watching for leaks.

Clients loop until the deadline, each request one of: a streaming completion read to the end, one
cancelled at a random point (before the headers, after them, or a few chunks in), a non-streaming
completion or chat, a batch of embeddings, and now and then a hostile body (deeply nested JSON, a body
over --max-body-size). /metrics is sampled every ``--interval`` seconds: the server's RSS, KV blocks used
by requests, pool size, running and waiting requests. After the load stops, the used blocks and running
requests must come back to zero; RSS is reported over time with its slope over the second half of the run.

    .venv/bin/python benchmarks/soak.py --duration 180 --out out/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

MiB = 2**20
PROMPTS = ["Once upon a time", "The capital of France is", "写一首关于春天的诗", "List three colours:",
           "def fibonacci(n):", "In 1969, the first", "Explain quantum computing in one sentence."]


def scrape(url: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10, trust_env=False).text.splitlines():
        if line and not line.startswith("#"):
            name, _, number = line.rpartition(" ")
            values.setdefault(name.split("{", 1)[0], float(number))
    return values


async def one(client: httpx.AsyncClient, rng: random.Random, i: int, max_tokens: int, cancel_share: float) -> str:
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": rng.randint(4, max_tokens), "ignore_eos": True,
            "temperature": rng.choice([0.0, 0.8]), "seed": i}
    roll = rng.random()
    if roll < 0.02:  # hostile bodies: the answer must be a 4xx, never a 5xx or a reset
        raw = b"[" * 100_000 + b"]" * 100_000 if rng.random() < 0.5 else b'{"prompt": "' + b"x" * 17 * MiB + b'"}'
        r = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        return f"hostile-{r.status_code}"
    if roll < cancel_share:
        point = rng.choice(["before_headers", "after_headers", "mid_stream"])
        if point == "before_headers":
            task = asyncio.ensure_future(client.post("/v1/completions", json={**body, "stream": True}))
            await asyncio.sleep(rng.uniform(0, 0.3))
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, httpx.HTTPError):
                pass
            return "cancelled"
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            chunks = 0 if point == "after_headers" else rng.randint(1, 8)
            async for line in r.aiter_lines():
                chunks -= line.startswith("data: ")
                if chunks <= 0:
                    break
        return "cancelled"
    if roll < cancel_share + (1 - cancel_share) / 2:
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = [line async for line in r.aiter_lines() if line]
        return f"stream-{r.status_code}" if lines and lines[-1] == "data: [DONE]" else "stream-incomplete"
    kind = rng.random()
    if kind < 0.25:  # a batch of embeddings, prefilled beside the completions
        inputs = [PROMPTS[(i + k) % len(PROMPTS)] * rng.randint(1, 20) for k in range(rng.randint(1, 8))]
        r = await client.post("/v1/embeddings", json={"input": inputs})
        ok = r.status_code == 200 and len(r.json()["data"]) == len(inputs)
        return f"embed-{r.status_code}" if ok else "embed-incomplete"
    if kind < 0.625:
        r = await client.post("/v1/completions", json=body)
    else:
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": body["prompt"]}], "max_tokens": body["max_tokens"]})
    return f"plain-{r.status_code}"


async def load(url: str, seconds: float, concurrency: int, max_tokens: int, cancel_share: float,
               seed: int) -> Counter:
    rng = random.Random(seed)
    outcomes: Counter = Counter()
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits, trust_env=False) as client:
        async def worker(w: int) -> None:
            i = w
            while time.monotonic() < deadline:
                try:
                    outcomes[await one(client, rng, i, max_tokens, cancel_share)] += 1
                except httpx.HTTPError as exc:
                    outcomes[f"client-error-{type(exc).__name__}"] += 1
                i += concurrency

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return outcomes


def sample(url: str, t0: float, phase: str) -> dict:
    m = scrape(url)
    return {"t": round(time.monotonic() - t0, 1), "phase": phase, "rss_bytes": m["process_resident_memory_bytes"],
            "used_blocks": m["vllm:kv_cache_used_blocks"], "pool_blocks": m["vllm:kv_cache_pool_blocks"],
            "pool_bytes": m["vllm:kv_cache_pool_bytes"], "running": m["vllm:num_requests_running"],
            "waiting": m["vllm:num_requests_waiting"]}


def slope_mib_per_min(rows: list[dict]) -> float:
    if len(rows) < 2:
        return 0.0
    ts = [r["t"] / 60 for r in rows]
    ys = [r["rss_bytes"] / MiB for r in rows]
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    den = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / den if den else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--cancel-share", type=float, default=0.4, help="share of requests cancelled mid-way")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS of the server (0: its default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the samples and summary as JSON")
    args = ap.parse_args()

    from tideserve.bench.launch import ServerProcess, free_port

    port = free_port()
    cmd = [sys.executable, "-m", "tideserve", "serve", "--port", str(port), "--dtype", args.dtype,
           "--max-model-len", str(args.max_model_len), "--log-level", "warning"]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
    rows: list[dict] = []
    with ServerProcess(cmd, port, env=env, ready_timeout_s=300, name="tideserve-soak") as srv:
        url = srv.base_url
        t0 = time.monotonic()
        rows.append(sample(url, t0, "idle"))
        stop = False

        async def sampler() -> None:
            while not stop:
                await asyncio.sleep(args.interval)
                rows.append(await asyncio.to_thread(sample, url, t0, "load"))
                r = rows[-1]
                print(f"t={r['t']:6.1f}s rss={r['rss_bytes'] / MiB:7.1f} MiB used_blocks={r['used_blocks']:5.0f} "
                      f"pool={r['pool_bytes'] / MiB:6.1f} MiB running={r['running']:3.0f} waiting={r['waiting']:3.0f}",
                      flush=True)

        async def run() -> Counter:
            nonlocal stop
            task = asyncio.create_task(sampler())
            try:
                return await load(url, args.duration, args.concurrency, args.max_tokens, args.cancel_share,
                                  args.seed)
            finally:
                stop = True
                await task

        outcomes = asyncio.run(run())
        settle_start = time.monotonic()
        while time.monotonic() - settle_start < 30:
            rows.append(sample(url, t0, "after"))
            if rows[-1]["used_blocks"] == 0 and rows[-1]["running"] == 0 and rows[-1]["waiting"] == 0:
                break
            time.sleep(0.5)
        settled_s = time.monotonic() - settle_start
        health = httpx.get(url + "/health", timeout=10, trust_env=False).status_code
    load_rows = [r for r in rows if r["phase"] == "load"]
    second_half = [r for r in load_rows if r["t"] >= args.duration / 2]
    final = rows[-1]
    summary = {
        "command": " ".join(cmd[1:]), "duration_s": args.duration, "concurrency": args.concurrency,
        "outcomes": dict(sorted(outcomes.items())), "requests": sum(outcomes.values()),
        "server_errors": sum(v for k, v in outcomes.items() if k.endswith(("-500", "-502", "-503"))),
        "rss_start_mib": rows[0]["rss_bytes"] / MiB,
        "rss_first_load_sample_mib": load_rows[0]["rss_bytes"] / MiB if load_rows else None,
        "rss_peak_mib": max(r["rss_bytes"] for r in rows) / MiB, "rss_end_mib": final["rss_bytes"] / MiB,
        "rss_slope_second_half_mib_per_min": slope_mib_per_min(second_half),
        "used_blocks_peak": max(r["used_blocks"] for r in rows), "used_blocks_after": final["used_blocks"],
        "running_after": final["running"], "waiting_after": final["waiting"],
        "seconds_to_settle_after_load": settled_s, "health_after": health,
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "samples": rows}, indent=1) + "\n")
    ok = final["used_blocks"] == 0 and final["running"] == 0 and summary["server_errors"] == 0 and health == 200
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
