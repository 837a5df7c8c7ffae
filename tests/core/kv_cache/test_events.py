"""The cache manager's KV cache events: BlockStored when a full block enters the prefix cache (with its
token ids and parent hash), BlockRemoved when a cached prefix is evicted (reuse, the elastic pool's
shrink), AllBlocksCleared on a reset that empties the cache or a block-size change; and the property a
router relies on: replaying the events gives exactly the set of hashes the pool can hit."""

from hypothesis import settings
from hypothesis.stateful import invariant

from tests.core.kv_cache.test_manager_properties import ManagerMachine
from tideserve.core.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, apply_events, external_hash
from tideserve.core.kv_cache.manager import KVCacheManager

BS = 4


def manager(num_blocks: int = 8) -> KVCacheManager:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True)
    kv.enable_events()
    return kv


def cached_hashes(kv: KVCacheManager) -> set[int]:
    return {external_hash(h) for h in kv.pool.cached}


def run(kv: KVCacheManager, rid: str, prompt: list[int]) -> list[int]:
    hit = kv.get_computed_blocks(rid, prompt)
    ids = kv.allocate_slots(rid, prompt, 0, len(prompt) - len(hit) * BS, hit)
    assert ids is not None
    return ids


def test_events_are_off_by_default_and_cost_nothing():
    kv = KVCacheManager(8, BS)
    run(kv, "a", list(range(9)))
    assert kv.events is None and kv.pool.events is None and kv.take_events() == []


def test_full_blocks_are_stored_with_their_tokens_and_parent():
    kv = manager()
    prompt = list(range(10))  # two full blocks and a partial one (never shared, never published)
    run(kv, "a", prompt)
    [stored] = kv.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash is None  # the prompt's first block
    assert stored.token_ids == prompt[:8] and stored.block_size == BS and stored.medium == "GPU"
    assert len(stored.block_hashes) == 2 and set(stored.block_hashes) == cached_hashes(kv)
    assert all(0 <= h < 2**64 for h in stored.block_hashes)
    assert kv.take_events() == []  # drained

    # Decoding fills the third block: one more BlockStored whose parent is the second block.
    prompt += [10, 11]
    kv.allocate_slots("a", prompt, 10, 2)
    [more] = kv.take_events()
    assert more.parent_block_hash == stored.block_hashes[1] and more.token_ids == [8, 9, 10, 11]

    # A second request sharing the prefix hits the cache: nothing new is stored for the shared blocks.
    run(kv, "b", list(range(8)) + [99])
    assert kv.take_events() == []


def test_eviction_by_reuse_is_a_removal():
    kv = manager(num_blocks=3)
    run(kv, "a", list(range(8)) + [0])  # two cached blocks and a partial one: the pool is full
    stored = kv.take_events()[0].block_hashes
    kv.free("a")
    run(kv, "b", [50, 51, 52, 53, 54])  # needs two blocks: one empty, then the oldest cached prefix
    events = kv.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert len(removed) == 1 and len(removed[0].block_hashes) == 1 and removed[0].block_hashes[0] in stored
    assert apply_events(set(stored), events) == cached_hashes(kv)


def test_the_elastic_pools_shrink_removes_the_prefixes_it_drops():
    kv = manager(num_blocks=9)
    for i, rid in enumerate("abc"):
        run(kv, rid, [100 * i + t for t in range(8)] + [7])
    view = apply_events(set(), kv.take_events())
    for rid in "abc":
        kv.free(rid)
    # What PoolController.shrink does: keep the most valuable prefixes that fit, compact, drop the tail.
    evicted = kv.retain_cached(2)
    kv.compact(2)
    kv.shrink_to(2)
    events = kv.take_events()
    assert evicted == 4 and [type(e) for e in events] == [BlockRemoved]
    assert len(events[0].block_hashes) == 4
    assert apply_events(view, events) == cached_hashes(kv) and len(view) == 2


def test_reset_clears_all_and_block_size_change_clears_all():
    kv = manager()
    run(kv, "a", list(range(9)))
    kv.free("a")
    kv.take_events()
    assert kv.reset_prefix_cache() == 2
    assert [type(e) for e in kv.take_events()] == [AllBlocksCleared]

    # A reset while a request still holds cached blocks removes only what it evicted.
    run(kv, "b", list(range(9)))
    run(kv, "c", [40 + t for t in range(9)])
    view = apply_events(set(), kv.take_events())
    kv.free("c")
    kv.reset_prefix_cache()
    events = kv.take_events()
    assert [type(e) for e in events] == [BlockRemoved] and len(events[0].block_hashes) == 2
    assert apply_events(view, events) == cached_hashes(kv) != set()

    kv.free("b")
    kv.relayout(8, 4, {})
    assert [type(e) for e in kv.take_events()] == [AllBlocksCleared]
    run(kv, "d", list(range(17)))  # the new pool still records: blocks of 8 now
    [stored] = kv.take_events()
    assert stored.block_size == 8 and len(stored.token_ids) == 16


class EventsMachine(ManagerMachine):
    """Every operation of the manager's state machine, with events on: a consumer replaying them always
    sees exactly the pool's cached prefixes."""

    def __init__(self) -> None:
        super().__init__()
        self.kv.enable_events()
        self.view: set[int] = set()

    @invariant()
    def replay_matches_the_cache(self):
        events = self.kv.take_events()
        for event in events:
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.view, "removed a block never stored"
            assert not isinstance(event, BlockStored) or not set(event.block_hashes) & self.view
            apply_events(self.view, [event])
        assert self.view == cached_hashes(self.kv)


TestEventsMachine = EventsMachine.TestCase
TestEventsMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
