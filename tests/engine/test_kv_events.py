"""KV cache events from an engine (``kv_events_config``): requests sharing a prefix publish BlockStored
batches in vLLM's format whose token ids are the prompt's blocks; a forced shrink of the elastic pool
publishes the cached prefixes it drops as BlockRemoved; the replay socket resends every batch; a router
replaying the stream holds exactly the engine's cached hashes."""

from __future__ import annotations

import pytest

from tideserve import SamplingParams
from tideserve.bench.launch import free_port
from tideserve.core.kv_cache.events import external_hash

pytest.importorskip("zmq", reason="pyzmq is in the kv-events and test extras")
from tests.kv_events_subscriber import BlockRemoved, BlockStored, Subscriber, kind, replay, replay_view  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
SHARED = ("You are a meticulous assistant for a shipping company. Always answer with the tracking status first, "
          "then the expected delivery date, then any customs notes. Question: ")


def test_an_engine_publishes_stored_and_removed_blocks(make_llm):
    port, replay_port = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
              "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv"}
    llm = make_llm(dtype="float32", max_model_len=256, block_size=16, kv_events_config=config)
    try:
        with Subscriber(f"tcp://127.0.0.1:{port}", topic="kv") as sub:
            sub.poll(0.5)  # let the subscription reach the publisher (ZMQ drops what a PUB sends before)
            prompts = [SHARED + q for q in ("where is parcel A?", "is parcel B late?", "why is C held?")]
            for prompt in prompts:
                llm.generate([prompt], GREEDY, use_tqdm=False)
            sub.wait_for(lambda s: any(isinstance(e, BlockStored) for e in s.events()), 10, "with BlockStored")

            engine = llm.engine
            ids = engine.tokenizer.encode(prompts[0])
            stored = [e for e in sub.events() if isinstance(e, BlockStored)]
            first = stored[0]
            assert first.parent_block_hash is None and first.block_size == 16 and first.medium == "GPU"
            assert first.token_ids == ids[:len(first.block_hashes) * 16]  # the prompt's full blocks, in order
            assert len(first.block_hashes) == len(ids) // 16
            # The later prompts share the prefix: they hit it, so the shared blocks were stored once.
            all_stored = [h for e in stored for h in e.block_hashes]
            assert len(all_stored) == len(set(all_stored))
            assert engine.kv_manager.prefix_stats.hits > 0

            # Force the elastic pool's shrink: the cached prefixes it cannot keep are published as removals.
            cached_before = {external_hash(h) for h in engine.kv_manager.pool.cached}
            engine.pool.shrink(1, "test")
            engine.maintain()  # the engine publishes after maintenance, as the idle server loop does
            sub.wait_for(lambda s: any(isinstance(e, BlockRemoved) for e in s.events()), 10, "with BlockRemoved")
            removed = {h for e in sub.events() if isinstance(e, BlockRemoved) for h in e.block_hashes}
            assert removed and removed <= cached_before
            view = {external_hash(h) for h in engine.kv_manager.pool.cached}
            assert replay_view([b for _, _, b in sub.batches]) == view == cached_before - removed

            # Sequence numbers count from 0 with no gap, and the replay socket resends every batch.
            seqs = [seq for _, seq, _ in sub.batches]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
            replayed = replay(f"tcp://127.0.0.1:{replay_port}", 0)
            assert [seq for seq, _ in replayed] == list(range(len(replayed)))
            assert replay_view([b for _, b in replayed]) == view
            assert {topic for topic, _, _ in sub.batches} == {b"kv"}
    finally:
        llm.engine.close()


def test_events_off_by_default_and_bad_configs_name_the_key(make_llm):
    llm = make_llm(dtype="float32", max_model_len=256, num_blocks=32)
    assert llm.engine.kv_events is None and llm.engine.kv_manager.events is None
    with pytest.raises(ValueError, match=r"kv_events_config has unknown key\(s\) \['endpont'\]; known: "):
        make_llm(dtype="float32", kv_events_config={"enable_kv_cache_events": True, "endpont": "tcp://*:1"})
    with pytest.raises(ValueError, match="kv_events_config.publisher must be one of null, zmq, got 'kafka'"):
        make_llm(dtype="float32", kv_events_config='{"enable_kv_cache_events": true, "publisher": "kafka"}')
    with pytest.raises(ValueError, match="kv_events_config must be a JSON object"):
        make_llm(dtype="float32", kv_events_config="{enable")
    with pytest.raises(ValueError, match=r"kv_events_config.endpoint must be a ZMQ address"):
        make_llm(dtype="float32", kv_events_config={"enable_kv_cache_events": True, "endpoint": "localhost:5"})


def test_the_original_array_layout_for_older_consumers(make_llm):
    port = free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "event_encoding": "array"}
    llm = make_llm(dtype="float32", max_model_len=256, num_blocks=32, block_size=16, kv_events_config=config)
    try:
        with Subscriber(f"tcp://127.0.0.1:{port}", encoding="array") as sub:
            sub.poll(0.5)
            llm.generate([SHARED], GREEDY, use_tqdm=False)
            sub.wait_for(lambda s: s.batches, 10, "at all")
            [event] = sub.events()
            assert kind(event) == "BlockStored" and event.token_ids == llm.engine.tokenizer.encode(SHARED)[:48]
    finally:
        llm.engine.close()
