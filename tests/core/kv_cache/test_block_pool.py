"""Exact behaviour of the block pool and manager on tiny pools: block ids, ref counts, eviction order."""

import pytest

from tideserve.core.kv_cache.block_pool import BlockPool
from tideserve.core.kv_cache.manager import KVCacheManager


def test_empty_blocks_are_reused_lowest_id_first():
    pool = BlockPool(6)
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    assert [b.ref_cnt for b in a] == [1, 1, 1]
    b = pool.allocate(2)  # 3, 4
    pool.release(a[::-1])
    assert pool.free_block_ids() == [0, 1, 2, 5]  # live blocks pack toward the start
    assert [x.block_id for x in pool.allocate(2)] == [0, 1]
    pool.release(b)
    pool.check_invariants()


def test_cached_blocks_are_evicted_last_oldest_first_tail_first():
    pool = BlockPool(5)
    a = pool.allocate(3)
    for i, block in enumerate(a):
        pool.publish(block, 100 + i)
    pool.release(a[::-1])  # a's prefix: tail block first into the LRU queue
    assert pool.free_block_ids() == [3, 4, 2, 1, 0]
    assert [x.block_id for x in pool.allocate(4)] == [3, 4, 2, 1]
    assert pool.lookup(100) is pool.blocks[0] and pool.lookup(102) is None
    pool.check_invariants()


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="only 2 are free"):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_manager_allocates_on_demand_one_block_at_a_time():
    kv = KVCacheManager(10, block_size=4, enable_prefix_caching=False)
    tokens = list(range(6))
    assert kv.allocate_slots("a", tokens, 0, 6) == [0, 1]
    tokens.append(6)
    assert kv.allocate_slots("a", tokens, 6, 1) == []  # slot 7 still in block 1
    tokens.append(7)
    assert kv.allocate_slots("a", tokens, 7, 1) == []
    tokens.append(8)
    assert kv.allocate_slots("a", tokens, 8, 1) == [2]  # position 8 opens a third block
    assert kv.block_ids("a") == [0, 1, 2]
    kv.free("a")
    assert kv.num_free_blocks == 10
    kv.check_invariants()


def test_allocation_that_cannot_fit_changes_nothing():
    kv = KVCacheManager(3, block_size=4, enable_prefix_caching=False)
    assert kv.allocate_slots("a", list(range(8)), 0, 8) == [0, 1]
    assert kv.allocate_slots("b", list(range(9)), 0, 9) is None
    assert kv.block_ids("b") == []
    assert kv.num_free_blocks == 1
    kv.check_invariants()


def test_prefix_hit_shares_blocks_and_caps_at_last_token():
    kv = KVCacheManager(10, block_size=4, enable_prefix_caching=True)
    prompt = list(range(12))  # three full blocks
    assert kv.allocate_slots("a", prompt, 0, 12) == [0, 1, 2]
    # The same prompt again: at most (12 - 1) // 4 = 2 blocks are reused, the last token is recomputed.
    hit = kv.get_computed_blocks("b", prompt)
    assert [b.block_id for b in hit] == [0, 1]
    assert kv.allocate_slots("b", prompt, 0, 4, hit) == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert kv.prefix_stats.hits == 8 and kv.prefix_stats.queries == 12
    kv.check_invariants()


def test_freed_blocks_stay_cached_and_evict_oldest_first_tail_first():
    kv = KVCacheManager(6, block_size=2, enable_prefix_caching=True)
    kv.allocate_slots("a", [1, 2, 3, 4, 5, 6], 0, 6)  # blocks 0, 1, 2
    kv.free("a")
    # Free queue: never-used 3, 4, 5, then a's blocks tail first: 2, 1, 0.
    assert kv.pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    # A request with the same first two blocks revives them from the free queue.
    hit = kv.get_computed_blocks("b", [1, 2, 3, 4, 9])
    assert [b.block_id for b in hit] == [0, 1]
    # A large new request now evicts 3, 4, 5 and then a's tail block 2 (the longest prefix) first.
    assert kv.allocate_slots("c", list(range(100, 108)), 0, 8) == [3, 4, 5, 2]
    assert kv.get_computed_blocks("d", [1, 2, 3, 4, 5, 6, 7])[:3] != []
    kv.check_invariants()


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(6, block_size=2, enable_prefix_caching=False)
    kv.allocate_slots("a", [1, 2, 3, 4], 0, 4)
    assert kv.get_computed_blocks("b", [1, 2, 3, 4, 5]) == []


def test_compact_moves_live_blocks_into_lowest_holes_and_shrink_releases_tail():
    kv = KVCacheManager(8, block_size=2, enable_prefix_caching=False)
    kv.allocate_slots("a", [1] * 6, 0, 6)  # blocks 0, 1, 2
    kv.allocate_slots("b", [2] * 4, 0, 4)  # blocks 3, 4
    kv.allocate_slots("c", [3] * 2, 0, 2)  # block 5
    kv.free("a")
    assert kv.external_fragmentation() == 3 / 8  # holes 0, 1, 2 sit below live block 5
    moves = kv.compact(3)
    assert moves == [(3, 0), (4, 1), (5, 2)]
    assert kv.block_ids("b") == [0, 1] and kv.block_ids("c") == [2]
    assert kv.external_fragmentation() == 0.0
    kv.shrink_to(3)
    assert kv.num_blocks == 3 and kv.num_free_blocks == 0
    kv.check_invariants()


def test_compact_keeps_cached_prefixes_and_moves_them_into_holes():
    kv = KVCacheManager(6, block_size=2, enable_prefix_caching=True)
    kv.allocate_slots("a", [1, 2, 3, 4, 5], 0, 5)  # blocks 0, 1 full and cached; 2 partial
    kv.allocate_slots("b", [9, 9, 9, 9, 9], 0, 5)  # blocks 3, 4 cached; 5 partial
    kv.free("a")
    kv.free("b")
    assert kv.external_fragmentation() == 1 / 6  # empty block 2 sits below cached block 4
    moves = kv.compact(kv.num_held_blocks())  # 4 held blocks: everything above id 3 moves down
    assert moves == [(4, 2)]
    assert sorted(b.block_id for b in kv.pool.cached.values()) == [0, 1, 2, 3]
    assert kv.external_fragmentation() == 0.0
    assert [b.block_id for b in kv.get_computed_blocks("c", [9, 9, 9, 9, 7])] == [3, 2]  # still found
    kv.check_invariants()


def test_retain_cached_keeps_hit_prefixes_before_recent_ones():
    kv = KVCacheManager(8, block_size=2, enable_prefix_caching=True)
    system = [7, 7, 7, 7]
    kv.allocate_slots("a", system + [1], 0, 5)  # blocks 0, 1 cached (the shared "system prompt")
    kv.free("a")
    hit = kv.get_computed_blocks("b", system + [2])
    assert [b.block_id for b in hit] == [0, 1]
    kv.allocate_slots("b", system + [2], 0, 1, hit)  # hits blocks 0 and 1
    kv.free("b")
    kv.allocate_slots("c", [5, 5, 5, 5, 5], 0, 5)  # blocks cached later, never hit
    kv.free("c")
    ranked = kv.pool.cached_free_by_value()
    assert ranked[:2] == [0, 1] or ranked[:2] == [1, 0]
    assert kv.retain_cached(2) == 2
    assert sorted(b.block_id for b in kv.pool.cached.values()) == [0, 1]
    kv.check_invariants()


def test_compact_then_shrink_keeps_the_retained_cache_in_a_small_pool():
    kv = KVCacheManager(10, block_size=2, enable_prefix_caching=True)
    kv.allocate_slots("filler", [0] * 12, 0, 12)  # blocks 0-5
    kv.allocate_slots("a", [3, 3, 3, 3, 1], 0, 5)  # blocks 6, 7 cached; 8 partial
    kv.free("filler")
    kv.reset_prefix_cache()  # the filler's blocks are empty now
    kv.free("a")
    kv.retain_cached(2)
    moves = kv.compact(3)
    assert sorted(moves) == [(6, 0), (7, 1)] or sorted(n for _, n in moves) == [0, 1]
    kv.shrink_to(3)
    assert len(kv.pool.cached) == 2 and kv.num_blocks == 3
    assert len(kv.get_computed_blocks("b", [3, 3, 3, 3, 9])) == 2
    kv.check_invariants()


def test_swap_out_and_in_plans_and_fallback():
    kv = KVCacheManager(6, block_size=2, enable_prefix_caching=False)
    kv.enable_swap(2)
    kv.allocate_slots("a", [1, 2, 3], 0, 3)  # blocks 0, 1
    kv.allocate_slots("b", [4, 5, 6], 0, 3)  # blocks 2, 3
    assert kv.swap_out("a") == [(0, 0), (1, 1)]
    assert kv.num_free_blocks == 4 and kv.swap.num_free == 0
    assert kv.swap_out("b") is None  # swap pool full: the caller recomputes instead
    block_ids, pairs = kv.swap_in("a", [1, 2, 3, 7], 3, 1)
    assert pairs == [(0, block_ids[0]), (1, block_ids[1])] and len(block_ids) == 2
    assert kv.swap.num_free == 2
    kv.check_invariants()


def test_grow_adds_fresh_blocks_before_cached_ones():
    kv = KVCacheManager(2, block_size=2, enable_prefix_caching=True)
    kv.allocate_slots("a", [1, 2, 3], 0, 3)
    kv.free("a")
    kv.grow(2)
    assert kv.pool.free_block_ids() == [1, 2, 3, 0]  # empty and fresh blocks first, cached block 0 last
    assert kv.num_blocks == 4
