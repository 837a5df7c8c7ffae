"""ServerMetrics without a model: vLLM's names and labels, a private registry per app, engine gauges read
from the stats snapshot, block-size choices observed once each, and per-request latency bookkeeping."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tideserve.core.kv_cache.tiers import TierStats
from tideserve.engine.stats import EngineStats
from tideserve.outputs import CompletionOutput, RequestOutput
from tideserve.serve.metrics import ServerMetrics


def samples(m: ServerMetrics) -> dict[tuple[str, tuple], float]:
    text = m.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(values: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in values.items() if n == name and all((k, lv) in ls for k, lv in labels.items()))


def output(num_tokens: int, finished: bool = False) -> RequestOutput:
    c = CompletionOutput(0, "x" * num_tokens, list(range(num_tokens)), finish_reason="length" if finished else None)
    return RequestOutput("r", None, [1], [c], finished, metrics={"arrival_time": 10.0, "step_start_time": 10.25})


def test_engine_snapshot_is_exported_under_vllm_names():
    stats = EngineStats(num_requests_running=3, num_requests_waiting=2, num_preemptions=5, kv_cache_usage=0.5,
                        prefix_cache_queries=100, prefix_cache_hits=40, fragmentation_ratio=0.07,
                        kv_cache_pool_bytes=2048, kv_cache_pool_blocks=8, kv_cache_block_size=16,
                        kv_cache_budget_bytes=4096, memory_utilization=0.25, prompt_tokens=70,
                        generation_tokens=30, kv_cache_used_blocks=4, kv_cache_cached_blocks=3,
                        kv_cache_resizes=6, kv_cache_grow_failures=1, num_swap_ins=2,
                        kv_cache_background_commits=4)
    m = ServerMetrics()
    m.attach_engine("tiny", lambda: stats, {"block_size": "16"})
    v = samples(m)
    expected = {"vllm:num_requests_running": 3, "vllm:num_requests_waiting": 2, "vllm:num_preemptions_total": 5,
                "vllm:kv_cache_usage_perc": 0.5, "vllm:prefix_cache_queries_total": 100,
                "vllm:prefix_cache_hits_total": 40, "vllm:fragmentation_ratio": 0.07,
                "vllm:kv_cache_pool_bytes": 2048, "vllm:kv_cache_budget_bytes": 4096,
                "vllm:memory_utilization": 0.25, "vllm:prompt_tokens_total": 70,
                "vllm:generation_tokens_total": 30, "vllm:kv_cache_block_size": 16,
                "vllm:kv_cache_block_size_choices_count": 1, "vllm:kv_cache_block_size_choices_sum": 16,
                "vllm:kv_cache_used_blocks": 4, "vllm:kv_cache_cached_blocks": 3,
                "vllm:kv_cache_resizes_total": 6, "vllm:kv_cache_grow_failures_total": 1,
                "vllm:kv_cache_background_commits_total": 4,
                "vllm:num_swap_ins_total": 2, "vllm:cache_config_info": 1}
    for name, want in expected.items():
        assert value(v, name, model_name="tiny") == want, name
    for reason in ("stop", "length", "abort"):  # present from the start, so rate() has a baseline
        assert (("vllm:request_success_total", (("finished_reason", reason), ("model_name", "tiny")))) in v
    # A new block size is one more observation; the same size again is not. The gauge shows the current one.
    stats.kv_cache_block_size = 32
    m.on_engine_stats(stats)
    m.on_engine_stats(stats)
    v = samples(m)
    assert value(v, "vllm:kv_cache_block_size_choices_count") == 2
    assert value(v, "vllm:kv_cache_block_size_choices_sum") == 48
    assert value(v, "vllm:kv_cache_block_size", model_name="tiny") == 32
    assert value(v, "process_resident_memory_bytes") > 0


def test_kv_tiers_are_exported_per_medium():
    disk = TierStats("DISK", hits=7, bytes_read=700, bytes_written=900, evictions=2, bad_files=1, loads=3,
                     load_seconds=0.25, used_bytes=500, capacity_bytes=1000)
    m = ServerMetrics()
    m.attach_engine("tiny", lambda: EngineStats(kv_tiers=[disk]))
    v = samples(m)
    expected = {"vllm:kv_tier_hits_total": 7, "vllm:kv_tier_bytes_read_total": 700,
                "vllm:kv_tier_bytes_written_total": 900, "vllm:kv_tier_evictions_total": 2,
                "vllm:kv_tier_bad_files_total": 1, "vllm:kv_tier_loads_total": 3,
                "vllm:kv_tier_load_seconds_total": 0.25, "vllm:kv_tier_used_bytes": 500,
                "vllm:kv_tier_capacity_bytes": 1000, "vllm:kv_tier_enabled": 1}
    for name, want in expected.items():
        assert value(v, name, model_name="tiny", medium="DISK") == want, name
    assert value(samples(ServerMetrics()), "vllm:kv_tier_hits_total") == 0  # no tier, no series


def test_kv_tier_load_latency_is_a_histogram_per_medium():
    host, disk = TierStats("CPU"), TierStats("DISK")
    for seconds in (0.002, 0.004):
        host.observe_load(seconds)
    disk.observe_load(0.03)
    m = ServerMetrics()
    m.attach_engine("tiny", lambda: EngineStats(kv_tiers=[host, disk]))
    v = samples(m)
    name = "vllm:kv_tier_load_latency_seconds"
    assert value(v, f"{name}_count", medium="CPU") == 2 and value(v, f"{name}_count", medium="DISK") == 1
    assert value(v, f"{name}_bucket", medium="CPU", le="0.0025") == 1
    assert value(v, f"{name}_bucket", medium="CPU", le="0.005") == 2
    assert value(v, f"{name}_bucket", medium="DISK", le="0.025") == 0
    assert value(v, f"{name}_bucket", medium="DISK", le="0.05") == 1
    assert abs(value(v, f"{name}_sum", medium="CPU") - 0.006) < 1e-9
    assert value(v, "vllm:kv_tier_loads_total", medium="CPU") == 2


def test_each_app_has_its_own_registry():
    a, b = ServerMetrics(), ServerMetrics()
    a.attach_engine("m", EngineStats)
    b.attach_engine("m", EngineStats)  # no "duplicated timeseries" error
    a.observe_http("/v1/completions", "POST", 200, 0.1)
    assert value(samples(a), "http_requests_total", handler="/v1/completions", status="2xx") == 1
    assert value(samples(b), "http_requests_total") == 0


def test_request_timer_observes_latencies_and_finish_reason():
    m = ServerMetrics()
    m.attach_engine("m", EngineStats)
    timer = m.timer()
    timer.on_output(output(1))
    timer.on_output(output(1))  # no new token: nothing observed
    timer.on_output(output(3))  # two tokens arrived together: two inter-token gaps
    timer.on_output(output(4, finished=True))
    timer.finish("length")
    timer.finish("length")  # idempotent
    v = samples(m)
    assert value(v, "vllm:time_to_first_token_seconds_count") == 1
    assert value(v, "vllm:inter_token_latency_seconds_count") == 3
    assert value(v, "vllm:e2e_request_latency_seconds_count") == 1
    assert value(v, "vllm:request_queue_time_seconds_count") == 1
    assert value(v, "vllm:request_queue_time_seconds_sum") == 0.25
    assert value(v, "vllm:request_success_total", finished_reason="length") == 1


def test_dashboard_and_docs_use_exported_names():
    """deploy/grafana/tideserve.json and docs/metrics.md only name metrics the server exports."""
    import json
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    m = ServerMetrics()
    m.attach_engine("m", lambda: EngineStats(kv_cache_block_size=16, spec_decode_enabled=True,
                                             spec_decode_num_accepted_tokens_per_pos=[0, 0],
                                             kv_tiers=[TierStats("DISK")]), {"block_size": "16"})
    timer = m.timer()
    for n in (1, 2):  # so every histogram has series
        timer.on_output(output(n))
    timer.finish("stop")
    m.observe_http("/health", "GET", 200, 0.01)
    exported = {s.name for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples}
    exported |= {fam.name for fam in text_string_to_metric_families(m.render().decode())}
    dashboard = json.loads((root / "deploy/grafana/tideserve.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    docs = (root / "docs/metrics.md").read_text()
    for source, text in (("dashboard", exprs), ("docs", docs)):
        names = set(re.findall(r"\b(vllm:[a-z0-9_]+|http_request[a-z_]+)", text))
        assert names, source
        unknown = {n for n in names if n not in exported and n.rstrip("_") not in exported}
        assert not unknown, (source, unknown)
