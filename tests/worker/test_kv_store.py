"""The KV stores: a reserved range whose resizes commit and release pages (never copy, never allocate
twice), the copying store (the GPU path) with its out-of-memory behaviour, and ``KVCacheStorage``, which
carries out every move of the runner's KV bytes (resize, compaction, swap, block-size change).

Residency is read from the kernel (``mincore`` over the reserved range), so these tests fail if a resize
copies the pool into a new allocation or keeps released pages resident.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from tideserve.worker.kv_store import (
    PAGE,
    CopyKVStore,
    KVCacheStorage,
    KVLayout,
    KVStoreGrowError,
    ReservedKVStore,
    copy_between,
    create_swap_store,
)

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, dtype=torch.float32)  # 512 B/token/layer/K
BS = 16
BLOCK = LAYOUT.block_bytes(BS)  # 48 KiB across every layer's K and V
MiB = 2**20


def mapping_rss(store: ReservedKVStore) -> int:
    """Resident bytes of the store's reserved range, page by page, from the kernel (mincore)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    length = len(store._map)
    start = ctypes.addressof(ctypes.c_char.from_buffer(store._map))
    vec = (ctypes.c_ubyte * (length // PAGE))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) * PAGE


def fill_pattern(store, blocks: range) -> None:
    for layer, (k, v) in enumerate(store.caches):
        for b in blocks:
            k[b].fill_(layer * 1000 + b)
            v[b].fill_(-(layer * 1000 + b))


def assert_pattern(store, blocks: range) -> None:
    for layer, (k, v) in enumerate(store.caches):
        for b in blocks:
            assert torch.all(k[b] == layer * 1000 + b) and torch.all(v[b] == -(layer * 1000 + b)), (layer, b)


def test_layout_arithmetic():
    assert LAYOUT.token_bytes == 2 * 64 * 4
    assert BLOCK == 2 * 3 * 16 * 512


def test_reserved_store_grows_and_shrinks_in_place_and_keeps_the_blocks():
    store = ReservedKVStore(LAYOUT, BS, num_blocks=10, reserve_bytes=256 * MiB)
    ptrs = [(k.data_ptr(), v.data_ptr()) for k, v in store.caches]
    fill_pattern(store, range(10))
    store.resize(400)
    assert store.num_blocks == 400 and store.caches[0][0].shape == (400, BS, 2, 64)
    assert [(k.data_ptr(), v.data_ptr()) for k, v in store.caches] == ptrs  # the same memory: no copy
    assert_pattern(store, range(10))
    assert torch.count_nonzero(store.caches[2][1][10:]) == 0  # new blocks read as zeros
    store.resize(6)
    assert [(k.data_ptr(), v.data_ptr()) for k, v in store.caches] == ptrs
    assert_pattern(store, range(6))
    for k, v in store.caches:
        assert k.is_contiguous() and v.is_contiguous()


def test_reserved_store_residency_follows_the_pool():
    """Growth commits the new blocks' pages, shrinking returns them: the resident set follows the pool."""
    store = ReservedKVStore(LAYOUT, BS, num_blocks=1, reserve_bytes=512 * MiB)
    small = mapping_rss(store)
    assert small <= 2 * LAYOUT.num_layers * 2 * PAGE + BLOCK
    store.resize(2000)  # 2000 * 48 KiB = 93.75 MiB
    grown = mapping_rss(store)
    assert 2000 * BLOCK <= grown <= 2000 * BLOCK + 2 * LAYOUT.num_layers * PAGE
    store.resize(2001)  # one more block commits about one block, not the pool again
    assert mapping_rss(store) - grown <= BLOCK + 2 * LAYOUT.num_layers * PAGE
    store.resize(100)
    shrunk = mapping_rss(store)
    assert shrunk <= 100 * BLOCK + 2 * LAYOUT.num_layers * PAGE
    store.resize(0)
    assert mapping_rss(store) == 0


def test_reserved_store_lazy_commit_and_release_all():
    """The swap tier's store commits pages only where written and gives them all back when empty."""
    store = ReservedKVStore(LAYOUT, BS, num_blocks=1000, reserve_bytes=1000 * BLOCK, populate=False)
    assert mapping_rss(store) == 0
    fill_pattern(store, range(3))
    assert 0 < mapping_rss(store) <= 3 * BLOCK + 2 * LAYOUT.num_layers * PAGE
    store.release_all()
    assert mapping_rss(store) == 0 and store.num_blocks == 1000


def test_reserved_store_refuses_growth_beyond_its_reservation():
    store = ReservedKVStore(LAYOUT, BS, num_blocks=4, reserve_bytes=8 * MiB)
    with pytest.raises(KVStoreGrowError):
        store.resize(store.capacity_blocks + 1)
    assert store.num_blocks == 4
    assert store.max_blocks_within(10**12) == store.capacity_blocks
    assert store.max_blocks_within(3 * BLOCK) == 7
    assert store.max_blocks_within(-BLOCK) == 4


def test_reserved_store_reshape_reads_the_same_pages_in_other_chunks():
    store = ReservedKVStore(LAYOUT, BS, num_blocks=8, reserve_bytes=64 * MiB)
    ptr = store.caches[0][0].data_ptr()
    assert store.reshape_blocks(64) == 2
    assert store.block_size == 64 and store.caches[0][0].shape == (2, 64, 2, 64)
    assert store.caches[0][0].data_ptr() == ptr
    assert store.reshape_blocks(8) == 16


def test_fill_slots_touches_exactly_the_given_slots_of_every_layer():
    for store in (ReservedKVStore(LAYOUT, BS, 4, 8 * MiB), CopyKVStore(LAYOUT, torch.device("cpu"), BS, 4)):
        for k, v in store.caches:
            k.fill_(1.0)
            v.fill_(1.0)
        slots = torch.tensor([0, 17, 63])
        store.fill_slots(slots)
        for k, v in store.caches:
            for t in (k, v):
                flat = t.reshape(-1, 2, 64)
                assert torch.all(flat[slots] == 0) and flat.sum() == (64 - 3) * 128


def test_copy_store_resize_keeps_blocks_and_out_of_memory_changes_nothing(monkeypatch):
    store = CopyKVStore(LAYOUT, torch.device("cpu"), BS, 8)
    fill_pattern(store, range(8))
    store.resize(20)
    assert_pattern(store, range(8))
    store.resize(5)
    assert_pattern(store, range(5))
    assert store.max_blocks_within(12 * BLOCK) == 12  # the new tensor must fit beside the old one

    oom = getattr(torch, "OutOfMemoryError", MemoryError)

    def no_memory(*args, **kwargs):
        raise oom("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch, "empty", no_memory)
    with pytest.raises(KVStoreGrowError, match="out of memory"):
        store.resize(50)
    assert store.num_blocks == 5 and store.caches[0][0].shape[0] == 5
    assert_pattern(store, range(5))


def test_copy_store_reshape_without_a_second_allocation():
    store = CopyKVStore(LAYOUT, torch.device("cpu"), BS, 8)
    ptr = store.storage.data_ptr()
    assert store.reshape_blocks(32) == 4 and store.storage.data_ptr() == ptr
    assert store.caches[1][0].shape == (4, 32, 2, 64) and store.caches[1][0].is_contiguous()


def test_swap_copies_round_trip_between_stores():
    device_store = ReservedKVStore(LAYOUT, BS, 6, 8 * MiB)
    swap = create_swap_store(LAYOUT, torch.device("cpu"), BS, 4)
    fill_pattern(device_store, range(6))
    copy_between(device_store, swap, [(4, 0), (5, 3)])
    for k, _ in device_store.caches:
        k.zero_()
    copy_between(swap, device_store, [(0, 1), (3, 2)])
    for layer, (k, v) in enumerate(device_store.caches):
        assert torch.all(k[1] == layer * 1000 + 4) and torch.all(k[2] == layer * 1000 + 5)
        assert torch.all(v[1] == -(layer * 1000 + 4))


def test_storage_moves_the_bytes_and_is_the_one_source_of_its_geometry():
    """Swap out and back, compact, grow and re-read at another block size: the blocks' KV lands where the
    block ids say, the swap tier follows a block-size change at the same bytes, and geometry is read
    from the device store (the planned block size only until one is attached)."""
    storage = KVCacheStorage(LAYOUT, torch.device("cpu"), BS)
    assert storage.block_size == BS and storage.bytes_per_block() == BLOCK
    storage.attach(ReservedKVStore(LAYOUT, BS, 6, 8 * MiB))
    storage.allocate_swap(4)
    fill_pattern(storage, range(6))
    storage.swap_out([(4, 0), (5, 3)])
    for k, v in storage.caches:
        k[1:3].zero_()
        v[1:3].zero_()
    storage.swap_in([(0, 1), (3, 2)])
    storage.copy_blocks([(1, 0)])  # compaction: block 1 (now 4's KV) moves down to 0
    for layer, (k, v) in enumerate(storage.caches):
        assert torch.all(k[0] == layer * 1000 + 4) and torch.all(k[2] == layer * 1000 + 5)
        assert torch.all(v[2] == -(layer * 1000 + 5))
    storage.resize(10)
    assert storage.num_blocks == 10 and storage.caches[0][0].shape[0] == 10
    assert storage.change_block_size(32) == 5
    assert (storage.block_size, storage.num_blocks) == (32, 5)
    assert storage.swap_store.block_size == 32 and storage.swap_store.num_blocks == 2  # 4 x 16 tokens
    assert storage.bytes_per_block() == 2 * BLOCK


def test_storage_clears_only_the_slots_nobody_wrote():
    storage = KVCacheStorage(LAYOUT, torch.device("cpu"), BS)
    storage.attach(CopyKVStore(LAYOUT, torch.device("cpu"), BS, 4))
    for k, v in storage.caches:
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    storage.clear_unwritten([([2, 0], BS + 5), ([3], 0)])  # 21 tokens valid over blocks 2, 0; block 3 fresh
    for k, v in storage.caches:
        for cache in (k, v):
            assert cache[2].isnan().all() and cache[0, :5].isnan().all()
            assert torch.all(cache[0, 5:] == 0) and torch.all(cache[3] == 0) and cache[1].isnan().all()


FP8 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float8_e4m3fn)  # --kv-cache-dtype fp8


def fp8_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_float8_caches_fill_copy_and_swap_by_their_bytes():
    """torch's CPU index_fill_ / index_copy_ have no float8 kernels: every move of an fp8 pool (slot
    clearing on both stores, compaction, the swap tier both ways) goes through the bytes, unchanged."""
    assert FP8.block_bytes(BS) == 2 * 2 * BS * 2 * 64  # one byte per value
    for store in (ReservedKVStore(FP8, BS, 4, 8 * MiB), CopyKVStore(FP8, torch.device("cpu"), BS, 4)):
        for layer, (k, v) in enumerate(store.caches):
            for b in range(4):
                fp8_bytes(k[b]).fill_(16 * layer + b + 1)
                fp8_bytes(v[b]).fill_(128 + 16 * layer + b + 1)
        store.fill_slots(torch.tensor([0, 17, 63]))
        for k, v in store.caches:
            for t in (k, v):
                flat = fp8_bytes(t).reshape(-1, 2, 64)
                assert torch.all(flat[[0, 17, 63]] == 0) and torch.all(flat[1] != 0) and torch.all(flat[16] != 0)
        store.copy_blocks([(2, 0)])
        for layer, (k, v) in enumerate(store.caches):
            assert torch.equal(fp8_bytes(k[0]), fp8_bytes(k[2]))
            assert torch.all(fp8_bytes(v[0])[1:] == 128 + 16 * layer + 3)
    device_store = ReservedKVStore(FP8, BS, 4, 8 * MiB)
    swap = create_swap_store(FP8, torch.device("cpu"), BS, 2)
    for layer, (k, v) in enumerate(device_store.caches):
        k[3] = torch.linspace(-448, 448, k[3].numel()).view(k[3].shape).to(torch.float8_e4m3fn)
        fp8_bytes(v[3]).fill_(layer + 7)
    want = [(fp8_bytes(k[3]).clone(), fp8_bytes(v[3]).clone()) for k, v in device_store.caches]
    copy_between(device_store, swap, [(3, 1)])
    for k, v in device_store.caches:
        fp8_bytes(k).zero_()
        fp8_bytes(v).zero_()
    copy_between(swap, device_store, [(1, 0)])
    for (k, v), (wk, wv) in zip(device_store.caches, want):
        assert torch.equal(fp8_bytes(k[0]), wk) and torch.equal(fp8_bytes(v[0]), wv)


def wait_for_commit_ahead(store: ReservedKVStore, num_blocks: int) -> None:
    for _ in range(2000):
        if store.commit_ahead(num_blocks):
            return
        store._ahead_thread.join(0.01)
    raise AssertionError("the background commit did not finish")


def test_reserved_store_commits_ahead_in_the_background_then_resizes_without_committing(monkeypatch):
    """commit_ahead makes a coming growth's pages resident on a thread of its own; the resize that
    follows commits nothing more, keeps the blocks, and a shrink hands back what was committed ahead."""
    store = ReservedKVStore(LAYOUT, BS, num_blocks=10, reserve_bytes=512 * MiB)
    fill_pattern(store, range(10))
    assert store.commit_ahead(2000) is False  # started, not done
    wait_for_commit_ahead(store, 2000)
    assert store.num_blocks == 10  # the pool itself waits for resize
    assert mapping_rss(store) >= 2000 * BLOCK
    assert store.committed_bytes >= 2000 * BLOCK
    committed = []
    real_commit = store._commit
    monkeypatch.setattr(store, "_commit", lambda lo, hi: (committed.append(max(0, hi - lo)), real_commit(lo, hi)))
    store.resize(2000)
    assert sum(committed) == 0
    assert_pattern(store, range(10))
    assert torch.count_nonzero(store.caches[1][0][10:]) == 0
    assert store.commit_ahead(2000) is True  # nothing left to do
    # Ahead of the new end again, then a shrink: the pages committed ahead go back too.
    assert store.commit_ahead(3000) is False
    wait_for_commit_ahead(store, 3000)
    assert mapping_rss(store) >= 3000 * BLOCK
    store.resize(100)
    assert mapping_rss(store) <= 100 * BLOCK + 2 * LAYOUT.num_layers * PAGE
    assert store.committed_bytes <= 100 * BLOCK + 2 * LAYOUT.num_layers * PAGE
    assert_pattern(store, range(10))


def gated_madvise(monkeypatch, calls_before_gate: int):
    """libc's madvise for the background thread, which blocks after ``calls_before_gate`` calls until
    the returned event is set; returns (event, the calls made)."""
    import threading

    import tideserve.worker.kv_store as kv_store

    real = kv_store._libc_madvise()
    gate, calls = threading.Event(), []

    def madvise(addr, length, advice):
        if len(calls) >= calls_before_gate:
            assert gate.wait(30)
        calls.append(length)
        return real(addr, length, advice)

    monkeypatch.setattr(kv_store, "_libc_madvise", lambda: madvise)
    return gate, calls


def test_a_growth_takes_the_blocks_committed_so_far_while_the_background_commit_goes_on(monkeypatch):
    """The background commit publishes each chunk it has made resident; a growth within that part
    neither waits for the thread nor commits anything, and the thread then finishes the rest."""
    import tideserve.worker.kv_store as kv_store

    monkeypatch.setattr(kv_store, "AHEAD_CHUNK_BYTES", 2 * LAYOUT.num_layers * 64 * 1024)  # 64 KiB per region
    regions = 2 * LAYOUT.num_layers
    gate, calls = gated_madvise(monkeypatch, calls_before_gate=3 * regions)  # three chunks, then it waits
    store = ReservedKVStore(LAYOUT, BS, num_blocks=10, reserve_bytes=512 * MiB)
    fill_pattern(store, range(10))
    done = []
    assert store.commit_ahead(1000, on_done=lambda: done.append(1)) is False
    for _ in range(3000):
        if len(calls) >= 3 * regions and store.committed_ahead_blocks > 10:
            break
        store._ahead_thread.join(0.01)
    ready = store.committed_ahead_blocks
    assert 10 < ready < 1000 and store.commit_in_flight and not done
    committed = []
    real_commit = store._commit
    monkeypatch.setattr(store, "_commit", lambda lo, hi: (committed.append(max(0, hi - lo)), real_commit(lo, hi)))
    store.resize(ready)  # returns with the thread still held at its gate
    assert store.num_blocks == ready and sum(committed) == 0 and store.commit_in_flight
    assert_pattern(store, range(10))
    gate.set()
    store._ahead_thread.join(30)
    assert done == [1] and store.committed_ahead_blocks >= 1000 and mapping_rss(store) >= 1000 * BLOCK
    store.resize(1000)
    assert sum(committed) == 0
    assert_pattern(store, range(10))


def test_a_growth_past_the_committed_part_waits_only_for_the_pages_it_needs(monkeypatch):
    """A growth inside a background commit's goal but past what it has made resident waits until the
    thread has committed that far, not for the whole commit; it commits nothing itself, and the thread
    goes on to its goal afterwards."""
    import threading

    import tideserve.worker.kv_store as kv_store

    monkeypatch.setattr(kv_store, "AHEAD_CHUNK_BYTES", 2 * LAYOUT.num_layers * 64 * 1024)  # 64 KiB per region
    regions = 2 * LAYOUT.num_layers
    real = kv_store._libc_madvise()
    allowed, calls = [3 * regions], []  # the thread may make this many calls, then waits for more
    more = threading.Condition()

    def madvise(addr, length, advice):
        with more:
            assert more.wait_for(lambda: len(calls) < allowed[0], 30)
            calls.append(length)
        return real(addr, length, advice)

    monkeypatch.setattr(kv_store, "_libc_madvise", lambda: madvise)
    store = ReservedKVStore(LAYOUT, BS, num_blocks=10, reserve_bytes=512 * MiB)
    fill_pattern(store, range(10))
    assert store.commit_goal_blocks == 10  # nothing under way
    assert store.commit_ahead(1000) is False
    assert store.commit_goal_blocks >= 1000
    for _ in range(3000):
        if len(calls) >= 3 * regions and store.committed_ahead_blocks > 10:
            break
        store._ahead_thread.join(0.01)
    ready = store.committed_ahead_blocks
    target = ready + 3  # in the fourth chunk (64 KiB per region holds 128 tokens: 8 blocks)
    committed = []
    real_commit = store._commit
    monkeypatch.setattr(store, "_commit", lambda lo, hi: (committed.append(max(0, hi - lo)), real_commit(lo, hi)))
    grower = threading.Thread(target=store.resize, args=(target,))
    grower.start()
    grower.join(0.3)
    assert grower.is_alive() and store.num_blocks == 10  # waiting for the fourth chunk
    with more:
        allowed[0] = 5 * regions  # two more chunks, then the thread waits again
        more.notify_all()
    grower.join(30)
    assert not grower.is_alive() and store.num_blocks == target
    assert store.commit_in_flight and len(calls) <= 5 * regions  # the rest of the commit still to come
    assert sum(committed) == 0
    assert_pattern(store, range(10))
    with more:
        allowed[0] = 1 << 30
        more.notify_all()
    store._ahead_thread.join(30)
    assert store.committed_ahead_blocks >= 1000 and store.commit_goal_blocks == store.committed_ahead_blocks
    store.resize(1000)
    assert sum(committed) == 0 and mapping_rss(store) >= 1000 * BLOCK
    assert_pattern(store, range(10))


def test_a_shrink_stops_the_background_commit_and_hands_its_pages_back(monkeypatch):
    import tideserve.worker.kv_store as kv_store

    monkeypatch.setattr(kv_store, "AHEAD_CHUNK_BYTES", 2 * LAYOUT.num_layers * 64 * 1024)
    regions = 2 * LAYOUT.num_layers
    gate, calls = gated_madvise(monkeypatch, calls_before_gate=2 * regions)
    store = ReservedKVStore(LAYOUT, BS, num_blocks=10, reserve_bytes=512 * MiB)
    done = []
    assert store.commit_ahead(2000, on_done=lambda: done.append(1)) is False
    for _ in range(3000):
        if len(calls) >= 2 * regions:
            break
        store._ahead_thread.join(0.01)
    gate.set()
    store.resize(5)  # stops the thread at its next region, then releases what it committed
    assert done == [1] and not store.commit_in_flight
    whole = regions * (2000 * BS * LAYOUT.token_bytes // (64 * 1024))  # the growth's madvise calls
    assert len(calls) < whole // 2  # it did not commit the whole growth first
    assert mapping_rss(store) <= 5 * BLOCK + regions * PAGE and store.committed_ahead_blocks == 5


def test_commit_ahead_calls_its_callback_once_when_it_starts_nothing():
    store = ReservedKVStore(LAYOUT, BS, num_blocks=10, reserve_bytes=64 * MiB)
    done = []
    assert store.commit_ahead(5, on_done=lambda: done.append(1)) is True  # not a growth
    assert done == [1]
    assert CopyKVStore(LAYOUT, torch.device("cpu"), BS, 4).commit_ahead(1000, on_done=lambda: done.append(2))
    assert done == [1, 2]


def test_a_store_without_background_commits_is_always_ready():
    lazy = ReservedKVStore(LAYOUT, BS, num_blocks=4, reserve_bytes=64 * MiB, populate=False)
    assert lazy.commit_ahead(1000) is True and mapping_rss(lazy) == 0
    assert CopyKVStore(LAYOUT, torch.device("cpu"), BS, 4).commit_ahead(1000) is True


def test_a_failed_background_commit_leaves_the_growth_to_resize(monkeypatch):
    """When the kernel refuses the background commit, commit_ahead stops asking for a wait and the
    resize commits on the caller's thread (where a real failure raises KVStoreGrowError)."""
    import tideserve.worker.kv_store as kv_store

    monkeypatch.setattr(kv_store, "_libc_madvise", lambda: (lambda addr, length, advice: -1))
    store = ReservedKVStore(LAYOUT, BS, num_blocks=10, reserve_bytes=256 * MiB)
    assert store.commit_ahead(1000) is False
    store._ahead_thread.join()
    assert store.commit_ahead(1000) is True
    assert mapping_rss(store) < 1000 * BLOCK
    store.resize(1000)
    assert mapping_rss(store) >= 1000 * BLOCK
    assert store.commit_ahead(2000) is False  # a resize clears the failure: the next growth tries again


def test_a_growth_commits_in_steps_and_stops_when_the_machine_runs_short():
    """Before each step of a growth's pages the store asks whether the machine still has room: when it has
    not, what the growth committed goes back and the store is as it was; with room it grows as usual."""
    store = ReservedKVStore(LAYOUT, BS, num_blocks=4, reserve_bytes=64 * MiB)
    live = mapping_rss(store)
    fill_pattern(store, range(4))
    steps: list[int] = []
    room = {"steps": 3}

    def guard(num_bytes: int) -> bool:
        steps.append(num_bytes)
        room["steps"] -= 1
        return room["steps"] >= 0

    store.commit_guard = guard
    target = 4 + (16 * MiB) // BLOCK  # several steps' worth of pages
    with pytest.raises(KVStoreGrowError, match="free memory fell under the floor"):
        store.resize(target)
    assert len(steps) == 4 and store.num_blocks == 4  # three steps committed, the fourth refused
    assert mapping_rss(store) <= live + 2 * LAYOUT.num_layers * PAGE  # the three steps' pages went back
    for layer, (k, v) in enumerate(store.caches):  # the live blocks kept their KV
        assert torch.all(k[3] == layer * 1000 + 3) and torch.all(v[3] == -(layer * 1000 + 3))
    room["steps"] = 10**6
    store.resize(target)
    assert store.num_blocks == target and mapping_rss(store) >= target * BLOCK
