"""The mapped KV store (worker/cuda_kv_store.py): one reserved range of device addresses, memory mapped into
it in rows of granules as the pool grows and unmapped as it shrinks.

On the CPU the store runs over ``FakeDriver`` (tests/worker/fake_cuda_driver.py), a double of the binding's
driver module backed by host memory that enforces the driver's rules; the region and row arithmetic, the
moves, the failure paths, the choice of store and the engine on top of it are tested here. The tests
marked ``cuda`` run the same store on a GPU through cuda-bindings (benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import gc
import os
import sys
import time

import pytest
import torch

from tests.worker.fake_cuda_driver import FakeDriver
from tideserve.worker import cuda_kv_store, kv_store
from tideserve.worker.cuda_graphs import kv_key
from tideserve.worker.cuda_kv_store import DriverVMM, MappedKVStore, RegionPlan, open_vmm, rows_for
from tideserve.worker.kv_store import KVLayout, KVStoreGrowError, create_kv_store

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, dtype=torch.float32)  # 512 B/token per K or V
BS = 16
GRAN = 64 * 2**10  # the fake's granule: 64 KiB holds 128 tokens of one region, 8 blocks
ROW = 6 * GRAN  # one granule of each of the 6 regions
MiB, GiB = 2**20, 2**30


def fake_vmm(memory_bytes: int = 64 * MiB, **kwargs) -> tuple[FakeDriver, DriverVMM]:
    driver = FakeDriver(memory_bytes, granularity=GRAN, **kwargs)
    return driver, DriverVMM(driver, 0, as_tensor=driver.host_tensor, synchronize=lambda: None)


def make_store(num_blocks: int, reserve_bytes: int = 8 * MiB, **kwargs) -> tuple[FakeDriver, MappedKVStore]:
    driver, vmm = fake_vmm(**kwargs)
    return driver, MappedKVStore(LAYOUT, torch.device("cpu"), BS, num_blocks, reserve_bytes, vmm)


def fill_pattern(store, blocks: range) -> None:
    for layer, (k, v) in enumerate(store.caches):
        for b in blocks:
            k[b].fill_(layer * 1000 + b)
            v[b].fill_(-(layer * 1000 + b))


def assert_pattern(store, blocks: range) -> None:
    for layer, (k, v) in enumerate(store.caches):
        for b in blocks:
            assert torch.all(k[b] == layer * 1000 + b) and torch.all(v[b] == -(layer * 1000 + b)), (layer, b)


def pointers(caches) -> list[tuple[int, int]]:
    return [(k.data_ptr(), v.data_ptr()) for k, v in caches]


# ----------------------------------------------------------------------------------------- arithmetic
def test_region_plan_arithmetic():
    assert rows_for(0, GRAN) == 0 and rows_for(1, GRAN) == 1 and rows_for(GRAN, GRAN) == 1
    assert rows_for(GRAN + 1, GRAN) == 2
    plan = RegionPlan.for_reservation(LAYOUT, 8 * MiB, GRAN)
    assert plan.num_regions == 6
    assert plan.region_bytes == 1408 * 2**10  # 8 MiB / 6 = 1365.3 KiB, rounded up to 22 granules
    assert plan.region_bytes % GRAN == 0 and plan.reserve_bytes >= 8 * MiB
    assert plan.capacity_tokens == plan.region_bytes // 512
    assert plan.row_bytes == ROW
    assert plan.end_bytes(8, BS) == GRAN and plan.rows(8, BS) == 1 and plan.rows(9, BS) == 2
    assert plan.mapped_bytes(0, BS) == 0 and plan.mapped_bytes(1, BS) == ROW and plan.mapped_bytes(17, BS) == 3 * ROW
    assert plan.granule_address(1000, 2, 3) == 1000 + 2 * plan.region_bytes + 3 * GRAN


# ----------------------------------------------------------------------------------------- moves
def test_growth_and_shrink_map_rows_in_place_and_keep_the_blocks():
    driver, store = make_store(num_blocks=4)
    assert (store.mapped_rows, driver.used_bytes, driver.mapped_bytes()) == (1, ROW, ROW)
    ptrs = pointers(store.caches)
    fill_pattern(store, range(4))
    store.resize(40)  # 640 tokens per region: 5 rows
    assert store.num_blocks == 40 and store.caches[0][0].shape == (40, BS, 2, 64)
    assert pointers(store.caches) == ptrs  # the same addresses: nothing was copied or moved
    assert store.mapped_rows == 5 and driver.used_bytes == 5 * ROW == store.mapped_bytes
    assert_pattern(store, range(4))
    assert torch.count_nonzero(store.caches[2][1][4:]) == 0  # new blocks read as zeros, not the driver's bytes
    store.resize(6)
    assert pointers(store.caches) == ptrs and store.mapped_rows == 1
    assert driver.used_bytes == ROW  # the unmapped rows' memory went back to the device
    assert_pattern(store, range(4))
    store.resize(20)  # memory mapped again reads as zeros, whatever the rows held before
    assert_pattern(store, range(4))
    assert torch.count_nonzero(store.caches[0][0][8:]) == 0
    for k, v in store.caches:
        assert k.is_contiguous() and v.is_contiguous()


def test_sleep_unmaps_every_row_and_a_wake_maps_them_again_at_the_same_addresses():
    driver, store = make_store(num_blocks=40)
    ptrs = pointers(store.caches)
    fill_pattern(store, range(4))
    store.release_pages()
    assert store.mapped_rows == 0 and driver.used_bytes == 0 and store.num_blocks == 40  # geometry kept
    store.restore_pages()
    assert store.mapped_rows == 5 and driver.used_bytes == 5 * ROW and pointers(store.caches) == ptrs
    assert all(torch.count_nonzero(k) == 0 and torch.count_nonzero(v) == 0 for k, v in store.caches)  # zeroed


def test_a_resize_costs_driver_calls_in_proportion_to_the_rows_it_changes():
    driver, store = make_store(num_blocks=1)
    for rows in (2, 8):
        before = driver.calls.copy()
        store.resize(store.num_blocks + rows * 8)
        grew = driver.calls - before
        assert grew["cuMemCreate"] == grew["cuMemRelease"] == rows  # one allocation per row
        assert grew["cuMemMap"] == rows * 6 and grew["cuMemSetAccess"] == 6  # one mapping per granule
        before = driver.calls.copy()
        store.resize(store.num_blocks - rows * 8)
        assert (driver.calls - before)["cuMemUnmap"] == rows * 6
    before = driver.calls.copy()
    store.resize(store.num_blocks + 1)  # within the mapped row: no driver call at all
    assert driver.calls == before


def test_out_of_memory_raises_and_changes_nothing():
    driver, store = make_store(num_blocks=8, memory_bytes=4 * ROW)
    fill_pattern(store, range(8))
    ptrs = pointers(store.caches)
    with pytest.raises(KVStoreGrowError, match="out of device memory"):
        store.resize(8 * 8)  # 8 rows, the device has 4
    assert (store.num_blocks, store.mapped_rows, driver.used_bytes, driver.mapped_bytes()) == (8, 1, ROW, ROW)
    assert pointers(store.caches) == ptrs and store.caches[0][0].shape[0] == 8
    assert_pattern(store, range(8))
    store.resize(4 * 8)  # what fits still grows
    assert store.mapped_rows == 4


def test_a_failed_mapping_mid_row_unmaps_what_it_mapped():
    driver, store = make_store(num_blocks=8)
    driver.fail_map_after = 6 + 3  # the next row maps fully, the one after fails at its fourth region
    with pytest.raises(KVStoreGrowError, match="cuMemMap failed"):
        store.resize(3 * 8)
    assert (store.num_blocks, store.mapped_rows, driver.used_bytes, driver.mapped_bytes()) == (8, 1, ROW, ROW)


def test_growth_stops_when_the_commit_guard_refuses_and_changes_nothing():
    driver, store = make_store(num_blocks=8)
    asked: list[int] = []
    store.commit_guard = lambda num_bytes: asked.append(num_bytes) or len(asked) < 3
    with pytest.raises(KVStoreGrowError, match="free memory fell under the floor"):
        store.resize(10 * 8)
    assert asked == [ROW, ROW, ROW]  # asked before each row
    assert (store.num_blocks, store.mapped_rows, driver.used_bytes) == (8, 1, ROW)


def test_growth_beyond_the_reservation_is_refused():
    driver, store = make_store(num_blocks=8, reserve_bytes=ROW)  # one granule per region
    assert store.capacity_blocks == 8
    with pytest.raises(KVStoreGrowError, match="exceed the reservation"):
        store.resize(9)
    assert store.limits() == kv_store.KVStoreLimits(copies_on_resize=False, capacity_tokens=128)


def test_reshape_reads_the_same_memory_in_other_chunks():
    driver, store = make_store(num_blocks=8)
    ptrs = pointers(store.caches)
    store.caches[1][0].view(-1, 2, 64)[:128].copy_(torch.arange(128.0)[:, None, None].expand(128, 2, 64))
    assert store.reshape_blocks(32) == 4 and store.block_size == 32
    assert store.caches[1][0].shape == (4, 32, 2, 64) and pointers(store.caches) == ptrs
    assert torch.equal(store.caches[1][0].reshape(-1, 2, 64)[:, 0, 0], torch.arange(128.0))
    assert store.mapped_rows == 1
    assert store.reshape_blocks(256) == 1 and store.mapped_rows == 2  # one block of 256 tokens needs 2 rows


def test_fixed_caches_keep_their_addresses_and_shapes_across_resizes():
    driver, store = make_store(num_blocks=8)
    fixed = store.fixed_caches
    key = kv_key(fixed, BS)
    assert fixed[0][0].shape == (store.capacity_blocks, BS, 2, 64)
    assert pointers(fixed) == pointers(store.caches)
    store.resize(30)
    store.caches[2][1][20].fill_(7.0)  # in the third row
    store.caches[2][1][2].fill_(5.0)  # in the first
    store.resize(3)
    store.resize(50)
    assert store.fixed_caches is fixed and kv_key(store.fixed_caches, BS) == key  # a graph over them stays valid
    assert torch.all(fixed[2][1][20] == 0)  # unmapped by the shrink to 3, mapped again as zeros
    assert torch.all(fixed[2][1][2] == 5.0)  # kept
    store.reshape_blocks(32)
    assert store.fixed_caches is not fixed and store.fixed_caches[0][0].shape == (store.capacity_blocks, 32, 2, 64)


def test_fill_and_copy_touch_only_the_given_slots_and_blocks():
    driver, store = make_store(num_blocks=8)
    fill_pattern(store, range(8))
    store.fill_slots(torch.tensor([0, 17, 127]), 0.5)
    for k, v in store.caches:
        flat = k.view(-1, 2, 64)
        assert torch.all(flat[[0, 17, 127]] == 0.5) and torch.all(v.view(-1, 2, 64)[[0, 17, 127]] == 0.5)
        assert torch.all(flat[1] != 0.5)
    store.copy_blocks([(3, 6)])
    for layer, (k, _) in enumerate(store.caches):
        assert torch.equal(k[6], k[3]) and torch.all(k[3] == layer * 1000 + 3)


def test_close_and_collection_give_the_memory_and_the_addresses_back():
    driver, store = make_store(num_blocks=30)
    assert driver.reservations and driver.used_bytes
    store.close()
    assert not driver.reservations and driver.used_bytes == 0 and driver.context_retained == 0
    driver, store = make_store(num_blocks=30)
    views = store.caches  # a view keeps the range alive: the driver must not free memory torch still sees
    del store
    gc.collect()
    assert driver.reservations
    del views
    gc.collect()
    assert not driver.reservations and driver.used_bytes == 0


def test_pool_bytes_are_reported_beside_the_allocator():
    _, store = make_store(num_blocks=10)
    assert store.bytes_outside_allocator == store.pool_bytes == 10 * LAYOUT.block_bytes(BS)


# ----------------------------------------------------------------------------------------- the choice of store
def test_try_create_halves_a_reservation_the_driver_refuses():
    driver, vmm = fake_vmm(max_reserve_bytes=32 * MiB)
    store, why = MappedKVStore.try_create(LAYOUT, torch.device("cpu"), BS, 8, 200 * MiB, vmm)
    assert why == "" and store.plan.reserve_bytes <= 32 * MiB and store.plan.reserve_bytes >= 25 * MiB
    driver, vmm = fake_vmm(max_reserve_bytes=ROW)
    store, why = MappedKVStore.try_create(LAYOUT, torch.device("cpu"), BS, 100, 200 * MiB, vmm)
    assert store is None and "would not reserve" in why


def test_open_vmm_says_why_it_cannot_be_had(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)  # not installed
    vmm, why = open_vmm(torch.device("cuda", 0))
    assert vmm is None and "cuda-bindings is not installed" in why and "tideserve[cuda]" in why
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", FakeDriver(GiB, vmm=False))
    vmm, why = open_vmm(torch.device("cuda", 0))
    assert vmm is None and "no virtual memory management on cuda:0" in why

    class NoDriver(FakeDriver):
        def cuInit(self, flags):  # noqa: N802 (the binding raises when libcuda cannot be loaded)
            raise OSError('"cuda" is an NVIDIA driver library and can only be found via system search')

    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", NoDriver(GiB))
    vmm, why = open_vmm(torch.device("cuda", 0))
    assert vmm is None and "could not be used through cuda-bindings" in why and "NVIDIA driver library" in why
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", FakeDriver(GiB, granularity=GRAN))
    vmm, why = open_vmm(torch.device("cuda", 0))
    assert why == "" and vmm.granularity == GRAN


class RecordingCopyStore:
    """Stands in for CopyKVStore where no GPU can allocate: records how the store was asked for."""

    def __init__(self, layout, device, block_size, num_blocks, zero=False, pin_memory=False, why=""):
        self.device, self.num_blocks, self.zero, self.why = device, num_blocks, zero, why


def test_create_kv_store_maps_an_elastic_pool_on_cuda_and_falls_back_with_the_reason(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(kv_store, "CopyKVStore", RecordingCopyStore)
    driver, vmm = fake_vmm()
    monkeypatch.setattr(cuda_kv_store, "open_vmm", lambda device: (vmm, ""))
    store = create_kv_store(LAYOUT, cuda, BS, 8, 4 * MiB, static=False)
    assert isinstance(store, MappedKVStore) and store.vmm is vmm
    assert "mapped device range" in store.describe() and "nothing is copied" in store.describe()
    assert not store.limits().copies_on_resize
    # A fixed pool stays one plain tensor: nothing resizes it.
    static = create_kv_store(LAYOUT, cuda, BS, 8, 4 * MiB, static=True)
    assert isinstance(static, RecordingCopyStore) and static.zero and static.why == ""
    # No binding, or no support: the copying store, which carries the reason into the start-up log.
    monkeypatch.setattr(cuda_kv_store, "open_vmm", lambda device: (None, "cuda-bindings is not installed (x)"))
    store = create_kv_store(LAYOUT, cuda, BS, 8, 4 * MiB, static=False)
    assert isinstance(store, RecordingCopyStore) and store.why == "cuda-bindings is not installed (x)"


def test_the_copying_store_says_what_it_costs():
    store = kv_store.CopyKVStore(LAYOUT, torch.device("cpu"), BS, 4, why="cuda-bindings is not installed")
    text = store.describe()
    assert "copies the kept blocks" in text and "about half the free memory" in text
    assert text.endswith("cuda-bindings is not installed")
    assert store.limits().copies_on_resize


# ----------------------------------------------------------------------------------------- the engine on top
def use_mapped_pools(monkeypatch, memory_bytes: int) -> list[FakeDriver]:
    """Every engine built afterwards holds its pool in a MappedKVStore over a fake driver with ``memory_bytes``
    of device memory (on the CPU); the drivers, in order."""
    drivers: list[FakeDriver] = []

    def create(layout, device, block_size, num_blocks, reserve_bytes, static):
        driver, vmm = fake_vmm(memory_bytes=memory_bytes)
        drivers.append(driver)
        return MappedKVStore(layout, device, block_size, num_blocks, min(reserve_bytes, GiB), vmm)

    monkeypatch.setattr(kv_store, "create_kv_store", create)
    return drivers


@pytest.fixture
def mapped_pool(monkeypatch):
    return use_mapped_pools(monkeypatch, 2 * GiB)


@pytest.mark.slow
def test_a_growth_the_device_cannot_back_backs_off_and_every_request_finishes(make_llm, monkeypatch, caplog):
    """The device has room for 26 blocks; the burst wants about 32: growth fails (out of device memory),
    the pool stays as it was and backs off, requests wait or are preempted, and every answer is the one an
    unconstrained engine gives."""
    from tideserve import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [f"Question {i}: name a city in country number {i} and describe it in detail please" for i in range(8)]
    reference = make_llm(dtype="float32", max_model_len=256)
    want = [list(o.outputs[0].token_ids) for o in reference.generate(prompts, greedy)]
    drivers = use_mapped_pools(monkeypatch, memory_bytes=5 * 60 * GRAN)  # 5 rows of the 30-layer model: 426 tokens
    caplog.set_level("WARNING", logger="tideserve.engine.pool_controller")
    llm = make_llm(dtype="float32", max_model_len=256)
    pool = llm.engine.pool
    assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)] == want
    assert pool.num_grow_failures >= 1
    assert any("out of device memory" in r.getMessage() and "no growth for" in r.getMessage() for r in caplog.records)
    assert drivers[-1].used_bytes <= drivers[-1].memory_bytes
    store = llm.engine.executor.driver_worker.kv_storage.device_store
    assert store.num_blocks == pool.geometry.num_blocks and drivers[-1].used_bytes == store.mapped_bytes


@pytest.mark.slow
def test_an_engine_on_the_mapped_store_grows_shrinks_and_keeps_its_graphs(make_llm, mapped_pool, caplog):
    from tideserve import SamplingParams, native
    from tideserve.worker.cuda_graphs import eager_capture

    if native.load_library() is None:
        pytest.skip("no C compiler to build the native kernels")
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "List three colours:", "Once upon a time"]
    reference = make_llm(dtype="float32", max_model_len=256, enable_prefix_caching=False,
                         attention_backend="cpu-native")
    want = [list(o.outputs[0].token_ids) for o in reference.generate(prompts, greedy)]
    caplog.set_level("INFO", logger="tideserve.engine.builder")
    llm = make_llm(dtype="float32", max_model_len=256, enable_prefix_caching=False, attention_backend="cpu-native")
    engine = llm.engine
    worker = engine.executor.driver_worker
    store = worker.kv_storage.device_store
    assert isinstance(store, MappedKVStore)
    assert any("KV store: mapped device range" in r.getMessage() for r in caplog.records)
    assert worker.runner.enable_graphs(max_num_seqs=8, max_model_len=256, capture=eager_capture)
    assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)] == want
    graphs = worker.runner.graphs
    captures = graphs.num_captures
    assert captures >= 1
    driver = mapped_pool[-1]
    for target in (engine.kv_manager.num_blocks + 300, 40, engine.kv_manager.num_blocks + 500):
        assert engine.pool._resize(target, "test")
        assert driver.used_bytes == store.mapped_bytes  # the device holds what the store maps, no more
        assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)] == want
    assert graphs.num_captures == captures and graphs.num_invalidations == 0  # no graph was recaptured
    report = worker.memory_report()
    probe = worker.memory_probe
    assert report.used_by_process_bytes >= probe.used_by_process_bytes() + store.pool_bytes - 2**20


def test_an_elastic_pool_that_copies_warns_at_start_up(make_llm, monkeypatch, caplog):
    monkeypatch.setattr(kv_store.ReservedKVStore, "try_create", classmethod(lambda cls, *a, **k: None))
    caplog.set_level("INFO", logger="tideserve.engine.builder")
    llm = make_llm(dtype="float32", max_model_len=256)
    assert isinstance(llm.engine.executor.driver_worker.kv_storage.device_store, kv_store.CopyKVStore)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "KV store" in r.getMessage()]
    assert "copies the kept blocks" in warning and "the host would not reserve the address range" in warning
    assert "The elastic pool can grow to about" in warning


# ----------------------------------------------------------------------------------------- on a GPU
def _gpu_store(num_blocks: int, reserve_bytes: int, layout: KVLayout | None = None) -> MappedKVStore:
    store, why = MappedKVStore.try_create(layout or LAYOUT, torch.device("cuda", 0), BS, num_blocks, reserve_bytes)
    if store is None:
        pytest.skip(f"no mapped store on this GPU: {why}")
    return store


@pytest.mark.cuda
def test_gpu_mapped_store_grows_and_shrinks_without_a_copy():
    store = _gpu_store(4, 4 * GiB)
    assert store.granularity >= 2**16 and store.caches[0][0].is_cuda
    ptrs = pointers(store.caches)
    fill_pattern(store, range(4))
    free0 = torch.cuda.mem_get_info()[0]
    store.resize(4 + 1 * GiB // LAYOUT.block_bytes(BS))
    free1 = torch.cuda.mem_get_info()[0]
    assert pointers(store.caches) == ptrs
    assert_pattern(store, range(4))
    assert torch.count_nonzero(store.caches[1][0][4:]) == 0
    assert free0 - free1 >= 0.95 * GiB and torch.cuda.memory_reserved() < 0.5 * GiB  # outside torch's allocator
    store.resize(6)
    torch.cuda.synchronize()
    assert torch.cuda.mem_get_info()[0] - free1 >= 0.95 * GiB  # back to the device
    assert pointers(store.caches) == ptrs
    assert_pattern(store, range(4))
    store.close()


@pytest.mark.cuda
def test_gpu_mapped_store_resize_time_follows_the_bytes_mapped():
    layout = KVLayout(num_layers=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    store = _gpu_store(1, 16 * GiB, layout)
    per_gib = GiB // layout.block_bytes(BS)

    def timed(gib: int) -> tuple[float, float]:
        grow, shrink = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            store.resize(1 + gib * per_gib)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            store.resize(1)
            t2 = time.perf_counter()
            grow.append(t1 - t0)
            shrink.append(t2 - t1)
        return min(grow), min(shrink)

    small, large = timed(1), timed(4)
    print(f"grow 1 GiB {small[0] * 1e3:.1f} ms, 4 GiB {large[0] * 1e3:.1f} ms; shrink {small[1] * 1e3:.1f} / "
          f"{large[1] * 1e3:.1f} ms")
    assert 1.8 < large[0] / small[0] < 8  # about 4x: the cost is per row mapped, not per pool
    assert large[1] / max(small[1], 1e-4) < 8
    store.close()


@pytest.mark.cuda
def test_gpu_mapped_store_out_of_memory_changes_nothing():
    total = torch.cuda.mem_get_info()[1]
    store = _gpu_store(8, 2 * total)
    fill_pattern(store, range(8))
    ptrs = pointers(store.caches)
    free0 = torch.cuda.mem_get_info()[0]
    with pytest.raises(KVStoreGrowError, match="out of device memory"):
        store.resize(int(1.5 * total) // LAYOUT.block_bytes(BS))
    assert store.num_blocks == 8 and pointers(store.caches) == ptrs
    assert_pattern(store, range(8))
    assert abs(torch.cuda.mem_get_info()[0] - free0) < 64 * MiB
    store.close()


def _engine_model() -> str | None:
    return os.environ.get("TIDESERVE_TEST_MODEL") or None


@pytest.mark.cuda
def test_gpu_elastic_pool_reaches_what_a_static_pool_at_0_9_holds(make_llm):
    """The mapped pool grows to at least 95% of the blocks a static --gpu-memory-utilization 0.9 pool gets."""
    model = _engine_model()
    llm = make_llm(model=model, dtype="bfloat16", device="cuda", max_model_len=1024)
    engine = llm.engine
    assert isinstance(engine.executor.driver_worker.kv_storage.device_store, MappedKVStore)
    reachable = engine.pool._reachable_blocks()
    assert engine.pool._resize(reachable, "test")
    elastic_blocks = engine.kv_manager.num_blocks
    engine.executor.driver_worker.kv_storage.device_store.close()  # its memory back now, not at collection
    engine.shutdown()
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    static = make_llm(model=model, dtype="bfloat16", device="cuda", max_model_len=1024, gpu_memory_utilization=0.9)
    static_blocks = static.engine.kv_manager.num_blocks
    print(f"elastic pool reached {elastic_blocks} blocks, static 0.9 pool {static_blocks}")
    assert elastic_blocks >= 0.95 * static_blocks


@pytest.mark.cuda
def test_gpu_graphs_are_not_recaptured_when_the_mapped_pool_resizes(make_llm):
    from tideserve import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "List three colours:", "Once upon a time", "def fibonacci(n):"]
    llm = make_llm(model=_engine_model(), dtype="bfloat16", device="cuda", max_model_len=256,
                   enable_prefix_caching=False)
    engine = llm.engine
    assert isinstance(engine.executor.driver_worker.kv_storage.device_store, MappedKVStore)
    want = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
    graphs = engine.executor.driver_worker.runner.graphs
    captures = graphs.num_captures
    assert captures > 0
    for target in (engine.kv_manager.num_blocks + 5000, 64, engine.kv_manager.num_blocks + 20000):
        assert engine.pool._resize(target, "test")
        assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)] == want
    assert graphs.num_captures == captures and graphs.num_invalidations == 0
