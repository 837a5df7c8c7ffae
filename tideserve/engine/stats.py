"""A snapshot of what the engine and its KV cache are doing, as plain numbers.

The server's Prometheus exporter and the periodic log line read this; nothing here knows about HTTP.
Counters are cumulative since start; gauges are the current value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tideserve.core.kv_cache.tiers import TierStats


@dataclass
class EngineStats:
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_preemptions: int = 0  # counter
    kv_cache_usage: float = 0.0  # used blocks / pool blocks, 0..1
    prefix_cache_queries: int = 0  # counter, in tokens
    prefix_cache_hits: int = 0  # counter, in tokens
    fragmentation_ratio: float = 0.0  # internal + external, see docs/metrics.md
    kv_cache_pool_bytes: int = 0
    kv_cache_resident_bytes: int = 0  # KV pages resident: the pool and pages committed ahead of a growth
    memory_claimed_bytes: int = 0  # what this engine may still make resident (its claim on a shared limit)
    memory_others_claimed_bytes: int = 0  # what the engines sharing its memory limit claim
    kv_cache_pool_blocks: int = 0
    kv_cache_block_size: int = 0
    kv_cache_budget_bytes: int = 0
    kv_cache_used_blocks: int = 0  # blocks held by requests
    kv_cache_cached_blocks: int = 0  # free blocks still holding a cached prefix
    kv_cache_resizes: int = 0  # counter: pool grows and shrinks
    kv_cache_background_commits: int = 0  # counter: growths whose pages a background thread committed
    kv_cache_grow_failures: int = 0  # counter: growths refused by the device (out of memory)
    num_swap_ins: int = 0  # counter: preempted requests resumed by copying their KV back
    swap_pool_usage: float = 0.0  # 0..1
    sleep_level: int = 0  # sleep mode: 0 awake, 1 or 2 the level the engine sleeps at
    memory_utilization: float = 0.0  # process (CPU) or device (CUDA) memory in use / available, 0..1
    prompt_tokens: int = 0  # counter: prompt tokens of requests whose prefill is done
    generation_tokens: int = 0  # counter: generated tokens
    # Speculative decoding (counters): verification rounds, proposals verified, accepted, accepted per
    # position in the proposal; spec_decode_enabled says whether the engine proposes at all.
    spec_decode_enabled: bool = False
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # The KV tiers below the pool (--kv-cache-dir), one entry per tier in use, each named by its medium.
    kv_tiers: list[TierStats] = field(default_factory=list)
