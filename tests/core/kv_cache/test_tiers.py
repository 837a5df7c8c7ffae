"""The KV tiers as the cache manager sees them: tier keys are stable across processes and separate block
sizes and salts; the index evicts least recently used first within its bytes; the manager collects the
blocks it publishes for writing, plans loads that continue a pool hit, and publishes loaded blocks as
cached prefixes, keeping every pool invariant."""

from __future__ import annotations

import os
import subprocess
import sys

from tideserve.core.kv_cache.events import BlockStored, apply_events, external_hash
from tideserve.core.kv_cache.manager import KVCacheManager
from tideserve.core.kv_cache.tiers import TierIndex, tier_block_key, tier_root_key

BS = 4


def _keys(token_ids: list[int], block_size: int = BS, salt: str | None = None) -> list[bytes]:
    parent, out = tier_root_key(block_size, salt), []
    for i in range(len(token_ids) // block_size):
        parent = tier_block_key(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


def test_tier_keys_are_the_same_in_another_process_and_differ_by_block_size_and_salt():
    tokens = list(range(100, 116))
    code = ("from tideserve.core.kv_cache.tiers import tier_block_key, tier_root_key;"
            "print(tier_block_key(tier_root_key(4, 's'), [100, 101, 102, 103]).hex())")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert other.stdout.strip() == _keys(tokens, salt="s")[0].hex()
    assert _keys(tokens)[0] != _keys(tokens, salt="s")[0]
    assert _keys(tokens, block_size=4)[1] != _keys(tokens, block_size=8)[0]
    # Chained: a block's key names its whole prefix, not only its own tokens.
    assert _keys([1, 2, 3, 4, 9, 9, 9, 9])[1] != _keys([5, 6, 7, 8, 9, 9, 9, 9])[1]


def test_the_index_evicts_least_recently_used_first_within_its_bytes():
    index = TierIndex(capacity_bytes=30)
    assert index.add(b"a", 10) == [] and index.add(b"b", 10) == [] and index.add(b"c", 10) == []
    index.touch(b"a")  # b is now the oldest
    assert index.add(b"d", 10) == [b"b"]
    assert index.keys() == [b"c", b"a", b"d"] and index.used_bytes == 30
    assert index.add(b"e", 25) == [b"c", b"a", b"d"] and index.used_bytes == 25
    assert index.add(b"huge", 31) == [b"huge"] and b"huge" not in index  # larger than the whole tier
    index.remove(b"e")
    assert index.used_bytes == 0 and len(index) == 0


def _manager(num_blocks: int = 16) -> KVCacheManager:
    kv = KVCacheManager(num_blocks, BS)
    kv.enable_tier(TierIndex(capacity_bytes=10**9))
    return kv


def test_published_blocks_are_written_once_with_their_keys():
    kv = _manager()
    tokens = list(range(10))  # two full blocks and a partial one
    kv.allocate_slots("a", tokens, 0, len(tokens))
    writes = kv.take_tier_writes()
    assert writes == [(kv.block_ids("a")[0], _keys(tokens)[0]), (kv.block_ids("a")[1], _keys(tokens)[1])]
    assert kv.take_tier_writes() == []
    for _, key in writes:
        kv.tier.add(key, 1)
    # The same prefix in another request hits the pool: nothing new to write.
    hit = kv.get_computed_blocks("b", tokens)
    kv.allocate_slots("b", tokens, 0, len(tokens) - 2 * BS, hit)
    assert kv.take_tier_writes() == []
    kv.check_invariants()


def test_a_block_reused_before_its_write_is_not_written():
    kv = _manager(num_blocks=2)
    tokens = list(range(8))
    kv.allocate_slots("a", tokens, 0, len(tokens))
    kv.free("a")
    kv.allocate_slots("b", list(range(50, 58)), 0, 8)  # evicts a's cached blocks for other tokens
    writes = kv.take_tier_writes()
    assert [key for _, key in writes] == _keys(list(range(50, 58)))


def test_a_load_continues_the_pool_hit_and_publishes_cached_prefixes():
    kv = _manager()
    kv.enable_events()
    tokens = list(range(17))  # four full blocks; the last token is always computed
    keys = _keys(tokens)
    for key in keys[1:3]:
        kv.tier.add(key, 1)
    kv.allocate_slots("first", tokens[:BS], 0, BS)  # block 0 only, cached in the pool
    kv.free("first")
    kv.take_tier_writes()
    kv.take_events()
    start, planned = kv.plan_tier_load("r", tokens)
    assert (start, planned) == (1, keys[1:3])  # block 3 is in neither: the load stops before it
    assert kv.tier_load_shortfall("r", start, len(planned)) == 0
    hit, blocks = kv.begin_tier_load("r", start, len(planned))
    assert len(hit) == 1 and hit[0].ref_cnt == 1 and len(blocks) == 2
    kv.finish_tier_load("r", tokens, hit, blocks, num_loaded=1)  # block 2 failed its checks
    kv.check_invariants()
    assert len(kv.get_computed_blocks("r", tokens)) == 2
    stored = [e for e in kv.take_events() if isinstance(e, BlockStored)]
    assert stored[0].token_ids == tokens[BS:2 * BS]
    assert apply_events({external_hash(h) for h in kv.req_hashes["r"][:1]}, stored) == \
        {external_hash(h) for h in kv.pool.cached}
    assert kv.num_free_blocks == kv.num_blocks  # loaded blocks are cached and free until a request takes them


def test_a_load_never_evicts_the_pool_hit_it_continues():
    kv = _manager(num_blocks=4)
    tokens = list(range(4 * BS + 1))
    keys = _keys(tokens)
    kv.allocate_slots("first", tokens[:2 * BS], 0, 2 * BS)  # blocks 0 and 1 cached, the oldest free ones
    kv.free("first")
    for key in keys[2:]:
        kv.tier.add(key, 1)
    start, planned = kv.plan_tier_load("r", tokens)
    assert (start, planned) == (2, keys[2:])
    assert kv.tier_load_shortfall("r", start, len(planned)) == 0
    hit, blocks = kv.begin_tier_load("r", start, len(planned))
    assert len(blocks) == 2 and {b.block_id for b in blocks}.isdisjoint(b.block_id for b in hit)
    kv.finish_tier_load("r", tokens, hit, blocks, num_loaded=2)
    assert len(kv.get_computed_blocks("r", tokens)) == 4
    kv.check_invariants()
    # One more block than the pool holds beside the hit: the load is short by one.
    assert kv.tier_load_shortfall("r", 2, 3) == 1


def test_salted_requests_plan_no_load_of_unsalted_blocks():
    kv = _manager()
    tokens = list(range(9))
    for key in _keys(tokens):
        kv.tier.add(key, 1)
    kv.set_cache_salt("salted", "secret")
    assert kv.plan_tier_load("salted", tokens) == (0, [])
    assert kv.plan_tier_load("plain", tokens) == (0, _keys(tokens))
