"""The KV disk tier through the engine (``kv_cache_dir``): a server restarted on the same directory serves
the prompt's prefix from it at once with the tokens of a cold run; corrupted and truncated files change
nothing but are removed; another configuration's blocks are ignored with one log line; salted prefixes
stay apart; the tier stays within its size, least recently used first; an unusable directory turns the
tier off with a warning and no request fails; a slow load does not stall the other requests' steps."""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

import pytest

from tideserve import SamplingParams
from tideserve.core.kv_cache.events import BlockRemoved, BlockStored
from tideserve.core.kv_cache.tiers import tier_block_key, tier_root_key
from tideserve.request import RequestStatus
from tideserve.worker.kv_disk_tier import HEADER_BYTES, DiskTier

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = ("Shipping notes for the warehouse team. Every parcel is weighed, labelled and scanned before it leaves "
          "the dock; parcels over twenty kilograms need two people and a trolley. Customs forms go in the clear "
          "pouch on the side, never inside the box, and fragile goods get the red tape on every face. "
          "Question: where is parcel A?")
OTHER = ("A recipe for bread: flour, water, salt and yeast, mixed, kneaded for ten minutes, left to rise for an "
         "hour, shaped, proofed again and baked in a hot oven until the crust sings when tapped. Let it cool on "
         "a rack before slicing, or the crumb turns gummy and the knife tears it. Question: why cool it?")
SETTINGS = {"dtype": "float32", "max_model_len": 256, "block_size": 16}


def _run(llm, prompt: str, salt: str | None = None):
    """(output token ids, cached prompt tokens) of one greedy request."""
    engine = llm.engine
    request_id = engine.add_request(prompt, GREEDY, cache_salt=salt)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    return list(final.outputs[0].token_ids), final.num_cached_tokens


def _block_files(llm, prompt: str, salt: str | None = None) -> list[Path]:
    """The files of the prompt's full blocks, in prompt order (whether they exist or not)."""
    ids = llm.engine.tokenizer.encode(prompt)
    tier = llm.engine.executor.driver_worker.disk_tier
    parent, out = tier_root_key(16, salt), []
    for i in range(len(ids) // 16):
        parent = tier_block_key(parent, ids[i * 16:(i + 1) * 16])
        out.append(tier.path_of(parent))
    return out


def _gate_reads(monkeypatch) -> threading.Event:
    """Make every disk read wait until the returned event is set (a slow disk, ended by the test)."""
    gate = threading.Event()
    load_into = DiskTier.load_into

    def slow_load_into(self, *args, **kwargs):
        gate.wait(timeout=30)
        return load_into(self, *args, **kwargs)

    monkeypatch.setattr(DiskTier, "load_into", slow_load_into)
    return gate


@pytest.fixture
def cold(make_llm):
    """The tokens of a run without any tier."""
    llm = make_llm(**SETTINGS)
    tokens = {p: _run(llm, p)[0] for p in (PROMPT, OTHER)}
    llm.engine.shutdown()
    return tokens


def test_a_restart_on_the_same_directory_serves_the_prefix_with_the_same_tokens(make_llm, tmp_path, cold):
    first = make_llm(kv_cache_dir=str(tmp_path), **SETTINGS)
    tokens, cached = _run(first, PROMPT)
    assert tokens == cold[PROMPT] and cached == 0
    files = _block_files(first, PROMPT)
    stats = first.engine.kv_disk_tier.snapshot()
    assert stats.blocks_written == len(files) and stats.bytes_written == stats.used_bytes > 0
    first.engine.shutdown()  # every published block is on disk afterwards
    assert all(f.exists() for f in files)

    second = make_llm(kv_cache_dir=str(tmp_path), **SETTINGS)
    tokens, cached = _run(second, PROMPT)
    assert tokens == cold[PROMPT]
    num_hit = (len(second.engine.tokenizer.encode(PROMPT)) - 1) // 16  # the last token is always computed
    assert cached == num_hit * 16 > 0  # every full block, though the pool started empty
    stats = second.engine.kv_disk_tier.snapshot()
    assert stats.hits == num_hit and stats.bytes_read == num_hit * files[0].stat().st_size
    assert stats.loads == 1 and stats.load_seconds > 0 and stats.blocks_written == 0
    second.engine.shutdown()


def test_a_prefix_that_left_the_pool_is_loaded_back_from_disk(make_llm, tmp_path, cold):
    llm = make_llm(kv_cache_dir=str(tmp_path), **SETTINGS)
    _run(llm, PROMPT)
    llm.engine.pool.shrink(1, "test")  # the pool gives its cached prefixes up (one block stays)
    kept = llm.engine.kv_manager.num_cached_blocks()
    tokens, cached = _run(llm, PROMPT)
    num_hit = (len(llm.engine.tokenizer.encode(PROMPT)) - 1) // 16
    assert tokens == cold[PROMPT] and cached == num_hit * 16
    assert llm.engine.kv_disk_tier.snapshot().hits == num_hit - kept
    llm.engine.kv_manager.check_invariants()
    llm.engine.shutdown()


def test_corrupted_and_truncated_files_change_nothing_and_are_removed(make_llm, tmp_path, cold):
    first = make_llm(kv_cache_dir=str(tmp_path), **SETTINGS)
    _run(first, PROMPT)
    files = _block_files(first, PROMPT)
    first.engine.shutdown()
    assert len(files) >= 4
    data = bytearray(files[1].read_bytes())
    data[HEADER_BYTES + len(data) // 2] ^= 0x5A
    files[1].write_bytes(bytes(data))

    second = make_llm(kv_cache_dir=str(tmp_path), **SETTINGS)
    tokens, cached = _run(second, PROMPT)
    assert tokens == cold[PROMPT] and cached == 16  # the first block only: the load stops at the bad one
    assert second.engine.kv_disk_tier.snapshot().bad_files == 1
    second.engine.shutdown()
    assert files[1].exists()  # removed, then written again by the run that recomputed it
    files[3].write_bytes(files[3].read_bytes()[:-100])  # truncated

    third = make_llm(kv_cache_dir=str(tmp_path), **SETTINGS)
    tokens, cached = _run(third, PROMPT)
    assert tokens == cold[PROMPT] and cached == 3 * 16
    assert third.engine.kv_disk_tier.snapshot().bad_files == 1
    third.engine.shutdown()
    assert files[3].stat().st_size == files[0].stat().st_size  # rewritten whole


def test_another_configuration_gets_no_hits_and_one_log_line(make_llm, tmp_path, cold, caplog):
    first = make_llm(kv_cache_dir=str(tmp_path), **SETTINGS)
    _run(first, PROMPT)
    first.engine.shutdown()
    with caplog.at_level(logging.INFO, logger="tideserve.engine.kv_tiers"):
        other_dtype = make_llm(kv_cache_dir=str(tmp_path), kv_cache_dtype="bfloat16",
                               **{k: v for k, v in SETTINGS.items()})
    ignored = [r for r in caplog.records if "other configuration" in r.getMessage()]
    assert len(ignored) == 1
    assert _run(other_dtype, PROMPT)[1] == 0
    other_dtype.engine.shutdown()
    # Another block size keys its blocks apart in the same directory: no hit either.
    other_size = make_llm(kv_cache_dir=str(tmp_path), **{**SETTINGS, "block_size": 32})
    tokens, cached = _run(other_size, PROMPT)
    assert tokens == cold[PROMPT] and cached == 0
    other_size.engine.shutdown()


def test_salted_prefixes_stay_apart(make_llm, tmp_path, cold):
    first = make_llm(kv_cache_dir=str(tmp_path), **SETTINGS)
    assert _run(first, PROMPT, salt="tenant-a")[1] == 0
    first.engine.shutdown()
    second = make_llm(kv_cache_dir=str(tmp_path), **SETTINGS)
    assert _run(second, PROMPT, salt="tenant-b") == (cold[PROMPT], 0)
    assert _run(second, PROMPT)[1] == 0  # nor does an unsalted request see them
    tokens, cached = _run(second, PROMPT, salt="tenant-a")
    assert tokens == cold[PROMPT] and cached > 0
    second.engine.shutdown()


def test_a_full_tier_evicts_least_recently_used_blocks(make_llm, tmp_path, cold):
    probe = make_llm(kv_cache_dir=str(tmp_path / "probe"), **SETTINGS)
    _run(probe, PROMPT)
    block_file = _block_files(probe, PROMPT)[0].stat().st_size
    num_prompt_blocks = len(_block_files(probe, PROMPT))
    probe.engine.shutdown()
    capacity = (num_prompt_blocks + 2) * block_file  # PROMPT fits, PROMPT and OTHER do not
    llm = make_llm(kv_cache_dir=str(tmp_path / "kv"), kv_cache_dir_size=capacity, **SETTINGS)
    _run(llm, PROMPT)
    assert _run(llm, OTHER)[0] == cold[OTHER]
    stats = llm.engine.kv_disk_tier.snapshot()
    assert stats.evictions > 0 and stats.used_bytes <= capacity
    prompt_files, other_files = _block_files(llm, PROMPT), _block_files(llm, OTHER)
    llm.engine.shutdown()
    on_disk = list((tmp_path / "kv").rglob("*.kv"))
    assert len(on_disk) * block_file == stats.used_bytes
    # The oldest blocks (PROMPT's first) went; OTHER's are all there.
    assert not prompt_files[0].exists()
    assert all(f.exists() for f in other_files)


def test_an_unusable_directory_turns_the_tier_off_with_a_warning(make_llm, tmp_path, cold, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="tideserve.engine.kv_tiers"):
        llm = make_llm(kv_cache_dir=str(blocker / "kv"), **SETTINGS)
    assert llm.engine.kv_disk_tier is None and "KV disk tier off" in caplog.text
    assert _run(llm, PROMPT)[0] == cold[PROMPT]
    llm.engine.shutdown()

    caplog.clear()
    llm = make_llm(kv_cache_dir=str(tmp_path / "kv"), **SETTINGS)
    rank_dir = llm.engine.executor.driver_worker.disk_tier.dir
    shutil.rmtree(rank_dir)
    rank_dir.write_text("the disk went away")  # every write from here on fails
    with caplog.at_level(logging.WARNING, logger="tideserve.engine.kv_tiers"):
        assert _run(llm, PROMPT)[0] == cold[PROMPT]
        assert _run(llm, OTHER)[0] == cold[OTHER]
    assert not llm.engine.kv_disk_tier.enabled
    assert len([r for r in caplog.records if "KV disk tier off" in r.getMessage()]) == 1
    llm.engine.shutdown()


def test_a_slow_load_does_not_stall_the_running_requests(make_llm, tmp_path, cold, monkeypatch):
    """While a restarted engine reads a prefix from disk (slowed down here), the request that waits for it
    is WAITING_FOR_REMOTE_KVS and passed over, another running request keeps getting its steps, and both
    produce the tokens of a run without the tier."""
    first = make_llm(kv_cache_dir=str(tmp_path), **SETTINGS)
    _run(first, PROMPT)
    first.engine.shutdown()

    gate = _gate_reads(monkeypatch)
    llm = make_llm(kv_cache_dir=str(tmp_path), **SETTINGS)
    engine = llm.engine
    long_run = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runner_id = engine.add_request(OTHER, long_run)
    engine.step()  # OTHER's prefill: it is running from here on
    waiter_id = engine.add_request(PROMPT, GREEDY)
    waiter, runner = engine.scheduler.requests[waiter_id], engine.scheduler.requests[runner_id]
    runner_tokens_at_start = runner.num_tokens
    runner_tokens_while_loading = 0
    outputs: dict[str, tuple[list[int], int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids), out.num_cached_tokens
        if waiter.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not gate.is_set():
            runner_tokens_while_loading = runner.num_tokens - runner_tokens_at_start
            if runner_tokens_while_loading >= 8:
                gate.set()
        else:
            gate.set()
    assert runner_tokens_while_loading >= 8  # the running request kept stepping while the waiting one loaded
    assert outputs[waiter_id] == (cold[PROMPT], (len(engine.tokenizer.encode(PROMPT)) - 1) // 16 * 16)
    assert outputs[runner_id][0][:4] == cold[OTHER]  # greedy: its first tokens are the short run's
    assert engine.kv_disk_tier.snapshot().loads == 1
    engine.kv_manager.check_invariants()
    engine.shutdown()


def test_a_request_aborted_while_its_blocks_load_leaves_nothing_behind(make_llm, tmp_path, cold, monkeypatch):
    first = make_llm(kv_cache_dir=str(tmp_path), **SETTINGS)
    _run(first, PROMPT)
    first.engine.shutdown()
    gate = _gate_reads(monkeypatch)
    llm = make_llm(kv_cache_dir=str(tmp_path), **SETTINGS)
    engine = llm.engine
    request_id = engine.add_request(PROMPT, GREEDY)
    engine.step()
    assert engine.scheduler.requests[request_id].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    engine.abort_request(request_id)
    gate.set()
    while engine.kv_tiers.loading or engine.has_unfinished_requests():
        engine.step()
    engine.kv_manager.check_invariants()
    assert engine.kv_manager.num_cached_blocks() == 0  # the read was dropped, nothing published
    assert _run(llm, PROMPT) == (cold[PROMPT], (len(engine.tokenizer.encode(PROMPT)) - 1) // 16 * 16)
    engine.shutdown()


def test_the_host_tier_keeps_the_prefixes_an_idle_shrink_gives_up(make_llm, cold):
    llm = make_llm(kv_offloading_size="64MiB", **SETTINGS)
    assert llm.engine.kv_disk_tier is None and llm.engine.kv_host_tier is not None
    _run(llm, PROMPT)
    stats = llm.engine.kv_host_tier.snapshot()
    num_hit = (len(llm.engine.tokenizer.encode(PROMPT)) - 1) // 16
    assert stats.medium == "CPU" and stats.blocks_written >= num_hit and stats.used_bytes == stats.bytes_written
    llm.engine.pool.shrink(1, "test")  # the pool's pages go back, its cached prefixes with them
    kept = llm.engine.kv_manager.num_cached_blocks()
    tokens, cached = _run(llm, PROMPT)
    assert tokens == cold[PROMPT] and cached == num_hit * 16
    stats = llm.engine.kv_host_tier.snapshot()
    assert stats.hits == num_hit - kept and stats.loads == 1 and stats.bytes_read > 0
    llm.engine.kv_manager.check_invariants()
    llm.engine.shutdown()


def test_the_tiers_stack_host_before_disk(make_llm, tmp_path, cold):
    """Both tiers keep every published block; a prefix both hold comes from the host tier, and after a restart
    (host memory empty) from the disk."""
    llm = make_llm(kv_offloading_size="64MiB", kv_cache_dir=str(tmp_path), **SETTINGS)
    _run(llm, PROMPT)
    llm.engine.pool.shrink(1, "test")
    kept = llm.engine.kv_manager.num_cached_blocks()
    num_hit = (len(llm.engine.tokenizer.encode(PROMPT)) - 1) // 16
    assert _run(llm, PROMPT) == (cold[PROMPT], num_hit * 16)
    assert llm.engine.kv_host_tier.snapshot().hits == num_hit - kept
    assert llm.engine.kv_disk_tier.snapshot().hits == 0
    llm.engine.shutdown()

    again = make_llm(kv_offloading_size="64MiB", kv_cache_dir=str(tmp_path), **SETTINGS)
    assert _run(again, PROMPT) == (cold[PROMPT], num_hit * 16)
    assert again.engine.kv_host_tier.snapshot().hits == 0
    assert again.engine.kv_disk_tier.snapshot().hits == num_hit
    assert again.engine.kv_host_tier.snapshot().blocks_written == 0  # it got the blocks from the disk only
    again.engine.shutdown()


def test_a_full_host_tier_evicts_least_recently_used_blocks(make_llm, cold):
    probe = make_llm(kv_offloading_size="64MiB", **SETTINGS)
    _run(probe, PROMPT)
    block_bytes = probe.engine.executor.driver_worker.kv_storage.bytes_per_block()
    probe.engine.shutdown()
    llm = make_llm(kv_offloading_size=f"{3 * block_bytes}B", **SETTINGS)
    _run(llm, PROMPT)
    assert _run(llm, OTHER)[0] == cold[OTHER]
    stats = llm.engine.kv_host_tier.snapshot()
    assert stats.evictions > 0 and stats.used_bytes == 3 * block_bytes
    assert len(llm.engine.executor.driver_worker.host_tier) == 3
    llm.engine.shutdown()


def test_kv_events_name_each_tier_by_its_medium(make_llm, tmp_path):
    """The blocks a tier keeps are BlockStored events with its medium (CPU, DISK), naming the blocks as the
    pool's own events do; a block a tier drops to stay within its size is a BlockRemoved of that medium."""
    probe = make_llm(**SETTINGS)
    block_bytes = probe.engine.executor.driver_worker.kv_storage.bytes_per_block()
    probe.engine.shutdown()
    llm = make_llm(kv_offloading_size=f"{3 * block_bytes}B", kv_cache_dir=str(tmp_path), **SETTINGS)
    llm.engine.kv_manager.enable_events()
    _run(llm, PROMPT)
    events = llm.engine.kv_manager.take_events()
    stored = {m: [h for e in events if isinstance(e, BlockStored) and e.medium == m for h in e.block_hashes]
              for m in ("GPU", "CPU", "DISK")}
    num_blocks = len(_block_files(llm, PROMPT))
    assert len(stored["GPU"]) >= num_blocks and stored["DISK"] == stored["GPU"][:len(stored["DISK"])]
    assert len(stored["DISK"]) == len(stored["CPU"]) >= num_blocks
    removed = [h for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU" for h in e.block_hashes]
    assert removed == stored["CPU"][:len(stored["CPU"]) - 3]  # the host tier keeps the 3 newest
    assert not [e for e in events if isinstance(e, BlockRemoved) and e.medium == "DISK"]
    llm.engine.shutdown()
