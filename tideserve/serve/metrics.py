"""Prometheus metrics of one server, under vLLM's names so existing dashboards work unchanged.

Each app owns a private ``CollectorRegistry`` (several servers can live in one process, as in the tests).
Engine-wide numbers (queue lengths, KV cache usage, token and preemption counters, the pool's size and
fragmentation) are read from the engine's latest ``EngineStats`` snapshot at scrape time, so a scrape
never touches the engine thread. Per-request latencies are observed by the serving code through
``RequestTimer``. What vLLM lacks (fragmentation, pool and budget bytes, block size, memory utilization)
uses the same ``vllm:`` prefix; docs/metrics.md describes each metric.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from tideserve.config import VALID_BLOCK_SIZES
from tideserve.core.kv_cache.tiers import LOAD_SECONDS_BUCKETS
from tideserve.engine.stats import EngineStats
from tideserve.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_BLOCK_SIZE_BUCKETS = VALID_BLOCK_SIZES  # one bucket per block size the pool can take
_HTTP_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# (name, help, EngineStats field, scale) of the gauges read from the snapshot.
_GAUGES = (
    ("vllm:num_requests_running", "Number of requests in model execution batches.",
     "num_requests_running", 1),
    ("vllm:num_requests_waiting", "Number of requests waiting to be scheduled.", "num_requests_waiting", 1),
    ("vllm:kv_cache_usage_perc", "KV cache usage: used blocks over pool blocks (1 means 100 percent).",
     "kv_cache_usage", 1),
    ("vllm:fragmentation_ratio", "KV fragmentation: internal (empty slots in allocated blocks / allocated slots) plus "
     "external (free blocks below the highest live block / pool blocks).",
     "fragmentation_ratio", 1),
    ("vllm:kv_cache_pool_bytes", "Bytes of the KV cache pool now.", "kv_cache_pool_bytes", 1),
    ("vllm:kv_cache_resident_bytes", "Bytes of KV cache pages resident now: the pool and the pages committed ahead "
     "of a growth.", "kv_cache_resident_bytes", 1),
    ("vllm:memory_claimed_bytes", "Bytes this engine may still make resident (a growth being committed, the part "
     "of its activation peak not resident now), as claimed to the engines sharing its memory limit.",
     "memory_claimed_bytes", 1),
    ("vllm:memory_others_claimed_bytes", "Bytes claimed by the other engines sharing this engine's memory limit.",
     "memory_others_claimed_bytes", 1),
    ("vllm:kv_cache_pool_blocks", "Blocks in the KV cache pool now.", "kv_cache_pool_blocks", 1),
    ("vllm:kv_cache_budget_bytes", "Bytes the KV cache pool may grow to now (re-read from the machine).",
     "kv_cache_budget_bytes", 1),
    ("vllm:kv_cache_block_size", "KV cache block size now, in tokens.", "kv_cache_block_size", 1),
    ("vllm:kv_cache_used_blocks", "KV cache blocks held by requests.", "kv_cache_used_blocks", 1),
    ("vllm:kv_cache_cached_blocks", "Free KV cache blocks still holding a cached prefix.",
     "kv_cache_cached_blocks", 1),
    ("vllm:kv_cache_swap_usage_perc", "Usage of the host swap tier (1 means 100 percent).",
     "swap_pool_usage", 1),
    ("vllm:engine_sleep_state", "Sleep mode: 0 awake, else the level the engine sleeps at (1 or 2).", "sleep_level", 1),
    ("vllm:memory_utilization", "Device (CUDA) or process (CPU) memory in use over memory available.",
     "memory_utilization", 1),
)
# (name without _total, help, EngineStats field) of the counters read from the snapshot.
_COUNTERS = (
    ("vllm:num_preemptions", "Cumulative number of preemptions.", "num_preemptions"),
    ("vllm:num_swap_ins", "Preempted requests resumed by copying their KV back from the host tier.",
     "num_swap_ins"),
    ("vllm:kv_cache_resizes", "Elastic pool grows and shrinks.", "kv_cache_resizes"),
    ("vllm:kv_cache_background_commits", "Pool growths whose pages a background thread committed first.",
     "kv_cache_background_commits"),
    ("vllm:kv_cache_grow_failures", "Pool growths the device refused (out of memory); the pool backed off.",
     "kv_cache_grow_failures"),
    ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("vllm:prompt_tokens", "Number of prefill tokens processed (counted when a request's prefill is done).",
     "prompt_tokens"),
    ("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
)
# The same, exported only by an engine with speculative decoding on (as vLLM does).
_SPEC_COUNTERS = (
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts (verification rounds).",
     "spec_decode_num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens (proposals verified).",
     "spec_decode_num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "spec_decode_num_accepted_tokens"),
)

# (name, help, TierStats field, is a counter) of the KV tiers' metrics, one series per tier (label medium).
_TIER_METRICS = (
    ("vllm:kv_tier_hits", "KV blocks loaded back into the pool from a tier below it.", "hits", True),
    ("vllm:kv_tier_bytes_read", "Bytes read from a KV tier.", "bytes_read", True),
    ("vllm:kv_tier_bytes_written", "Bytes written to a KV tier.", "bytes_written", True),
    ("vllm:kv_tier_evictions", "KV blocks a tier dropped to stay within its size (least recently used first).",
     "evictions", True),
    ("vllm:kv_tier_bad_files", "Tier files skipped and removed: truncated, corrupted or foreign.", "bad_files", True),
    ("vllm:kv_tier_loads", "Loads from a KV tier (one per request that hit it).", "loads", True),
    ("vllm:kv_tier_load_seconds", "Time spent loading from a KV tier, in seconds (over vllm:kv_tier_loads: the "
     "mean load latency).", "load_seconds", True),
    ("vllm:kv_tier_used_bytes", "Bytes a KV tier holds now.", "used_bytes", False),
    ("vllm:kv_tier_capacity_bytes", "Bytes a KV tier may hold.", "capacity_bytes", False),
    ("vllm:kv_tier_enabled", "1 while a KV tier works, 0 once it turned itself off (unwritable storage).",
     "enabled", False),
)


class _EngineStatsCollector(Collector):
    def __init__(self, model_name: str, stats: Callable[[], EngineStats], cache_info: dict[str, str]) -> None:
        self.model_name = model_name
        self.stats = stats
        self.cache_info = cache_info

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        for name, help_text, attr, scale in _GAUGES:
            g = GaugeMetricFamily(name, help_text, labels=["model_name"])
            g.add_metric([self.model_name], float(getattr(stats, attr)) * scale)
            yield g
        for name, help_text, attr in _COUNTERS + (_SPEC_COUNTERS if stats.spec_decode_enabled else ()):
            c = CounterMetricFamily(name, help_text, labels=["model_name"])
            c.add_metric([self.model_name], float(getattr(stats, attr)))
            yield c
        if stats.spec_decode_enabled:
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted tokens per draft position.", labels=["model_name", "position"])
            for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([self.model_name, str(position)], float(count))
            yield per_pos
        for name, help_text, attr, is_counter in _TIER_METRICS:
            family = (CounterMetricFamily if is_counter else GaugeMetricFamily)(
                name, help_text, labels=["model_name", "medium"])
            for tier in stats.kv_tiers:
                family.add_metric([self.model_name, tier.medium], float(getattr(tier, attr)))
            yield family
        latency = HistogramMetricFamily("vllm:kv_tier_load_latency_seconds",
                                        "Time from a load's start to its blocks being in the pool, in seconds.",
                                        labels=["model_name", "medium"])
        for tier in stats.kv_tiers:
            cumulative = list(itertools.accumulate(tier.load_buckets))
            bounds = [str(b) for b in LOAD_SECONDS_BUCKETS] + ["+Inf"]
            latency.add_metric([self.model_name, tier.medium], list(zip(bounds, map(float, cumulative))),
                               tier.load_seconds)
        yield latency
        if self.cache_info:
            keys = sorted(self.cache_info)
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache configuration.",
                                     labels=["model_name", *keys])
            info.add_metric([self.model_name, *(self.cache_info[k] for k in keys)], 1.0)
            yield info


class ServerMetrics:
    """The registry of one app: HTTP metrics from the start, engine metrics once a model is attached."""

    def __init__(self) -> None:
        disable_created_metrics()  # the *_created series only add noise for our counters
        self.registry = CollectorRegistry()
        self.model_name = ""
        r = self.registry
        self.http_requests = Counter("http_requests", "HTTP requests by handler, method and status class.",
                                     ["handler", "method", "status"], registry=r)
        self.http_duration = Histogram("http_request_duration_seconds", "HTTP request latency.",
                                       ["handler", "method"], buckets=_HTTP_BUCKETS, registry=r)
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token, in seconds.",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Latency between output tokens, in seconds.",
                             labels, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency, in seconds.",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Time a request spent waiting before it was first scheduled, in seconds.",
                                    labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=r)
        self.block_size = Histogram("vllm:kv_cache_block_size_choices",
                                    "KV cache block sizes chosen (one observation per choice); the current "
                                    "size is the gauge vllm:kv_cache_block_size.",
                                    labels, buckets=_BLOCK_SIZE_BUCKETS, registry=r)
        ProcessCollector(registry=r)  # process_resident_memory_bytes: the footprint the pool's moves show in
        self._last_block_size = 0

    def attach_engine(self, model_name: str, stats: Callable[[], EngineStats],
                      cache_info: dict[str, str] | None = None) -> None:
        self.model_name = model_name
        self.registry.register(_EngineStatsCollector(model_name, stats, cache_info or {}))
        for reason in ("stop", "length", "abort"):  # so rate() works from the first request on
            self.request_success.labels(model_name, reason)
        self.on_engine_stats(stats())

    def on_engine_stats(self, stats: EngineStats) -> None:
        """Called after each engine snapshot: records a new block-size choice."""
        if stats.kv_cache_block_size and stats.kv_cache_block_size != self._last_block_size:
            self._last_block_size = stats.kv_cache_block_size
            self.block_size.labels(self.model_name).observe(stats.kv_cache_block_size)

    def observe_http(self, handler: str, method: str, status: int, seconds: float) -> None:
        self.http_requests.labels(handler, method, f"{status // 100}xx").inc()
        self.http_duration.labels(handler, method).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """Latency bookkeeping of one engine request, fed with its outputs as they stream."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self._last: float | None = None
        self._num_tokens = 0
        self._done = False

    def on_output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        num_tokens = max((len(c.token_ids) for c in out.outputs), default=0)
        new = num_tokens - self._num_tokens
        if new <= 0:
            return
        name = self.metrics.model_name
        if self._last is None:
            self.metrics.ttft.labels(name).observe(now - self.arrival)
            engine_arrival = out.metrics.get("arrival_time")
            scheduled = out.metrics.get("first_scheduled_time") or out.metrics.get("step_start_time")
            if engine_arrival and scheduled:
                self.metrics.queue_time.labels(name).observe(max(0.0, scheduled - engine_arrival))
        else:
            gap = (now - self._last) / new
            for _ in range(new):
                self.metrics.itl.labels(name).observe(gap)
        self._last = now
        self._num_tokens = num_tokens

    def finish(self, reason: str | None) -> None:
        if self._done:
            return
        self._done = True
        name = self.metrics.model_name
        self.metrics.e2e.labels(name).observe(time.monotonic() - self.arrival)
        self.metrics.request_success.labels(name, reason or "abort").inc()
