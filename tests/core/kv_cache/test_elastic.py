"""The elastic pool's decisions with a fake clock: budget account, grow, shrink, compaction, block size."""

import pytest

from tideserve.core.kv_cache.elastic import (
    MARGIN_FLOOR,
    BlockSizeAdvisor,
    ElasticConfig,
    ElasticPolicy,
    MemoryAccount,
    predicted_waste,
    safety_margin,
)


def test_margin_scales_with_weights_and_activations_with_a_floor():
    assert safety_margin(10, 10) == MARGIN_FLOOR
    assert safety_margin(20 * 2**30, 2 * 2**30) == int(0.05 * 20 * 2**30 + 0.5 * 2 * 2**30)


def test_account_budget():
    account = MemoryAccount(available_bytes=10 * 2**30, weights_bytes=2**30, activation_bytes=2**30,
                            margin_bytes=2**29)
    assert account.budget_bytes == 10 * 2**30 - 2**30 - 2**29
    assert "KV budget 8.50 GiB" in account.describe()


def test_resident_activation_memory_is_not_reserved_twice():
    """Freed activation buffers an allocator keeps are already missing from the free memory."""
    gib = 2**30
    account = MemoryAccount(available_bytes=10 * gib, weights_bytes=gib, activation_bytes=gib,
                            margin_bytes=gib // 2, baseline_bytes=2 * gib, resident_bytes=2 * gib)
    assert account.budget_bytes == 10 * gib - gib - gib // 2  # nothing resident: reserve the whole peak
    assert account.activation_to_reserve(2 * gib + gib // 4) == 3 * gib // 4  # a quarter kept by the heap
    assert account.activation_to_reserve(4 * gib) == 0  # the whole peak is resident already
    assert account.headroom_bytes(gib, 4 * gib) == gib // 2
    kept = MemoryAccount(10 * gib, gib, gib, gib // 2, baseline_bytes=2 * gib, resident_bytes=3 * gib)
    assert kept.budget_bytes == 10 * gib - gib // 2
    assert "0.00 GiB not resident yet" in kept.describe()


def test_grow_bounded_by_budget_and_machine():
    policy = ElasticPolicy(ElasticConfig(grow_factor=1.5), min_blocks=10, max_blocks=30)
    assert policy.grow_target(20, 10, 0, reachable=100) is None  # under the high watermark
    assert policy.grow_target(20, 18, 0, reachable=100) == 30  # 1.5x, capped by the budget
    assert policy.grow_target(20, 20, 1, reachable=23) == 23  # the machine allows 3 more
    assert policy.grow_target(30, 30, 1, reachable=100) is None  # at the budget: preempt instead
    assert policy.grow_target(20, 20, 1, reachable=lambda: 18) is None  # a neighbour took the rest


def test_growth_stops_at_what_the_requests_could_ever_hold():
    policy = ElasticPolicy(ElasticConfig(grow_factor=1.5), min_blocks=10, max_blocks=1000)
    assert policy.grow_target(20, 18, 0, reachable=100, demand=24) == 24  # not 30: 24 is all they can hold
    assert policy.grow_target(24, 22, 0, reachable=100, demand=24) is None  # full demand fits: no headroom
    assert policy.grow_target(24, 24, 3, reachable=100, demand=24) == 27  # an allocation's need still wins
    asked = []
    assert policy.grow_target(20, 10, 0, reachable=100, demand=lambda: asked.append(1) or 50) is None
    assert not asked  # under the watermark the requests are not counted
    assert policy.grow_target(1000, 990, 0, reachable=2000, demand=lambda: asked.append(1) or 5000) is None
    assert not asked  # nor at the budget
    assert policy.grow_target(20, 18, 0, reachable=100, demand=lambda: 500) == 30  # the usual step below it


def test_shrink_only_after_staying_low():
    policy = ElasticPolicy(ElasticConfig(shrink_delay_s=5), min_blocks=10, max_blocks=1000)
    assert policy.shrink_target(100, 5, now=0.0) is None  # starts the timer
    assert policy.shrink_target(100, 5, now=4.0) is None
    assert policy.shrink_target(100, 50, now=4.5) is None  # usage rose: timer reset
    assert policy.shrink_target(100, 5, now=5.0) is None
    assert policy.shrink_target(100, 5, now=10.5) == 10  # floor: min_blocks


def test_idle_pool_shrinks_to_its_reserve_or_its_kept_cache():
    policy = ElasticPolicy(ElasticConfig(shrink_delay_s=1), min_blocks=10, max_blocks=1000)
    assert policy.shrink_target(100, 0, now=0.0, idle=True, num_cache_kept=4) is None
    assert policy.shrink_target(100, 0, now=1.5, idle=True, num_cache_kept=4) == 10  # cache fits the reserve
    assert policy.shrink_target(100, 0, now=0.0, idle=True, num_cache_kept=30) is None
    assert policy.shrink_target(100, 0, now=1.5, idle=True, num_cache_kept=30) == 30


def test_a_burst_after_a_long_idle_period_is_not_shrunk_at_once():
    """Idle at its floor for a minute, then a burst: the idle minute must not count as low usage."""
    policy = ElasticPolicy(ElasticConfig(shrink_delay_s=5), min_blocks=10, max_blocks=1000)
    for t in range(0, 60):
        assert policy.shrink_target(10, 0, now=float(t), idle=True) is None  # already at the floor
    assert policy.shrink_target(120, 2, now=60.5) is None  # the burst grew the pool; usage still low
    assert policy.shrink_target(120, 2, now=64.0) is None
    assert policy.shrink_target(120, 2, now=66.0) == 10  # low for 5 s of its own


def test_compaction_after_fragmentation_persists():
    policy = ElasticPolicy(ElasticConfig(compaction_delay_s=2), min_blocks=1, max_blocks=10)
    assert not policy.should_compact(0.2, 0.0)
    assert not policy.should_compact(0.2, 1.0)
    assert policy.should_compact(0.2, 2.5)
    assert not policy.should_compact(0.01, 3.0)


def test_predicted_waste_and_advisor():
    assert predicted_waste([16, 32], 16) == pytest.approx(0 + 2 * 1.5)
    advisor = BlockSizeAdvisor(min_samples=4)
    for n in [1000, 1020, 990, 1010, 1005]:
        advisor.observe(n)
    best, reason = advisor.best(8)
    assert best >= 32 and "median sequence length" in reason
    short = BlockSizeAdvisor(min_samples=4)
    for n in [9, 10, 11, 12, 9]:
        short.observe(n)
    assert short.best(128)[0] <= 16
    assert short.best(short.best(128)[0]) is None  # already the best: no change


def test_config_validation():
    with pytest.raises(ValueError, match="watermarks"):
        ElasticConfig(low_watermark=0.9, high_watermark=0.5)
