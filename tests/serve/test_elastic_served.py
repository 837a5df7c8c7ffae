"""A real ``tideserve serve`` process: a burst grows the elastic pool, and once the burst is over the idle
server gives the memory back on its own (no request, no step), within shrink_delay + 5 s, and the
process's resident set follows. Read the way an operator reads it: from /metrics."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import httpx
import pytest

from tideserve.bench.launch import ServerProcess, free_port

pytestmark = pytest.mark.slow  # starts processes: run by `make test`, skipped by `-m "not slow"`

SHRINK_DELAY_S = 1.0
MODEL = "SmolLM2-135M-Instruct.Q4_1"
SYSTEM = "You are a terse assistant for a ferry company. Answer in one sentence and never invent times. " * 3


def scrape(base_url: str) -> dict[str, float]:
    """The unlabelled value of each metric family we read (the server serves one model)."""
    text = httpx.get(base_url + "/metrics", timeout=10, trust_env=False).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, _, number = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        values[name] = float(number)
    return values


async def burst(base_url: str, n: int, shared: bool = True) -> tuple[list[int], list[float]]:
    """n chat requests at once (every other one behind a shared system prompt, if ``shared``); returns
    their prompt token counts and the pool sizes (blocks) seen on /metrics every 50 ms meanwhile."""
    prompt_tokens: list[int] = []
    pool_blocks: list[float] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=300, trust_env=False) as client:
        async def one(i: int) -> None:
            messages = [{"role": "user", "content": f"Question {i}: when does the boat to island {i} leave?"}]
            if shared and i % 2 == 0:
                messages.insert(0, {"role": "system", "content": SYSTEM})
            r = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": messages, "max_tokens": 48, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 48
            prompt_tokens.append(r.json()["usage"]["prompt_tokens"])

        async def watch(done: asyncio.Event) -> None:
            while not done.is_set():
                text = (await client.get("/metrics")).text
                pool_blocks.extend(float(line.rpartition(" ")[2]) for line in text.splitlines()
                                   if line.startswith("vllm:kv_cache_pool_blocks"))
                await asyncio.sleep(0.05)

        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        await asyncio.gather(*(one(i) for i in range(n)))
        done.set()
        await watcher
    return prompt_tokens, pool_blocks


@pytest.fixture(scope="module")
def elastic_server():
    port = free_port()
    cmd = [sys.executable, "-m", "tideserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "512", "--kv-cache-shrink-delay", str(SHRINK_DELAY_S),
           "--block-size", "16"]
    env = {k: v for k, v in os.environ.items() if k != "TIDESERVE_API_KEY"} | {"OMP_NUM_THREADS": "2"}
    with ServerProcess(cmd, port, env=env, ready_timeout_s=180, name="tideserve-elastic") as srv:
        yield srv


def test_idle_server_returns_the_pool_and_its_memory(elastic_server):
    url = elastic_server.base_url
    start = scrape(url)
    floor_bytes = start["vllm:kv_cache_pool_bytes"]
    prompt_tokens, pool_blocks = asyncio.run(burst(url, 32))
    ended = time.monotonic()
    after_burst = scrape(url)
    assert after_burst["vllm:kv_cache_resizes_total"] >= 1
    # The burst's large growths had their pages committed on a background thread (lent a core where the
    # step's threads hold every one) before the pool took them.
    assert after_burst["vllm:kv_cache_background_commits_total"] >= 1
    peak_rss = after_burst["process_resident_memory_bytes"]

    deadline = ended + SHRINK_DELAY_S + 5
    samples = []
    while True:
        now = scrape(url)
        samples.append(now["vllm:kv_cache_pool_bytes"])
        held = now["vllm:kv_cache_used_blocks"] + now["vllm:kv_cache_cached_blocks"]
        per_block = now["vllm:kv_cache_pool_bytes"] / now["vllm:kv_cache_pool_blocks"]
        if now["vllm:kv_cache_pool_bytes"] <= floor_bytes + held * per_block:
            break
        assert time.monotonic() < deadline, (
            f"the idle pool was not back at its floor {SHRINK_DELAY_S + 5:.0f} s after the burst: {samples}")
        time.sleep(0.25)
    released = max(samples[0], after_burst["vllm:kv_cache_pool_bytes"]) - now["vllm:kv_cache_pool_bytes"]
    assert released > 20 * 2**20, f"the burst should have grown the pool well beyond its floor: {samples}"
    assert now["vllm:num_requests_running"] == 0
    # Cached prefixes that were hit (the shared system prompt) stay; at most a reserve beyond them.
    assert now["vllm:kv_cache_cached_blocks"] >= 1
    # The process's resident set follows: most of what the pool released left the process.
    rss = scrape(url)["process_resident_memory_bytes"]
    assert peak_rss - rss >= 0.7 * released, (peak_rss, rss, released)
    # And the server still answers: the pool grows again, never past what the burst's requests could hold
    # (prompt + 48 tokens each, 16-token blocks), though they all hold their last block at once and the
    # high watermark alone would ask for 1 / 0.85 of that.
    prompt_tokens, pool_blocks = asyncio.run(burst(url, 32, shared=False))
    demand = sum(-(-(p + 48) // 16) for p in prompt_tokens)
    assert max(pool_blocks) > now["vllm:kv_cache_pool_blocks"]
    assert max(pool_blocks) <= demand, (max(pool_blocks), demand)
