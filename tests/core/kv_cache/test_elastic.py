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
from tideserve.core.kv_cache.geometry import KVGeometry

BLOCK = KVGeometry(num_layers=2, token_bytes=64, kv_dtype="float32", block_size=16, num_blocks=0).bytes_per_block


def pool(num_blocks: int) -> KVGeometry:
    """A pool of ``num_blocks`` blocks of BLOCK bytes."""
    return KVGeometry(num_layers=2, token_bytes=64, kv_dtype="float32", block_size=16, num_blocks=num_blocks)


def policy_of(config: ElasticConfig, min_blocks: int, max_blocks: int) -> ElasticPolicy:
    """A policy whose floor and ceiling are these many blocks of BLOCK bytes."""
    return ElasticPolicy(config, floor_bytes=min_blocks * BLOCK, ceiling_bytes=max_blocks * BLOCK)


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
    policy = policy_of(ElasticConfig(grow_factor=1.5), min_blocks=10, max_blocks=30)
    assert policy.grow_target(pool(20), 10, 0, reachable=100) is None  # under the high watermark
    assert policy.grow_target(pool(20), 18, 0, reachable=100) == 30  # 1.5x, capped by the budget
    assert policy.grow_target(pool(20), 20, 1, reachable=23) == 23  # the machine allows 3 more
    assert policy.grow_target(pool(30), 30, 1, reachable=100) is None  # at the budget: preempt instead
    assert policy.grow_target(pool(20), 20, 1, reachable=lambda: 18) is None  # a neighbour took the rest


def test_growth_stops_at_what_the_requests_could_ever_hold():
    policy = policy_of(ElasticConfig(grow_factor=1.5), min_blocks=10, max_blocks=1000)
    assert policy.grow_target(pool(20), 18, 0, reachable=100, demand=24) == 24  # not 30: 24 is all they can hold
    assert policy.grow_target(pool(24), 22, 0, reachable=100, demand=24) is None  # full demand fits: no headroom
    assert policy.grow_target(pool(24), 24, 3, reachable=100, demand=24) == 27  # an allocation's need still wins
    asked = []
    assert policy.grow_target(pool(20), 10, 0, reachable=100, demand=lambda: asked.append(1) or 50) is None
    assert not asked  # under the watermark the requests are not counted
    assert policy.grow_target(pool(1000), 990, 0, reachable=2000, demand=lambda: asked.append(1) or 5000) is None
    assert not asked  # nor at the budget
    assert policy.grow_target(pool(20), 18, 0, reachable=100, demand=lambda: 500) == 30  # the usual step below it


def test_shrink_only_after_staying_low():
    policy = policy_of(ElasticConfig(shrink_delay_s=5), min_blocks=10, max_blocks=1000)
    assert policy.shrink_target(pool(100), 5, now=0.0) is None  # starts the timer
    assert policy.shrink_target(pool(100), 5, now=4.0) is None
    assert policy.shrink_target(pool(100), 50, now=4.5) is None  # usage rose: timer reset
    assert policy.shrink_target(pool(100), 5, now=5.0) is None
    assert policy.shrink_target(pool(100), 5, now=10.5) == 10  # floor: min_blocks


def test_idle_pool_shrinks_to_its_reserve_or_its_kept_cache():
    policy = policy_of(ElasticConfig(shrink_delay_s=1), min_blocks=10, max_blocks=1000)
    assert policy.shrink_target(pool(100), 0, now=0.0, idle=True, num_cache_kept=4) is None
    assert policy.shrink_target(pool(100), 0, now=1.5, idle=True, num_cache_kept=4) == 10  # cache fits the reserve
    assert policy.shrink_target(pool(100), 0, now=0.0, idle=True, num_cache_kept=30) is None
    assert policy.shrink_target(pool(100), 0, now=1.5, idle=True, num_cache_kept=30) == 30


def test_a_burst_after_a_long_idle_period_is_not_shrunk_at_once():
    """Idle at its floor for a minute, then a burst: the idle minute must not count as low usage."""
    policy = policy_of(ElasticConfig(shrink_delay_s=5), min_blocks=10, max_blocks=1000)
    for t in range(0, 60):
        assert policy.shrink_target(pool(10), 0, now=float(t), idle=True) is None  # already at the floor
    assert policy.shrink_target(pool(120), 2, now=60.5) is None  # the burst grew the pool; usage still low
    assert policy.shrink_target(pool(120), 2, now=64.0) is None
    assert policy.shrink_target(pool(120), 2, now=66.0) == 10  # low for 5 s of its own


def test_compaction_after_fragmentation_persists():
    policy = policy_of(ElasticConfig(compaction_delay_s=2), min_blocks=1, max_blocks=10)
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


def test_floor_and_ceiling_are_bytes_that_every_block_size_reads_alike():
    """A block-size change needs no rescaling by hand: the same bytes, read in blocks of the new size."""
    policy = policy_of(ElasticConfig(), min_blocks=10, max_blocks=1000)
    small = pool(100)
    large = small.with_block_size(64)  # four times the tokens per block, the same bytes
    assert (policy.min_blocks(small), policy.max_blocks(small)) == (10, 1000)
    assert (policy.min_blocks(large), policy.max_blocks(large)) == (3, 250)  # the floor rounds up
    assert large.pool_bytes == small.pool_bytes and large.num_blocks == 25
    policy.follow_machine(400 * BLOCK)  # a neighbour took memory
    assert policy.max_blocks(small) == 400 and policy.max_blocks(large) == 100
    policy.cap(5 * BLOCK)  # pressure: the ceiling drops to the pool, never under the floor
    assert policy.max_blocks(small) == 10


def test_commit_ahead_reaches_what_the_requests_hold_within_every_bound():
    policy = policy_of(ElasticConfig(high_watermark=0.8), min_blocks=10, max_blocks=200)
    assert policy.commit_ahead_target(pool(50), 60, 40, lambda: 1000, lambda: 1000) == 60  # known fits below
    assert policy.commit_ahead_target(pool(50), 60, 120, lambda: 1000, lambda: 1000) == 150  # 120 / 0.8
    assert policy.commit_ahead_target(pool(50), 60, 120, lambda: 90, lambda: 1000) == 90  # their demand
    assert policy.commit_ahead_target(pool(50), 60, 120, lambda: 1000, lambda: 70) == 70  # the machine
    assert policy.commit_ahead_target(pool(50), 60, 400, lambda: 1000, lambda: 1000) == 200  # the budget


def test_pressure_gives_back_what_the_machine_lacks_and_the_idle_pool_keeps_hit_prefixes():
    policy = policy_of(ElasticConfig(idle_unhit_cache_bytes=3 * BLOCK), min_blocks=10, max_blocks=200)
    assert policy.pressure_target(pool(100), available_bytes=50 * BLOCK, margin_bytes=40 * BLOCK) is None
    assert policy.pressure_target(pool(100), available_bytes=30 * BLOCK, margin_bytes=40 * BLOCK) == 90
    assert policy.pressure_target(pool(5), available_bytes=0, margin_bytes=40 * BLOCK) == 1
    assert policy.cache_to_keep(pool(100), num_hit=7, num_unhit=2) == 9
    assert policy.cache_to_keep(pool(100), num_hit=7, num_unhit=20) == 10  # three unhit blocks' worth
