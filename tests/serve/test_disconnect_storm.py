"""Clients that go away at random points leave nothing behind: after a storm of 200 streaming requests
cancelled before the headers, after them, or a few chunks into the stream, the engine holds no KV block
and runs no request; a short mixed soak keeps used blocks at zero between rounds and RSS bounded.
(benchmarks/soak.py is the long version, against a real server process.)"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tideserve.serve.config import ServerConfig
from tideserve.serve.openai.server import build_app

pytestmark = pytest.mark.slow  # the model end to end for seconds: `make test` runs it, `-m 'not slow'` does not

STORM_REQUESTS = 200
CONCURRENCY = 48
SOAK_SECONDS = 12.0
PROMPTS = ["Once upon a time", "The capital of France is", "写一首关于春天的诗", "List three colours:",
           "def fibonacci(n):", "In 1969, the first"]


@pytest.fixture(scope="module")
def server(shared_engine, server_thread):
    with server_thread(build_app(ServerConfig(), engine=shared_engine)) as s:
        yield s


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except OSError:
        pytest.skip("no /proc/self/statm: RSS cannot be read here")


async def one_request(client: httpx.AsyncClient, rng: random.Random, i: int, cancel: bool) -> str:
    """A streaming completion, cancelled at a random point when ``cancel`` (else read to the end)."""
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": rng.randint(4, 32), "stream": True,
            "ignore_eos": True, "temperature": rng.choice([0.0, 0.8]), "seed": i}
    if not cancel:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            return "completed" if [line async for line in r.aiter_lines()][-2:][0] == "data: [DONE]" else "?"
    point = rng.choice(["before_headers", "after_headers", "mid_stream"])
    if point == "before_headers":
        task = asyncio.ensure_future(client.post("/v1/completions", json=body))
        await asyncio.sleep(rng.uniform(0.0, 0.2))
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, httpx.HTTPError):
            pass
        return point
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        chunks = 0 if point == "after_headers" else rng.randint(1, 6)
        async for line in r.aiter_lines():
            chunks -= line.startswith("data: ")
            if chunks <= 0:
                break
    return point  # leaving the block with the body unread closes the connection: a disconnect


async def storm(url: str, n: int, seed: int, cancel_share: float = 1.0) -> dict[str, int]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=0)
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        async def guarded(i: int) -> str:
            async with gate:
                return await one_request(client, rng, i, cancel=rng.random() < cancel_share)

        outcomes = await asyncio.gather(*(guarded(i) for i in range(n)))
    return {k: outcomes.count(k) for k in set(outcomes)}


def settled(engine) -> bool:
    sched = engine.engine.scheduler
    kv = engine.engine.kv_manager
    return (engine.num_active() == 0 and not sched.running and not sched.waiting
            and kv.num_free_blocks == kv.num_blocks)  # cached prefixes count as free: evictable, unowned


def test_disconnect_storm_leaves_no_blocks_and_no_requests(server, shared_engine, wait_until):
    kv = shared_engine.engine.kv_manager
    total = kv.num_blocks
    outcomes = asyncio.run(asyncio.wait_for(storm(server.url, STORM_REQUESTS, seed=7), 240))
    assert sum(outcomes.values()) == STORM_REQUESTS and len(outcomes) == 3, outcomes  # all three cancel points
    wait_until(lambda: settled(shared_engine), 30, "every cancelled request to be freed")
    assert kv.num_free_blocks == total
    # The stats snapshot is taken by the engine thread after it applied the aborts and ran its idle upkeep,
    # so it may trail the scheduler by one loop turn: wait for it rather than race it.
    wait_until(lambda: (lambda s: s.kv_cache_used_blocks == 0 and s.num_requests_running == 0)(
        shared_engine.stats()), 10, "the engine's stats snapshot to show no used block and no running request")
    wait_until(lambda: metric(httpx.get(server.url + "/metrics").text, "vllm:kv_cache_used_blocks") == 0, 10,
               "/metrics to show no used block")
    text = httpx.get(server.url + "/metrics").text
    assert metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:num_requests_waiting") == 0
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200  # the engine still serves


def test_mini_soak_keeps_blocks_at_zero_and_rss_bounded(server, shared_engine, wait_until):
    """Rounds of mixed load (half the streams read to the end, half cancelled) for about 12 s: after every
    round nothing is held, and RSS after the warm-up round grows by less than 64 MiB."""
    rss: list[int] = []
    start = time.monotonic()
    rounds = 0
    while time.monotonic() - start < SOAK_SECONDS or rounds < 3:
        outcomes = asyncio.run(asyncio.wait_for(storm(server.url, 40, seed=100 + rounds, cancel_share=0.5), 240))
        assert outcomes.get("completed", 0) > 0, outcomes
        wait_until(lambda: settled(shared_engine), 30, f"round {rounds} to be freed")
        rss.append(rss_bytes())
        rounds += 1
    growth = rss[-1] - rss[0]
    assert growth < 64 * 2**20, [f"{r / 2**20:.0f} MiB" for r in rss]
