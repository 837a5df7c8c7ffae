"""The KV cache memory features end to end through LLM: prefix caching, swap and recompute
preemption, shrinking with compaction and block-size changes in mid-generation, and the start-up
checks of the memory account, driven by a fake memory probe."""

import logging

import pytest

from tideserve import SamplingParams
from tideserve.core.kv_cache.elastic import ElasticConfig

pytestmark = pytest.mark.slow  # the model end to end for seconds: `make test` runs it, `-m 'not slow'` does not

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
def reference(make_llm):
    llm = make_llm(dtype="float32", enable_prefix_caching=False, max_model_len=512)
    return token_lists(llm.generate(chats(llm), GREEDY))


def test_prefix_caching_hits_and_outputs_identical(make_llm, reference):
    llm = make_llm(dtype="float32", max_model_len=512)
    prompts = chats(llm)
    first = llm.generate(prompts[:1], GREEDY)  # warms the cache with the shared system prompt
    rest = llm.generate(prompts[1:], GREEDY)
    assert token_lists(first + rest) == reference
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 3 * (len(llm.tokenizer.encode(SYSTEM)) // 16 - 1) * 16
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)
    assert all(o.num_cached_tokens > 0 for o in rest)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_modes_equal_uninterrupted(make_llm, reference, mode, caplog):
    caplog.set_level(logging.WARNING)
    llm = make_llm(dtype="float32", max_model_len=512, block_size=16, num_blocks=32, preemption_mode=mode,
              swap_space=0.05, enable_prefix_caching=False)
    assert token_lists(llm.generate(chats(llm), GREEDY)) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    lines = [r.message for r in caplog.records if "preempted" in r.message]
    assert lines and all("mode=" in line for line in lines)
    if mode == "swap":
        assert any("mode=swap" in line for line in lines)
    assert llm.engine.kv_manager.num_free_blocks == 32
    assert not llm.engine.kv_manager.swapped


SEEDED = [SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, max_tokens=8, ignore_eos=True)
          for i in range(len(QUESTIONS))]


def test_seeded_sampling_is_unchanged_by_preemption(make_llm):
    """A seeded request recomputed after preemption (here after its third token) draws on from where its
    generator stopped (the runner keeps it across preemption), so its tokens are those of an
    uninterrupted run."""
    roomy = make_llm(dtype="float32", enable_prefix_caching=False, max_model_len=512)
    want = token_lists(roomy.generate(chats(roomy), SEEDED))
    llm = make_llm(dtype="float32", max_model_len=512, block_size=16, num_blocks=32, enable_prefix_caching=False)
    assert token_lists(llm.generate(chats(llm), SEEDED)) == want
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.step()  # the runner hears of the last finished requests on the next step, even an empty one
    assert (not llm.engine.executor.driver_worker.runner.generators
            and not llm.engine.executor.driver_worker.runner.requests)


def test_swap_pool_full_falls_back_to_recompute(make_llm, reference, caplog):
    caplog.set_level(logging.WARNING)
    llm = make_llm(dtype="float32", max_model_len=512, block_size=16, num_blocks=32, preemption_mode="swap",
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


def test_shrink_with_compaction_mid_generation(make_llm, reference):
    llm = make_llm(dtype="float32", max_model_len=512, enable_prefix_caching=False)
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


@pytest.fixture(params=["reserved", "copy"])
def garbage_pool(request, monkeypatch):
    """Every block a store hands out fresh starts as NaN, as ``torch.empty`` may hand it out (the copying
    store used on GPUs), and as nothing forbids for committed pages. Both stores, so the copying one
    (the CUDA path) runs here too."""
    from tideserve.worker import kv_store

    def poison_new_blocks(store, cls):
        original = cls.resize

        def resize(num_blocks):
            before = store.num_blocks
            original(store, num_blocks)
            for k, v in store.caches:
                k[before:].fill_(float("nan"))
                v[before:].fill_(float("nan"))

        store.resize = resize

    def create(layout, device, block_size, num_blocks, reserve_bytes, static):
        if request.param == "copy":
            store = kv_store.CopyKVStore(layout, device, block_size, num_blocks)
            cls = kv_store.CopyKVStore
        else:
            store = kv_store.ReservedKVStore(layout, block_size, num_blocks, reserve_bytes)
            cls = kv_store.ReservedKVStore
        for k, v in store.caches:
            k.fill_(float("nan"))
            v.fill_(float("nan"))
        poison_new_blocks(store, cls)
        return store

    monkeypatch.setattr(kv_store, "create_kv_store", create)
    return request.param


@pytest.mark.parametrize("midway", ["none", "shrink", "grow"])
def test_unwritten_kv_slots_never_reach_attention(make_llm, reference, garbage_pool, midway):
    """Decode attention reads whole blocks; slots no token wrote must not turn outputs into NaN."""
    llm = make_llm(dtype="float32", max_model_len=512, block_size=16, enable_prefix_caching=False)
    engine = llm.engine
    assert engine.executor.driver_worker.runner.kv_caches[0][0].isnan().all()

    def action(engine):
        if midway == "shrink":
            engine.pool.shrink(engine.pool.num_used_blocks() + 1, "test")
        elif midway == "grow":
            assert engine.pool._resize(engine.kv_manager.num_blocks + 40, "test")

    assert run_with_midway(llm, chats(llm), 4, action) == reference


def test_block_size_changes_only_while_nothing_holds_kv(make_llm, reference, garbage_pool, caplog):
    """A block-size change re-chunks every token, so it waits for an idle moment; then it copies nothing
    (the same pages are read in other chunks) and the answers stay those of a fixed block size."""
    caplog.set_level(logging.INFO)
    llm = make_llm(dtype="float32", max_model_len=512, block_size=16, enable_prefix_caching=False)
    engine = llm.engine
    prompts = chats(llm)
    ptr = engine.executor.driver_worker.runner.kv_caches[0][0].data_ptr()
    refused = {}
    outs = run_with_midway(llm, prompts[:2], 3,
                           lambda e: refused.setdefault("ok", e.pool.change_block_size(64, "test")))
    assert refused["ok"] is False and engine.kv_manager.block_size == 16
    assert outs == reference[:2]
    for new_block_size in (64, 8):
        assert engine.pool.change_block_size(new_block_size, "test")  # idle now: the request just finished
        assert engine.kv_manager.block_size == engine.executor.driver_worker.runner.block_size == new_block_size
        assert engine.kv_manager.num_blocks == engine.executor.driver_worker.kv_storage.num_blocks
        assert token_lists(llm.generate(prompts, GREEDY)) == reference
    assert any("KV block size changed 16 -> 64 (no request held KV: nothing copied)" in r.message
               for r in caplog.records)
    if garbage_pool == "reserved":
        # the same memory, read in other chunks
        assert engine.executor.driver_worker.runner.kv_caches[0][0].data_ptr() == ptr


def test_elastic_pool_grows_under_load_and_shrinks_when_idle(make_llm, reference):
    clock = [0.0]
    config = ElasticConfig(shrink_delay_s=1.0, compaction_delay_s=0.5)
    llm = make_llm(dtype="float32", max_model_len=128, elastic=config, enable_prefix_caching=False)
    engine = llm.engine
    engine.pool.clock = lambda: clock[0]
    start = engine.kv_manager.num_blocks
    prompts = [p[-100:] for p in chats(llm)] * 8  # 32 requests of 100 tokens: far beyond the start pool
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    peak = max(engine.pool.kv.num_blocks, start)
    assert engine.pool.num_resizes >= 1 and peak > start
    assert engine.scheduler.num_preemptions == 0  # grown, not preempted
    # Never past what the 32 requests could hold at 100 + 20 tokens each (16-token blocks): 8 blocks each.
    assert engine.kv_manager.block_size == 16 and peak <= 32 * 8, peak
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
    # Idle: usage stays under the low watermark for shrink_delay_s, then the pool shrinks to its floor.
    for t in (1.0, 2.5, 4.0):
        clock[0] = t
        engine.maintain()
    assert engine.kv_manager.num_blocks == engine.pool.min_blocks < peak


def test_memory_pressure_shrinks_the_pool_instead_of_crashing(make_llm):
    probe = FakeProbe(available=8 * GiB)
    llm = make_llm(dtype="float32", max_model_len=128, memory_probe=probe)
    engine = llm.engine
    engine.pool._resize(400, "test")  # as if a burst had grown it
    probe.available = engine.pool.account.margin_bytes - 100 * engine.pool.bytes_per_block
    engine.step()
    assert engine.kv_manager.num_blocks <= 300
    out = llm.generate(["Hello there"], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_startup_error_when_one_request_cannot_fit(make_llm):
    probe = FakeProbe(available=600 * 2**20)
    with pytest.raises(ValueError) as err:
        make_llm(dtype="float32", memory_probe=probe)
    message = str(err.value)
    assert "max_model_len=8192" in message and "bytes" in message
    assert "largest max_model_len that fits is" in message


def test_static_pool_lowers_max_num_seqs_with_warning(make_llm, caplog):
    caplog.set_level(logging.WARNING)
    llm = make_llm(dtype="float32", max_model_len=1024, kv_cache_memory="64MiB", max_num_seqs=64)
    assert llm.engine.scheduler_config.max_num_seqs < 64
    assert any("Max num seqs reduced due to KV cache constraints" in r.message for r in caplog.records)


def test_fixed_pool_flags_are_validated(make_llm):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        make_llm(dtype="float32", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        make_llm(dtype="float32", kv_cache_memory="lots")
    with pytest.raises(ValueError, match="preemption_mode"):
        make_llm(dtype="float32", preemption_mode="drop")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, float16, fp8, "
                                         "fp8_e4m3, got 'fp8_e5m2'"):
        make_llm(dtype="float32", kv_cache_dtype="fp8_e5m2")


@pytest.mark.parametrize("decode_path", ["native", "torch"])
def test_bfloat16_kv_cache_halves_the_bytes_and_keeps_the_answers(make_llm, reference, decode_path, monkeypatch):
    """A float32 model over a bfloat16 cache: half the bytes per block, and greedy answers that follow the
    float32 cache's (rounding K/V to bf16 moves logits slightly, so late tokens may differ)."""
    import torch

    llm = make_llm(dtype="float32", enable_prefix_caching=False, max_model_len=512, kv_cache_dtype="bfloat16",
                   attention_backend="cpu-native" if decode_path == "native" else "torch")
    runner = llm.engine.executor.driver_worker.runner
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    assert runner.attn_backend.name == ("cpu-native" if decode_path == "native" else "torch")
    arch = llm.engine.arch
    bf16_bytes = 2 * arch.num_hidden_layers * 16 * arch.num_key_value_heads * arch.head_dim * 2
    assert llm.engine.executor.driver_worker.kv_storage.bytes_per_block(16) == bf16_bytes
    got = token_lists(llm.generate(chats(llm), GREEDY))
    for ours, want in zip(got, reference):
        assert ours[:8] == want[:8]
    assert sum(a == b for o, w in zip(got, reference) for a, b in zip(o, w)) >= 0.75 * sum(map(len, reference))


@pytest.mark.parametrize("decode_path", ["native", "torch"])
def test_fp8_kv_cache_quarters_the_bytes_and_both_paths_agree(make_llm, reference, decode_path):
    """A float32 model over an e4m3 cache (--kv-cache-dtype fp8): a quarter of float32's bytes per block;
    the native kernel and the torch path read the same rounded values, so their greedy answers agree with
    each other up to a near tie (where the CPU has AVX-512 BF16 the native kernel takes its dot products in
    bf16: a logit moves by a few hundredths), and they follow the float32 cache's answers for the first
    tokens."""
    import torch

    kwargs = dict(dtype="float32", enable_prefix_caching=False, max_model_len=512, kv_cache_dtype="fp8")
    llm = make_llm(**kwargs, attention_backend="cpu-native" if decode_path == "native" else "torch")
    runner = llm.engine.executor.driver_worker.runner
    assert runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert runner.attn_backend.name == ("cpu-native" if decode_path == "native" else "torch")
    arch = llm.engine.arch
    fp8_bytes = 2 * arch.num_hidden_layers * 16 * arch.num_key_value_heads * arch.head_dim
    assert llm.engine.executor.driver_worker.kv_storage.bytes_per_block(16) == fp8_bytes
    got = token_lists(llm.generate(chats(llm), GREEDY))
    for ours, want in zip(got, reference):
        assert ours[:4] == want[:4]
    assert sum(a == b for o, w in zip(got, reference) for a, b in zip(o, w)) >= 0.5 * sum(map(len, reference))
    if decode_path == "torch":
        native_llm = make_llm(**kwargs, attention_backend="cpu-native")
        with_logprobs = SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens, ignore_eos=True, logprobs=2)
        torch_answers = llm.generate(chats(llm), with_logprobs)
        assert token_lists(torch_answers) == got
        native_answers = native_llm.generate(chats(native_llm), with_logprobs)
        assert_greedy_agrees_up_to_near_ties(native_answers, torch_answers, max_gap=0.05)
        assert sum(a == b for a, b in zip(token_lists(native_answers), got)) >= len(got) - 1


def assert_greedy_agrees_up_to_near_ties(got, want, max_gap: float) -> None:
    """Each answer equals the reference until the first token where they part, and they may part only
    where the reference's top two candidates are within ``max_gap`` nats and are the two tokens chosen.
    A float8 cache rounds K/V, so a batch of another size (the matmuls block rows differently) can move
    a logit by a few thousandths and flip a near tie; anything larger is a real difference."""
    for ours, theirs in zip(got, want):
        ours_ids, want_ids = ours.outputs[0].token_ids, theirs.outputs[0].token_ids
        assert len(ours_ids) == len(want_ids)
        for n, (a, b) in enumerate(zip(ours_ids, want_ids)):
            if a == b:
                continue
            top = sorted(theirs.outputs[0].logprobs[n].items(), key=lambda kv: -kv[1].logprob)
            assert {a, b} == {top[0][0], top[1][0]}, f"token {n}: {a} against {b} is not in the top two ({top})"
            gap = top[0][1].logprob - top[1][1].logprob
            assert gap < max_gap, f"token {n}: {a} against {b} parts at a gap of {gap:.4f} nats"
            break


def test_fp8_cache_swaps_out_and_back_by_its_bytes(make_llm):
    """Preempted requests over an fp8 cache swap out and back (torch's CPU index ops have no float8
    kernels, so the swap tier moves bytes): their tokens follow a run whose pool never preempts, parting
    at most at a near tie, and every token is computed once."""
    kwargs = dict(dtype="float32", max_model_len=512, block_size=16, kv_cache_dtype="fp8",
                  enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    small = make_llm(**kwargs, num_blocks=32, preemption_mode="swap", swap_space=0.05)
    counted = count_computed_tokens(small.engine)
    prompts = chats(small)
    got = small.generate(prompts, params)
    assert small.engine.scheduler.num_swap_ins > 0
    assert small.engine.scheduler.num_swap_ins == small.engine.scheduler.num_preemptions
    assert counted[0] == sum(len(p) for p in prompts) + len(prompts) * (params.max_tokens - 1)
    roomy = make_llm(**kwargs, num_blocks=256)
    want = roomy.generate(prompts, params)
    assert roomy.engine.scheduler.num_preemptions == 0
    assert_greedy_agrees_up_to_near_ties(got, want, max_gap=0.05)
    assert sum(token_lists(got)[i] == token_lists(want)[i] for i in range(len(prompts))) >= len(prompts) - 1


def count_computed_tokens(engine) -> list[int]:
    """Wrap the runner so every token a forward pass computes is counted."""
    counted = [0]
    execute = engine.executor.driver_worker.runner.execute

    def counting(out):
        counted[0] += out.total_num_scheduled_tokens
        return execute(out)

    engine.executor.driver_worker.runner.execute = counting
    return counted


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_swap_resumes_without_recomputing(make_llm, reference, mode):
    """Swap mode copies a preempted request's KV back: the forward passes compute each token once. The
    same run in recompute mode computes more, so this fails if resume falls back to recomputing."""
    llm = make_llm(dtype="float32", max_model_len=512, block_size=16, num_blocks=32, preemption_mode=mode,
              swap_space=0.05, enable_prefix_caching=False)
    engine = llm.engine
    counted = count_computed_tokens(engine)
    prompts = chats(llm)
    assert token_lists(llm.generate(prompts, GREEDY)) == reference
    once = sum(len(p) for p in prompts) + len(prompts) * (GREEDY.max_tokens - 1)
    assert engine.scheduler.num_preemptions > 0
    if mode == "swap":
        assert engine.scheduler.num_swap_ins == engine.scheduler.num_preemptions
        assert counted[0] == once
        swap = engine.kv_manager.swap
        assert swap.num_free == swap.num_blocks and not engine.kv_manager.swapped  # nothing leaked
    else:
        assert counted[0] > once


def test_failed_growth_backs_off_and_the_engine_keeps_serving(make_llm, reference, monkeypatch, caplog):
    """Out of memory while growing (a GPU near full) is logged and the engine preempts instead of dying."""
    from tideserve.worker.kv_store import KVStoreGrowError

    caplog.set_level(logging.WARNING)
    llm = make_llm(dtype="float32", max_model_len=512, enable_prefix_caching=False)
    engine = llm.engine
    store = engine.executor.driver_worker.kv_storage.device_store
    floor = engine.kv_manager.num_blocks
    real_resize = store.resize

    def failing_resize(num_blocks):
        if num_blocks > 3 * floor:
            raise KVStoreGrowError("CUDA out of memory (simulated)")
        real_resize(num_blocks)

    monkeypatch.setattr(store, "resize", failing_resize)
    prompts = chats(llm) * 4
    outs = llm.generate(prompts, GREEDY)
    assert token_lists(outs) == reference * 4
    assert engine.pool.num_grow_failures >= 1
    assert engine.kv_manager.num_blocks <= 3 * floor and engine.kv_manager.num_blocks == store.num_blocks
    assert any("KV pool growth" in r.message and "failed" in r.message for r in caplog.records)
    engine.kv_manager.check_invariants()


def test_failed_shrink_changes_nothing(make_llm, reference, monkeypatch):
    """The copying store needs a new (smaller) tensor to shrink; if even that fails the pool stays whole."""
    from tideserve.worker.kv_store import KVStoreGrowError

    llm = make_llm(dtype="float32", max_model_len=512, enable_prefix_caching=False)
    engine = llm.engine
    assert engine.pool._resize(200, "test")

    def failing_resize(num_blocks):
        raise KVStoreGrowError("CUDA out of memory (simulated)")

    monkeypatch.setattr(engine.executor.driver_worker.kv_storage.device_store, "resize", failing_resize)
    engine.pool.shrink(50, "test")
    assert engine.kv_manager.num_blocks == engine.executor.driver_worker.kv_storage.num_blocks == 200
    engine.kv_manager.check_invariants()
    monkeypatch.undo()
    assert token_lists(llm.generate(chats(llm), GREEDY)) == reference


def test_idle_pool_keeps_the_shared_prefix_and_little_else(make_llm):
    """After a burst whose requests share a system prompt, the idle pool holds the prefixes that were
    hit plus the floor, and the next request still finds the system prompt cached."""
    clock = [0.0]
    config = ElasticConfig(shrink_delay_s=1.0, idle_unhit_cache_bytes=0)
    llm = make_llm(dtype="float32", max_model_len=512, block_size=16, elastic=config)
    engine = llm.engine
    engine.pool.clock = lambda: clock[0]
    prompts = chats(llm) * 6
    llm.generate(prompts, GREEDY)
    peak = engine.kv_manager.num_blocks
    for t in (1.0, 2.5, 4.0):
        clock[0] = t
        engine.maintain()
    pool = engine.kv_manager.pool
    hit_blocks = sum(1 for i in pool.cached_free_by_value() if pool.blocks[i].num_hits > 0)
    system_blocks = len(llm.tokenizer.encode_chat([{"role": "system", "content": SYSTEM}])) // 16 - 1
    assert hit_blocks >= system_blocks
    # Unhit prefixes were given back, but for those the floor's reserve holds anyway (free blocks).
    assert hit_blocks <= pool.num_cached_free() <= hit_blocks + engine.pool.min_blocks
    assert engine.kv_manager.num_blocks <= 1.1 * hit_blocks + engine.pool.min_blocks < peak
    out = llm.generate([chats(llm)[2]], GREEDY)[0]
    assert out.num_cached_tokens >= system_blocks * 16


def test_block_size_stays_while_hit_prefixes_are_cached(make_llm):
    """A block-size change empties the prefix cache; a shared prefix that was hit outweighs the gain."""
    clock = [0.0]
    llm = make_llm(dtype="float32", max_model_len=512, elastic=ElasticConfig(shrink_delay_s=1.0))
    engine = llm.engine
    engine.pool.clock = lambda: clock[0]
    llm.generate(chats(llm) * 2, GREEDY)  # the system prompt's blocks are hit
    for _ in range(64):
        engine.pool.advisor.observe(1000)  # the advisor now wants large blocks
    assert engine.pool.advisor.best(16) is not None
    for t in (10.0, 20.0, 30.0):
        clock[0] = t
        engine.maintain()
    assert engine.kv_manager.block_size == 16 and engine.pool._num_hit_cached_blocks() > 0
    engine.kv_manager.reset_prefix_cache()
    clock[0] = 40.0
    engine.maintain()
    assert engine.kv_manager.block_size > 16


def test_ceiling_follows_the_machine_at_runtime(make_llm):
    """The budget is re-read: memory a neighbour frees later is used, memory it takes is left alone."""
    clock = [0.0]
    probe = FakeProbe(available=2 * GiB)
    llm = make_llm(dtype="float32", max_model_len=512, memory_probe=probe)
    engine = llm.engine
    engine.pool.clock = lambda: clock[0]
    start_budget = engine.pool.budget_bytes
    probe.available = 6 * GiB  # the neighbour finished
    clock[0] = 10.0
    engine.maintain()
    assert engine.pool.budget_bytes > start_budget + 3 * GiB
    probe.available = engine.pool.account.margin_bytes + engine.pool.account.activation_bytes
    clock[0] = 20.0
    engine.maintain()
    assert engine.pool.budget_bytes < engine.pool.pool_bytes + 2 * engine.pool.bytes_per_block
    assert engine.pool.grow_for_allocation(1) is False  # nothing left to take


def test_chunked_prefill_off_needs_a_step_that_holds_max_model_len(make_llm):
    with pytest.raises(ValueError) as err:
        make_llm(dtype="float32", max_model_len=512, enable_chunked_prefill=False, max_num_batched_tokens=256)
    assert "max_num_batched_tokens (256) is smaller than max_model_len (512)" in str(err.value)
    llm = make_llm(dtype="float32", max_model_len=1024, enable_chunked_prefill=False)
    assert llm.engine.scheduler_config.max_num_batched_tokens == 2048
    long_prompt = chats(llm)[0] * 5  # about 600 tokens: one step, as a whole
    out = llm.generate([long_prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("flag", [{"kv_cache_memory": "16GiB"}, {"num_blocks": 10**6},
                                  {"gpu_memory_utilization": 1.0}])
def test_static_sizes_beyond_the_machine_fail_with_the_numbers(make_llm, flag):
    probe = FakeProbe(available=3 * GiB, total=4 * GiB)
    with pytest.raises(ValueError) as err:
        make_llm(dtype="float32", max_model_len=512, memory_probe=probe, **flag)
    message = str(err.value)
    name = next(iter(flag))
    assert message.startswith(f"{name}=") and "GiB available after the weights" in message
    assert "leave it unset for the elastic pool" in message


def test_watermark_growth_commits_its_pages_ahead_and_the_answers_stay(make_llm, reference, monkeypatch, caplog):
    """With every growth large enough to commit ahead, the pool still grows (a step or more later, once
    its pages are in) and greedy answers are those of the reference."""
    from tideserve.engine import pool_controller
    from tideserve.worker import worker
    from tideserve.worker.kv_store import ReservedKVStore

    caplog.set_level(logging.INFO)
    monkeypatch.setattr(pool_controller, "COMMIT_AHEAD_MIN_BYTES", 0)
    monkeypatch.setattr(worker, "host_core_free", lambda: True)
    ranges = []
    real = ReservedKVStore._commit_range
    monkeypatch.setattr(ReservedKVStore, "_commit_range",
                        lambda self, start, end, on_done=None: (ranges.append(end - start),
                                                                 real(self, start, end, on_done)))
    llm = make_llm(dtype="float32", enable_prefix_caching=False, max_model_len=512)
    assert isinstance(llm.engine.executor.driver_worker.kv_storage.device_store, ReservedKVStore)
    outs = llm.generate(chats(llm) * 4, GREEDY)
    assert token_lists(outs) == reference * 4
    assert ranges and all(r > 0 for r in ranges)  # background commits ran
    # the pool grew onto pages committed ahead (at the watermark, or for an allocation when the burst's
    # commit was in first: which one depends on how fast the commit thread ran)
    assert any("committed in the background" in r.message for r in caplog.records)
    assert llm.engine.pool.num_background_commits >= 1


def test_with_every_core_in_the_step_a_background_commit_is_lent_one(make_llm, reference, monkeypatch, caplog):
    """With every core in the step's threads, a watermark growth's pages are committed on a thread that
    the kernels lend a core to (they run one thread fewer while it runs, and get it back after); the
    pool grows onto those pages without committing on the engine's thread, and the answers are the
    reference's. A single core commits on the engine's thread instead."""
    from tideserve.engine import pool_controller
    from tideserve.native import cores
    from tideserve.worker import worker
    from tideserve.worker.kv_store import ReservedKVStore

    caplog.set_level(logging.INFO)
    monkeypatch.setattr(pool_controller, "COMMIT_AHEAD_MIN_BYTES", 0)
    monkeypatch.setattr(worker, "host_core_free", lambda: False)
    monkeypatch.setattr(worker, "intra_op_threads", lambda: 2)
    lent_while_committing = []
    real = ReservedKVStore._commit_range

    def commit_range(self, start, end, on_done=None):
        lent_while_committing.append(cores.lent_cores())
        real(self, start, end, on_done)

    monkeypatch.setattr(ReservedKVStore, "_commit_range", commit_range)
    llm = make_llm(dtype="float32", enable_prefix_caching=False, max_model_len=512)
    assert isinstance(llm.engine.executor.driver_worker.kv_storage.device_store, ReservedKVStore)
    outs = llm.generate(chats(llm) * 4, GREEDY)
    assert token_lists(outs) == reference * 4
    assert lent_while_committing and all(n == 1 for n in lent_while_committing)
    assert cores.lent_cores() == 0  # every core came back
    assert any("committed in the background" in r.message for r in caplog.records)
    assert llm.engine.pool.num_background_commits >= 1

    lent_while_committing.clear()
    monkeypatch.setattr(worker, "intra_op_threads", lambda: 1)
    llm = make_llm(dtype="float32", enable_prefix_caching=False, max_model_len=512)
    outs = llm.generate(chats(llm) * 4, GREEDY)
    assert token_lists(outs) == reference * 4
    assert not lent_while_committing  # one core: no background commit
    assert any("above the high watermark" in r.message for r in caplog.records)


def test_admission_takes_pages_committed_ahead_and_does_not_wait_for_the_rest(make_llm, monkeypatch):
    """A waiting request short of blocks while others run grows the pool onto the pages a background
    commit has made resident, all of them; while that commit is still short of the need it declines
    (the newcomer waits a step) where an allocation for a running request would wait for the pages."""
    from tideserve.worker.kv_store import KVCacheStorage

    llm = make_llm(dtype="float32", enable_prefix_caching=False, max_model_len=512)
    pool = llm.engine.pool
    n = pool.kv.num_blocks
    ahead = {"blocks": n, "in_flight": True}
    monkeypatch.setattr(KVCacheStorage, "committed_ahead_blocks", property(lambda self: ahead["blocks"]))
    monkeypatch.setattr(KVCacheStorage, "commit_in_flight", property(lambda self: ahead["in_flight"]))
    resized = []
    real_resize = KVCacheStorage.resize
    monkeypatch.setattr(KVCacheStorage, "resize", lambda self, b: (resized.append(b), real_resize(self, b)))
    assert pool.grow_to_admit(4) is False and not resized  # nothing committed ahead yet: the newcomer waits
    ahead["blocks"] = n + 10
    assert pool.grow_to_admit(4) is True and resized == [n + 10]  # all of what is resident
    assert pool.kv.num_blocks == n + 10
    short = pool.kv.num_blocks + 4  # more than the pool holds: a running request grows it now
    assert pool.grow_to_admit(short) is False
    assert pool.grow_for_allocation(short) is True and resized[-1] > n + 10


def test_pages_committed_ahead_stay_reachable_when_the_machine_has_nothing_more(make_llm, monkeypatch):
    """Pages a background commit made resident are already out of the machine's free memory: with no
    free memory left beyond the margin and the activation peak, the pool still grows onto them (they
    are the base the free memory adds to, not a second charge against it)."""
    from tideserve.worker.kv_store import KVCacheStorage

    clock = [0.0]
    probe = FakeProbe(available=4 * GiB)
    llm = make_llm(dtype="float32", enable_prefix_caching=False, max_model_len=512, memory_probe=probe)
    engine, pool = llm.engine, llm.engine.pool
    pool.clock = lambda: clock[0]
    n = pool.kv.num_blocks
    monkeypatch.setattr(KVCacheStorage, "committed_ahead_blocks", property(lambda self: n + 40))
    monkeypatch.setattr(KVCacheStorage, "commit_in_flight", property(lambda self: False))
    probe.available = pool.account.margin_bytes + pool.account.activation_bytes  # nothing spare
    clock[0] = 10.0
    engine.maintain()  # the ceiling follows the machine
    assert pool.max_blocks >= n + 40
    assert pool.grow_for_allocation(4) is True and pool.kv.num_blocks == n + 40


def test_an_allocation_inside_a_commit_under_way_grows_by_what_it_needs(make_llm, monkeypatch):
    """While a background commit is under way towards enough blocks, an allocation short of blocks grows
    the pool by what it lacks (or onto what is resident already, if more), so the store waits for those
    pages only; past the commit's goal it grows as the policy says."""
    from tideserve.worker.kv_store import KVCacheStorage

    llm = make_llm(dtype="float32", enable_prefix_caching=False, max_model_len=512)
    pool = llm.engine.pool
    n = pool.kv.num_blocks
    ahead = {"resident": n, "goal": n + 40, "in_flight": True}
    monkeypatch.setattr(KVCacheStorage, "committed_ahead_blocks", property(lambda self: ahead["resident"]))
    monkeypatch.setattr(KVCacheStorage, "commit_goal_blocks", property(lambda self: ahead["goal"]))
    monkeypatch.setattr(KVCacheStorage, "commit_in_flight", property(lambda self: ahead["in_flight"]))
    monkeypatch.setattr(pool.policy, "grow_target", lambda geometry, *args: geometry.num_blocks + 100)  # the policy's
    resized = []
    real_resize = KVCacheStorage.resize
    monkeypatch.setattr(KVCacheStorage, "resize", lambda self, b: (resized.append(b), real_resize(self, b)))
    assert pool.grow_for_allocation(3) is True and resized == [n + 3]
    ahead["resident"] = n + 10
    assert pool.grow_for_allocation(20) is True and resized[-1] == n + 3 + 20  # past what is resident
    ahead["goal"] = pool.kv.num_blocks  # the commit's goal is reached: the policy's growth
    assert pool.grow_for_allocation(2) is True and resized[-1] == n + 3 + 20 + 100


def test_a_bursts_first_allocation_commits_what_the_requests_hold_in_the_background(make_llm, reference,
                                                                                      monkeypatch):
    """With requests waiting that will hold many blocks, the first allocation short of blocks starts a
    background commit towards what they hold (lent a core), and grows the pool only by what it lacks now;
    the burst's answers are the reference's, and every core comes back."""
    from tideserve.engine import pool_controller
    from tideserve.native import cores
    from tideserve.worker import worker
    from tideserve.worker.kv_store import KVCacheStorage, ReservedKVStore

    monkeypatch.setattr(pool_controller, "COMMIT_AHEAD_MIN_BYTES", 0)
    monkeypatch.setattr(worker, "host_core_free", lambda: False)
    monkeypatch.setattr(worker, "intra_op_threads", lambda: 2)
    goals, lent = [], []
    real_commit_ahead = KVCacheStorage.commit_ahead

    def commit_ahead(self, num_blocks, on_done=None):
        goals.append(num_blocks)
        lent.append(cores.lent_cores())
        return real_commit_ahead(self, num_blocks, on_done)

    monkeypatch.setattr(KVCacheStorage, "commit_ahead", commit_ahead)
    llm = make_llm(dtype="float32", enable_prefix_caching=False, max_model_len=512)
    assert isinstance(llm.engine.executor.driver_worker.kv_storage.device_store, ReservedKVStore)
    pool = llm.engine.pool
    n = pool.kv.num_blocks
    for ids in chats(llm) * 4:
        llm.engine.add_request(ids, GREEDY, prompt_token_ids=ids)
    known = pool.known_blocks()
    assert known > n + 1
    resized = []
    real_resize = KVCacheStorage.resize
    monkeypatch.setattr(KVCacheStorage, "resize", lambda self, b: (resized.append(b), real_resize(self, b)))
    assert pool.grow_for_allocation(1) is True
    assert goals and goals[0] >= known and lent[0] == 1  # on to what the requests hold, a core lent
    assert resized[0] < goals[0]  # this growth did not wait for the whole commit
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += [o for o in llm.engine.step() if o.finished]
    assert sorted(token_lists(outs)) == sorted(reference * 4)
    llm.engine.executor.driver_worker.kv_storage.device_store._join_ahead()
    assert cores.lent_cores() == 0


def test_a_core_is_free_only_when_the_step_leaves_one(monkeypatch):
    import torch

    from tideserve.worker import worker

    monkeypatch.setattr(worker.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # the intra-op threads the kernels compute with
    assert not worker.host_core_free()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the governor left one
    assert worker.host_core_free()
