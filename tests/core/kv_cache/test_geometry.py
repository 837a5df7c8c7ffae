"""The KV geometry: one value object for block size, block count and their bytes, read alike by the
scheduler's arithmetic, the workers and the elastic policy; and what bounds a pool's growth."""

import pytest

from tideserve.core.kv_cache.geometry import KVGeometry, KVStoreLimits

MiB = 2**20


def geometry(num_blocks: int = 10, block_size: int = 16, swap_bytes: int = 0) -> KVGeometry:
    return KVGeometry(num_layers=30, token_bytes=3 * 64 * 2, kv_dtype="bfloat16", block_size=block_size,
                      num_blocks=num_blocks, swap_bytes=swap_bytes)


def test_bytes_follow_the_shape():
    g = geometry()
    assert g.bytes_per_block == 2 * 30 * 16 * 384 and g.pool_bytes == 10 * g.bytes_per_block
    assert g.num_tokens == 160 and g.blocks_for_tokens(161) == 11 and g.blocks_for_tokens(160) == 10
    assert g.blocks_for_bytes(3 * g.bytes_per_block - 1) == 2 and g.blocks_for_bytes(-5) == 0
    assert g.resized(4).num_blocks == 4 and g.num_blocks == 10  # frozen: a change is a new geometry
    with pytest.raises(ValueError, match="invalid KV geometry"):
        geometry(block_size=0)


def test_a_block_size_change_keeps_the_pools_and_the_swap_tiers_bytes():
    g = geometry(num_blocks=10, block_size=16, swap_bytes=8 * geometry().bytes_per_block)
    assert g.num_swap_blocks == 8
    wider = g.with_block_size(32)
    assert (wider.num_blocks, wider.num_swap_blocks, wider.pool_bytes) == (5, 4, g.pool_bytes)
    narrower = g.with_block_size(8)
    assert (narrower.num_blocks, narrower.num_swap_blocks) == (20, 16)
    assert geometry(num_blocks=1, block_size=16).with_block_size(128).num_blocks == 1  # never empty


def test_growth_limits_of_a_reservation_and_of_a_copying_store():
    g = geometry(num_blocks=10)
    block = g.bytes_per_block
    reserved = KVStoreLimits(copies_on_resize=False, capacity_tokens=40 * 16)
    assert reserved.max_blocks_within(g, 5 * block) == 15
    assert reserved.max_blocks_within(g, 100 * block) == 40  # the reservation ends there
    assert reserved.max_blocks_within(g, -block) == 10
    # pages committed ahead of a growth are already out of the free memory: the spare bytes add to them
    assert reserved.max_blocks_within(g, 5 * block, resident_blocks=18) == 23
    assert reserved.max_blocks_within(g, 0, resident_blocks=18) == 18
    copying = KVStoreLimits(copies_on_resize=True)
    assert copying.max_blocks_within(g, 12 * block) == 12  # the new pool is allocated beside the old one
    assert copying.max_blocks_within(g, 3 * block) == 10
    tight = KVStoreLimits.tightest([reserved, KVStoreLimits(False, 30 * 16), KVStoreLimits(False)])
    assert tight == KVStoreLimits(False, 30 * 16)
    assert KVStoreLimits.tightest([reserved, copying]).copies_on_resize
