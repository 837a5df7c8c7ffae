"""The KV cache memory features end to end through LLM: prefix caching, swap and recompute
preemption, shrinking with compaction and block-size changes in mid-generation, and the start-up
checks of the memory account, driven by a fake memory probe."""

import logging

import pytest

from tideserve import LLM, SamplingParams
from tideserve.core.kv_cache.elastic import ElasticConfig
from tideserve.worker.model_runner import ModelRunner

GiB = 2**30
SYSTEM = ("You are a meticulous assistant. Answer briefly, cite facts, and never invent sources. " * 6)
QUESTIONS = ["What is the boiling point of water?", "Name a prime number above 50.",
             "Who wrote Hamlet?", "What is the capital of Japan?"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


class FakeProbe:
    """A machine whose free memory the test decides."""

    def __init__(self, available: int, total: int = 64 * GiB) -> None:
        self.available = available
        self.total = total

    def available_bytes(self) -> int:
        return self.available

    def total_bytes(self) -> int:
        return self.total

    def used_by_process_bytes(self) -> int:
        return GiB


def chats(llm):
    return [llm.tokenizer.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            for q in QUESTIONS]


def token_lists(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(dtype="float32", enable_prefix_caching=False, max_model_len=512)
    return token_lists(llm.generate(chats(llm), GREEDY))


def test_prefix_caching_hits_and_outputs_identical(reference):
    llm = LLM(dtype="float32", max_model_len=512)
    prompts = chats(llm)
    first = llm.generate(prompts[:1], GREEDY)  # warms the cache with the shared system prompt
    rest = llm.generate(prompts[1:], GREEDY)
    assert token_lists(first + rest) == reference
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 3 * (len(llm.tokenizer.encode(SYSTEM)) // 16 - 1) * 16
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)
    assert all(o.num_cached_tokens > 0 for o in rest)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_modes_equal_uninterrupted(reference, mode, caplog):
    caplog.set_level(logging.WARNING)
    llm = LLM(dtype="float32", max_model_len=512, block_size=16, num_blocks=32, preemption_mode=mode,
              swap_space=0.05, enable_prefix_caching=False)
    assert token_lists(llm.generate(chats(llm), GREEDY)) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    lines = [r.message for r in caplog.records if "preempted" in r.message]
    assert lines and all("mode=" in line for line in lines)
    if mode == "swap":
        assert any("mode=swap" in line for line in lines)
    assert llm.engine.kv_manager.num_free_blocks == 32
    assert not llm.engine.kv_manager.swapped


def test_swap_pool_full_falls_back_to_recompute(reference, caplog):
    caplog.set_level(logging.WARNING)
    llm = LLM(dtype="float32", max_model_len=512, block_size=16, num_blocks=32, preemption_mode="swap",
              swap_space=1e-6, enable_prefix_caching=False)
    assert token_lists(llm.generate(chats(llm), GREEDY)) == reference
    assert any("recompute (swap pool full)" in r.message for r in caplog.records)


def run_with_midway(llm, prompts, at_step, action):
    """Generate step by step, calling action(engine) once after at_step steps."""
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY, prompt_token_ids=p) for p in prompts]
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == at_step:
            action(engine)
    return [finished[i] for i in ids]


def test_shrink_with_compaction_mid_generation(reference):
    llm = LLM(dtype="float32", max_model_len=512, enable_prefix_caching=False)
    prompts = chats(llm)
    engine = llm.engine
    # Occupy the low block ids with a request we abort later, so live blocks sit high in the pool.
    blocker = engine.add_request(prompts[0] * 2, SamplingParams(max_tokens=200, ignore_eos=True),
                                 prompt_token_ids=prompts[0] * 2)
    engine.step()
    moved = {}

    def shrink(engine):
        engine.abort_request(blocker)
        used = engine.pool.num_used_blocks()
        assert engine.kv_manager.pool.highest_used_id() >= used  # holes below live blocks
        moved["frag"] = engine.pool.fragmentation()[1]
        engine.pool.shrink(used + 1, "test")
        assert engine.kv_manager.num_blocks == used + 1
        engine.kv_manager.check_invariants()

    outs = run_with_midway(llm, prompts, 3, shrink)
    assert moved["frag"] > 0
    assert outs == reference
    assert engine.pool.num_resizes >= 1


@pytest.fixture
def garbage_pool(monkeypatch):
    """Every KV allocation starts as NaN, as ``torch.empty`` may hand it out (resize and relayout too)."""
    original = ModelRunner.allocate_kv_caches

    def poisoned(self, *args, **kwargs):
        caches = original(self, *args, **kwargs)
        self.kv_storage.fill_(float("nan"))
        return caches

    monkeypatch.setattr(ModelRunner, "allocate_kv_caches", poisoned)


@pytest.mark.parametrize("midway", ["none", "block_size_8", "block_size_64", "shrink"])
def test_unwritten_kv_slots_never_reach_attention(reference, garbage_pool, midway):
    """Decode attention reads whole blocks; slots no token wrote must not turn outputs into NaN."""
    llm = LLM(dtype="float32", max_model_len=512, block_size=16, enable_prefix_caching=False)
    engine = llm.engine
    assert engine.runner.kv_storage.isnan().all()

    def action(engine):
        if midway.startswith("block_size"):
            engine.pool.change_block_size(int(midway.rsplit("_", 1)[1]), "test")
        elif midway == "shrink":
            engine.pool.shrink(engine.pool.num_used_blocks() + 1, "test")

    assert run_with_midway(llm, chats(llm), 4, action) == reference


def test_block_size_change_right_after_a_request_finished(reference, garbage_pool):
    """A request finished in the last step is still known to the runner, with old-layout block ids."""
    llm = LLM(dtype="float32", max_model_len=512, block_size=16, enable_prefix_caching=False)
    engine = llm.engine
    prompts = chats(llm)
    ids = [engine.add_request(p, GREEDY, prompt_token_ids=p) for p in prompts]
    long_prompt = prompts[0] * 3
    engine.add_request(long_prompt, SamplingParams(max_tokens=1), prompt_token_ids=long_prompt)
    finished = {}
    for out in engine.step():  # prefills everything; the one-token request ends here
        if out.finished:
            finished[out.request_id] = out
    assert len(finished) == 1
    engine.pool.change_block_size(64, "test")
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert [finished[i].outputs[0].token_ids for i in ids] == reference


@pytest.mark.parametrize("new_block_size", [8, 64])
def test_block_size_change_mid_generation(reference, new_block_size, caplog):
    caplog.set_level(logging.INFO)
    llm = LLM(dtype="float32", max_model_len=512, block_size=16)
    outs = run_with_midway(llm, chats(llm), 4,
                           lambda e: e.pool.change_block_size(new_block_size, "test"))
    assert outs == reference
    assert llm.engine.kv_manager.block_size == new_block_size
    assert any(f"KV block size changed 16 -> {new_block_size}" in r.message for r in caplog.records)


def test_elastic_pool_grows_under_load_and_shrinks_when_idle(reference):
    clock = [0.0]
    config = ElasticConfig(shrink_delay_s=1.0, compaction_delay_s=0.5)
    llm = LLM(dtype="float32", max_model_len=128, elastic=config, enable_prefix_caching=False)
    engine = llm.engine
    engine.pool.clock = lambda: clock[0]
    start = engine.kv_manager.num_blocks
    prompts = [p[-100:] for p in chats(llm)] * 8  # 32 requests of 100 tokens: far beyond the start pool
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    peak = max(engine.pool.kv.num_blocks, start)
    assert engine.pool.num_resizes >= 1 and peak > start
    assert engine.scheduler.num_preemptions == 0  # grown, not preempted
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
    # Idle: usage stays under the low watermark for shrink_delay_s, then the pool shrinks back.
    for t in (1.0, 2.5, 4.0):
        clock[0] = t
        engine.step()
    assert engine.kv_manager.num_blocks < peak
    assert engine.kv_manager.num_blocks >= engine.pool.policy.min_blocks


def test_memory_pressure_shrinks_the_pool_instead_of_crashing():
    probe = FakeProbe(available=8 * GiB)
    llm = LLM(dtype="float32", max_model_len=128, memory_probe=probe)
    engine = llm.engine
    engine.pool._resize(400, "test")  # as if a burst had grown it
    probe.available = engine.pool.account.margin_bytes - 100 * engine.pool.bytes_per_block
    engine.step()
    assert engine.kv_manager.num_blocks <= 300
    out = llm.generate(["Hello there"], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_startup_error_when_one_request_cannot_fit():
    probe = FakeProbe(available=600 * 2**20)
    with pytest.raises(ValueError) as err:
        LLM(dtype="float32", memory_probe=probe)
    message = str(err.value)
    assert "max_model_len=8192" in message and "bytes" in message
    assert "largest max_model_len that fits is" in message


def test_static_pool_lowers_max_num_seqs_with_warning(caplog):
    caplog.set_level(logging.WARNING)
    llm = LLM(dtype="float32", max_model_len=1024, kv_cache_memory="64MiB", max_num_seqs=64)
    assert llm.engine.scheduler_config.max_num_seqs < 64
    assert any("Max num seqs reduced due to KV cache constraints" in r.message for r in caplog.records)


def test_fixed_pool_flags_are_validated():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(dtype="float32", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(dtype="float32", kv_cache_memory="lots")
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(dtype="float32", preemption_mode="drop")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, float16"):
        LLM(dtype="float32", kv_cache_dtype="fp8")


@pytest.mark.parametrize("decode_path", ["native", "torch"])
def test_bfloat16_kv_cache_halves_the_bytes_and_keeps_the_answers(reference, decode_path, monkeypatch):
    """A float32 model over a bfloat16 cache: half the bytes per block, and greedy answers that follow the
    float32 cache's (rounding K/V to bf16 moves logits slightly, so late tokens may differ)."""
    import torch

    import tideserve.worker.model_runner as model_runner

    if decode_path == "torch":
        monkeypatch.setattr(model_runner, "decode_attention_supported", lambda *a: False)
    llm = LLM(dtype="float32", enable_prefix_caching=False, max_model_len=512, kv_cache_dtype="bfloat16")
    runner = llm.engine.runner
    assert runner.kv_storage.dtype == torch.bfloat16 and runner.native_decode == (decode_path == "native")
    arch = llm.engine.arch
    bf16_bytes = 2 * arch.num_hidden_layers * 16 * arch.num_key_value_heads * arch.head_dim * 2
    assert runner.kv_bytes_per_block(16) == bf16_bytes
    got = token_lists(llm.generate(chats(llm), GREEDY))
    for ours, want in zip(got, reference):
        assert ours[:8] == want[:8]
    assert sum(a == b for o, w in zip(got, reference) for a, b in zip(o, w)) >= 0.75 * sum(map(len, reference))
