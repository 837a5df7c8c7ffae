"""Offline throughput: tideserve's engine on a benchmark workload, without HTTP.

``LLM.generate`` returns only when every request is done, so this drives the same loop it runs
(``engine.add_request`` then ``engine.step`` until nothing is left) and notes when each request streams a
token and finishes. That gives per-request TTFT, ITL and E2E in the same record shape as the HTTP client,
and lets ``max_concurrency`` cap the requests in flight (a new one is added as soon as one finishes),
which is what a client with that concurrency would see, without reloading the engine per level.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from tideserve.bench.datasets import SampleRequest
from tideserve.bench.report import RequestRecord, make_run
from tideserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _params(req: SampleRequest, ignore_eos: bool, temperature: float, seed: int | None) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=req.output_len, ignore_eos=ignore_eos,
                          seed=seed)


def _run(llm: Any, requests: list[SampleRequest], max_concurrency: int | None, ignore_eos: bool,
         temperature: float, seed: int | None, bar: Any) -> tuple[list[RequestRecord], float]:
    engine = llm.engine
    records = [RequestRecord(index=i, prompt_tokens=r.prompt_len, expected_output_tokens=r.output_len)
               for i, r in enumerate(requests)]
    pending = deque(range(len(requests)))
    inflight: dict[str, tuple[int, float, float]] = {}  # request id -> (index, submit time, last token time)
    t_origin = time.perf_counter()
    while pending or inflight:
        while pending and (max_concurrency is None or len(inflight) < max_concurrency):
            i = pending.popleft()
            req, rec = requests[i], records[i]
            now = time.perf_counter()
            rec.start_s = now - t_origin
            try:
                rid = engine.add_request(req.prompt_token_ids, _params(req, ignore_eos, temperature, seed),
                                         prompt_token_ids=req.prompt_token_ids)
            except ValueError as exc:  # a request the engine refuses counts as failed, not fatal
                rec.error = str(exc)
                if bar is not None:
                    bar.update(1)
                continue
            inflight[rid] = (i, now, now)
        if not inflight:
            continue
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            entry = inflight.get(out.request_id)
            if entry is None:
                continue
            i, submitted, last = entry
            rec = records[i]
            n = len(out.outputs[0].token_ids)
            if n > rec.output_tokens:
                if rec.ttft_s is None:
                    rec.ttft_s = now - submitted
                else:
                    rec.itl_s.append(now - last)
                rec.output_tokens = n
                inflight[out.request_id] = (i, submitted, now)
            if out.finished:
                rec.e2el_s = now - submitted
                rec.generated_text = out.outputs[0].text
                rec.success = out.outputs[0].finish_reason != "abort"
                if not rec.success:
                    rec.error = "aborted"
                del inflight[out.request_id]
                if bar is not None:
                    bar.update(1)
    return records, time.perf_counter() - t_origin


def run_offline_benchmark(llm: Any, requests: list[SampleRequest], *, max_concurrency: int | None = None,
                          ignore_eos: bool = True, temperature: float = 0.0, seed: int | None = None,
                          warmup: int = 0, progress: bool = True) -> dict[str, Any]:
    """Warm up on the first ``warmup`` requests, then time the whole list; returns one ``runs`` entry."""
    if not requests:
        raise ValueError("no requests to run.")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency={max_concurrency} must be at least 1.")
    if warmup:
        warm = [requests[i % len(requests)] for i in range(warmup)]
        _run(llm, warm, max_concurrency, ignore_eos, temperature, seed, None)
        # The warm-up's prompts are timed again below: had they stayed in the prefix cache, their prefill
        # would be skipped, which no first sight of a workload does.
        llm.reset_prefix_cache()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc=f"bench offline (concurrency {max_concurrency or 'all'})",
                   unit="req")
    try:
        records, duration = _run(llm, requests, max_concurrency, ignore_eos, temperature, seed, bar)
    finally:
        if bar is not None:
            bar.close()
    for rec in records:
        rec.usage_from_server = True  # counted by the engine itself, exactly
    return make_run(records, duration, max_concurrency=max_concurrency)
