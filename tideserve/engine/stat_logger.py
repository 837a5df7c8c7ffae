"""The periodic engine log line operators grep for (vLLM's wording, so their habits carry over).

Every ``interval`` seconds, and only while something happens, it logs throughput since the previous
line, queue lengths, KV cache usage and the prefix cache hit rate, all from ``EngineStats`` snapshots.
"""

from __future__ import annotations

import logging

from tideserve.engine.stats import EngineStats

logger = logging.getLogger(__name__)


class StatLogger:
    def __init__(self, interval: float = 5.0) -> None:
        self.interval = interval
        self._last_time: float | None = None
        self._last: EngineStats | None = None

    def maybe_log(self, stats: EngineStats, now: float) -> None:
        if self._last_time is None or self._last is None:
            self._last_time, self._last = now, stats
            return
        elapsed = now - self._last_time
        if elapsed < self.interval:
            return
        last = self._last
        prompt = stats.prompt_tokens - last.prompt_tokens
        generation = stats.generation_tokens - last.generation_tokens
        busy = stats.num_requests_running or stats.num_requests_waiting
        self._last_time, self._last = now, stats
        if not (prompt or generation or busy):
            return  # idle: stay quiet
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            prompt / elapsed, generation / elapsed, stats.num_requests_running, stats.num_requests_waiting,
            100 * stats.kv_cache_usage, 100 * hits / queries if queries else 0.0)
        drafts = stats.spec_decode_num_drafts - last.spec_decode_num_drafts
        if stats.spec_decode_enabled and drafts:
            proposed = stats.spec_decode_num_draft_tokens - last.spec_decode_num_draft_tokens
            accepted = stats.spec_decode_num_accepted_tokens - last.spec_decode_num_accepted_tokens
            per_pos = [(n - (last.spec_decode_num_accepted_tokens_per_pos[i]
                             if i < len(last.spec_decode_num_accepted_tokens_per_pos) else 0)) / drafts
                       for i, n in enumerate(stats.spec_decode_num_accepted_tokens_per_pos)]
            logger.info(
                "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
                "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
                "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
                1 + accepted / drafts, accepted / elapsed, proposed / elapsed, accepted, proposed,
                ", ".join(f"{r:.3f}" for r in per_pos), 100 * accepted / proposed if proposed else 0.0)
