"""Load generator for any OpenAI-compatible server: streams every request and times each chunk.

It speaks only the public API (``/v1/completions`` or ``/v1/chat/completions`` with ``stream: true``
and ``stream_options.include_usage``), so the same client measures tideserve, vLLM, llama.cpp's server
and TGI the same way. Semantics follow ``vllm bench serve``: with an infinite request rate every request
is released at t=0, otherwise arrivals are Poisson; ``max_concurrency`` is a client-side semaphore, and
latencies are measured from when a request is sent (time spent waiting for the semaphore is not a
server's latency).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from tideserve.bench.datasets import SampleRequest, TokenizerLike
from tideserve.bench.report import RequestRecord, make_run

logger = logging.getLogger(__name__)

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class ServeBenchConfig:
    base_url: str
    model: str
    endpoint: str = "completions"  # "completions" | "chat"
    max_concurrency: int | None = None
    request_rate: float = math.inf
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    warmup: int = 0
    api_key: str | None = None
    request_timeout_s: float = 600.0
    ready_timeout_s: float = 120.0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint {self.endpoint!r} is not one of {', '.join(ENDPOINTS)}.")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency={self.max_concurrency} must be at least 1.")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate={self.request_rate} must be positive (or inf).")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} must be >= 0.")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/").removesuffix("/v1") + ENDPOINTS[self.endpoint]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def build_payload(cfg: ServeBenchConfig, req: SampleRequest, max_tokens: int | None = None) -> dict[str, Any]:
    """The request body; ``ignore_eos`` is a vLLM/llama.cpp extension, so it is sent only when asked for."""
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": max_tokens or req.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body


def _chunk_text(choice: dict[str, Any]) -> str:
    if "text" in choice:  # completions
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or ""


async def send_request(client: httpx.AsyncClient, cfg: ServeBenchConfig, req: SampleRequest, index: int,
                       tokenizer: TokenizerLike | None, t_origin: float) -> RequestRecord:
    """Stream one request. Never raises: every failure becomes a record with ``success=False``."""
    rec = RequestRecord(index=index, prompt_tokens=req.prompt_len, expected_output_tokens=req.output_len)
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    start = time.perf_counter()
    rec.start_s = start - t_origin
    last = start
    try:
        async with client.stream("POST", cfg.url, json=build_payload(cfg, req), headers=cfg.headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status_code}: {_error_message(body)}"
                return rec
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separators, comments (": ping"), "event:" lines
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    rec.error = f"stream error: {_error_message(json.dumps(obj))}"
                    return rec
                if obj.get("usage"):
                    usage = obj["usage"]
                for choice in obj.get("choices") or []:
                    text = _chunk_text(choice)
                    if not text:
                        continue
                    now = time.perf_counter()
                    if rec.ttft_s is None:
                        rec.ttft_s = now - start
                    else:
                        rec.itl_s.append(now - last)
                    last = now
                    parts.append(text)
        rec.e2el_s = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
        return rec
    rec.generated_text = "".join(parts)
    if usage and usage.get("completion_tokens") is not None:
        rec.output_tokens = int(usage["completion_tokens"])
        rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
        rec.usage_from_server = True
    elif tokenizer is not None:
        rec.output_tokens = len(tokenizer.encode(rec.generated_text, add_special_tokens=False))
    else:
        rec.output_tokens = len(parts)  # chunks: the best guess without usage or a tokenizer
    if rec.ttft_s is None and rec.output_tokens == 0:
        rec.error = "the server streamed no output"
        return rec
    rec.success = True
    return rec


def _error_message(body: str) -> str:
    """The ``error.message`` of an OpenAI-shaped error body, else the body itself (shortened)."""
    try:
        obj = json.loads(body)
        err = obj.get("error", obj)
        msg = err.get("message") if isinstance(err, dict) else str(err)
        return str(msg or body)[:300]
    except (json.JSONDecodeError, AttributeError):
        return body[:300]


def _client(cfg: ServeBenchConfig) -> httpx.AsyncClient:
    # trust_env=False: a benchmark talks to the server directly, never through an environment proxy.
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency)
    return httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout_s), limits=limits, trust_env=False)


async def wait_until_ready(client: httpx.AsyncClient, cfg: ServeBenchConfig, req: SampleRequest) -> None:
    """Send a one-token request until it succeeds, as vLLM's readiness check does.

    Connection errors and 5xx answers are retried until ``ready_timeout_s``; a 4xx answer (wrong model
    name, bad key) will not fix itself, so it fails at once with the server's message.
    """
    deadline = time.monotonic() + cfg.ready_timeout_s
    probe = SampleRequest(req.prompt, req.prompt_token_ids, 1)
    while True:
        rec = await send_request(client, cfg, probe, -1, None, time.perf_counter())
        if rec.success:
            return
        if rec.error and rec.error.startswith("HTTP 4"):
            raise ValueError(f"the server at {cfg.url} rejected the test request: {rec.error}")
        if time.monotonic() > deadline:
            raise ValueError(f"the server at {cfg.url} was not ready within {cfg.ready_timeout_s:.0f}s "
                             f"(last error: {rec.error}).")
        await asyncio.sleep(0.5)


async def _run_requests(client: httpx.AsyncClient, cfg: ServeBenchConfig, requests: list[SampleRequest],
                        tokenizer: TokenizerLike | None, bar: Any) -> tuple[list[RequestRecord], float]:
    semaphore = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    rng = random.Random(cfg.seed)
    t_origin = time.perf_counter()

    async def one(i: int, req: SampleRequest) -> RequestRecord:
        if semaphore is None:
            rec = await send_request(client, cfg, req, i, tokenizer, t_origin)
        else:
            async with semaphore:
                rec = await send_request(client, cfg, req, i, tokenizer, t_origin)
        if bar is not None:
            bar.update(1)
        return rec

    tasks = []
    for i, req in enumerate(requests):
        tasks.append(asyncio.create_task(one(i, req)))
        if not math.isinf(cfg.request_rate) and i + 1 < len(requests):
            await asyncio.sleep(rng.expovariate(cfg.request_rate))  # Poisson arrivals
    records = list(await asyncio.gather(*tasks))
    return records, time.perf_counter() - t_origin


async def run_serve_benchmark_async(requests: list[SampleRequest], cfg: ServeBenchConfig,
                                    tokenizer: TokenizerLike | None = None) -> dict[str, Any]:
    """Readiness check, warmup, then the timed run; returns one ``runs`` entry (see report.py)."""
    if not requests:
        raise ValueError("no requests to send.")
    async with _client(cfg) as client:
        await wait_until_ready(client, cfg, requests[0])
        if cfg.warmup:
            warm = [requests[i % len(requests)] for i in range(cfg.warmup)]
            recs, _ = await _run_requests(client, cfg, warm, tokenizer, None)
            failed = sum(not r.success for r in recs)
            if failed:
                logger.warning("%d of %d warmup requests failed", failed, len(recs))
        bar = _progress_bar(len(requests), cfg)
        try:
            records, duration = await _run_requests(client, cfg, requests, tokenizer, bar)
        finally:
            if bar is not None:
                bar.close()
    return make_run(records, duration, max_concurrency=cfg.max_concurrency, request_rate=cfg.request_rate)


def run_serve_benchmark(requests: list[SampleRequest], cfg: ServeBenchConfig,
                        tokenizer: TokenizerLike | None = None) -> dict[str, Any]:
    return asyncio.run(run_serve_benchmark_async(requests, cfg, tokenizer))


def _progress_bar(total: int, cfg: ServeBenchConfig) -> Any:
    if not cfg.progress:
        return None
    from tqdm import tqdm

    conc = cfg.max_concurrency or "inf"
    return tqdm(total=total, desc=f"bench serve (concurrency {conc})", unit="req")


def discover_model(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """The first model ``GET /v1/models`` lists, for when ``--model`` is not given."""
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(url, headers=headers, timeout=timeout_s, trust_env=False)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"--model not given and {url} did not list a model ({exc}); pass --model.") from None
