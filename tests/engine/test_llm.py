"""The offline API end to end on the real SmolLM2 file: batching invariance, preemption, sampling
reproducibility, stop strings, n > 1, logprobs and every validation error."""

import pytest

from tideserve import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "In 1969, humans first",
    "def fibonacci(n):",
    "The quick brown fox",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(dtype="float32", max_num_seqs=16)


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy outputs of each prompt run alone."""
    return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_batched_equals_alone(llm, reference):
    assert tokens(llm.generate(PROMPTS, GREEDY)) == reference


@pytest.mark.slow
def test_chunked_prefill_at_small_budget_equals_alone(make_llm, reference):
    small = make_llm(dtype="float32", max_num_batched_tokens=8, max_num_seqs=4)
    assert tokens(small.generate(PROMPTS, GREEDY)) == reference


@pytest.mark.slow
def test_forced_preemption_equals_alone(make_llm, reference, caplog):
    # 12 blocks of 8 tokens: far too small for six requests of ~30 tokens at once.
    tiny = make_llm(dtype="float32", block_size=8, num_blocks=12, max_model_len=96)
    outs = tiny.generate(PROMPTS, GREEDY)
    assert tiny.engine.scheduler.num_preemptions > 0
    assert tokens(outs) == reference
    assert any("preempted" in r.message for r in caplog.records)
    assert tiny.engine.kv_manager.num_free_blocks == 12


@pytest.mark.slow
def test_seeded_sampling_reproducible_across_batches(llm):
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["Tell me a story about a dragon."], params)[0].outputs[0].token_ids
    mates = [SamplingParams(temperature=1.0, max_tokens=16), SamplingParams(temperature=0.0, max_tokens=8)]
    together = llm.generate(["Tell me a story about a dragon.", "Hi", "Once upon a time"],
                            [params] + mates)
    assert together[0].outputs[0].token_ids == alone


def test_stop_string_is_not_leaked(llm):
    base = llm.generate(["Count: 1, 2, 3, 4, 5,"], GREEDY)[0].outputs[0].text
    assert len(base) > 4
    stop = base[2:4]
    out = llm.generate(["Count: 1, 2, 3, 4, 5,"],
                       SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert stop not in out.text
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert base.startswith(out.text)


def test_n_samples_and_logprobs(llm):
    out = llm.generate(["Hello"], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, logprobs=3,
                                                 ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        assert len(c.token_ids) == 5 and len(c.logprobs) == 5
        for tok, lp in zip(c.token_ids, c.logprobs):
            assert tok in lp and len(lp) >= 3
            assert all(v.logprob <= 0 for v in lp.values())


@pytest.mark.slow
def test_chat_and_eos(llm):
    out = llm.chat([{"role": "user", "content": "你好，请介绍一下你自己"}],
                   SamplingParams(temperature=0.0, max_tokens=64))[0]
    assert out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"n": 0}, "n must"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"presence_penalty": 5}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"stop": [""]}, "stop"),
])
def test_invalid_sampling_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_prompt_validation_loses_nothing(llm):
    limit = llm.engine.max_model_len
    with pytest.raises(ValueError, match="must not be empty"):
        llm.generate([""], GREEDY)
    long_prompt = list(range(1, limit + 5))
    with pytest.raises(ValueError, match=f"maximum context length is {limit} tokens"):
        llm.generate(["fine", long_prompt], GREEDY)
    with pytest.raises(ValueError, match="max_tokens=.* is too large"):
        llm.generate(["Hello"], SamplingParams(max_tokens=limit))
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 2, 10**9]], GREEDY)
    # Nothing was left behind by the refused batches.
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks


def test_engine_config_validation(make_llm):
    with pytest.raises(ValueError, match="max_model_len=.*larger than the model's trained context"):
        make_llm(dtype="float32", max_model_len=10**7)
    with pytest.raises(ValueError, match="block_size must be one of"):
        LLM(dtype="float32", block_size=7)
    with pytest.raises(ValueError, match="largest max_model_len that fits"):
        make_llm(dtype="float32", num_blocks=2, block_size=8, max_model_len=64)
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(bogus=1)


def test_prompt_logprobs_score_every_prompt_token(llm):
    out = llm.generate(["The capital of France is Paris"],
                       SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))[0]
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(out.prompt_token_ids)
    assert plp[0] is None
    for token_id, entry in zip(out.prompt_token_ids[1:], plp[1:]):
        assert token_id in entry and entry[token_id].logprob <= 0 and entry[token_id].rank >= 1
    # " Paris" after "The capital of France is" should be among the likeliest continuations.
    assert plp[-1][out.prompt_token_ids[-1]].rank <= 5


def test_prompt_logprobs_survive_chunking(make_llm):
    chunked = make_llm(dtype="float32", max_num_batched_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    prompt = "One two three four five six seven eight nine ten eleven twelve"
    a = chunked.generate([prompt], params)[0].prompt_logprobs
    b = make_llm(dtype="float32").generate([prompt], params)[0].prompt_logprobs
    assert len(a) == len(b)
    for x, y in zip(a[1:], b[1:]):
        (tx, lx), = [(t, v.logprob) for t, v in x.items() if v.rank is not None][:1]
        assert abs(lx - y[tx].logprob) < 1e-4


def test_max_tokens_zero_scores_the_prompt_alone(llm):
    out = llm.generate(["The capital of France is Paris"],
                       SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=1))[0]
    assert out.outputs[0].token_ids == [] and out.outputs[0].text == ""
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    plain = llm.generate(["Hello"], SamplingParams(max_tokens=0))[0]
    assert plain.finished and plain.outputs[0].token_ids == []


def test_greedy_steps_take_the_native_argmax(llm, monkeypatch):
    """On CPU every greedy step's token comes from the native argmax kernel (not torch's max); the tokens
    are the ones torch's max picks."""
    from tideserve import native

    if native.load_library() is None:
        pytest.skip("no C compiler to build the native kernels")
    calls = []
    kernel = native.argmax_rows
    monkeypatch.setattr(native, "argmax_rows", lambda x: calls.append(x.shape) or kernel(x))
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    native_out = [o.outputs[0].token_ids for o in llm.generate(["The tide", "A harbour at dawn"], params)]
    assert len(calls) >= 5 and all(rows <= 2 for rows, _ in calls)
    monkeypatch.setattr(native, "argmax_rows", lambda x: None)  # the kernel declines: torch's max decides
    assert [o.outputs[0].token_ids for o in llm.generate(["The tide", "A harbour at dawn"], params)] == native_out


def test_prompt_tokens_count_when_their_prefill_is_done(make_llm):
    """The prompt-token counter (the log's prompt throughput, vllm:prompt_tokens_total) moves when a
    prompt has been computed, not when it is queued: a chunked prefill counts once, at its end, and a
    request still waiting counts nothing."""
    llm = make_llm(dtype="float32", max_num_batched_tokens=8, max_num_seqs=1)
    engine = llm.engine
    ids = [llm.tokenizer.encode(" ".join(PROMPTS[n:n + 3])) for n in (0, 3)]
    assert min(map(len, ids)) > 8  # each prefill takes more than one step
    for n, prompt in enumerate(ids):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                           request_id=f"count-{n}")
    assert engine.stats().prompt_tokens == 0
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        seen.append(engine.stats().prompt_tokens)
    assert seen[-1] == sum(map(len, ids))
    assert sorted(set(seen)) == [0, len(ids[0]), sum(map(len, ids))]  # one request at a time, each once


def test_reset_prefix_cache_makes_the_next_request_prefill_its_whole_prompt(llm):
    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate(prompt, params)[0]
    stats = llm.engine.kv_manager.prefix_stats
    hits = stats.hits
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == first.outputs[0].token_ids
    assert stats.hits > hits  # the second run read its prefix from the cache
    assert llm.reset_prefix_cache() is True
    hits = stats.hits
    llm.generate(prompt, params)
    assert stats.hits == hits  # nothing left to hit
