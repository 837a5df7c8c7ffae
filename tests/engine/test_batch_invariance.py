"""The same request gives the same answer: a greedy request's tokens equal its run alone, whatever shares its
steps, however much of its prompt the prefix cache held, however its prefill is chunked, whatever the block
size, across preemption (recompute and swap) and pool resizes, and with speculative proposals verified in its
steps. The real SmolLM2 file as a user gets it by default: its own Q4_1 and Q8_0 blocks on the native kernels,
a bfloat16 KV cache. A seeded sampled request
(one sample, or n of them, each child seeded from the request's seed) draws the same tokens in the same
conditions: its logits are the same bits, and its generator is its own. The targets ask for their tokens'
logprobs, compared as floats with ==, so a rounding that does not flip a token still fails."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tideserve import SamplingParams

pytestmark = pytest.mark.slow  # the model end to end for seconds: `make test` runs it, `-m 'not slow'` does not

SYSTEM = "You are a careful assistant. Answer in full sentences and explain each step of your reasoning. " * 3
QUESTIONS = ["What is the most common color in the world?", "Why is the sky blue?",
             "Explain how a bicycle works.", "Give me three tips for learning Python."]
MATES = ["Write a haiku about the sea.", "List five fruits and their colors.", "def fibonacci(n):",
         "Tell me a short story about a robot who learns to paint."]
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
TARGETS = {
    "greedy": GREEDY,
    "seeded": SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True,
                             logprobs=0),
    "seeded n=2": SamplingParams(n=2, temperature=1.0, seed=99, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0),
}


def chat(llm, text: str, system: bool = True) -> list[int]:
    messages = ([{"role": "system", "content": SYSTEM}] if system else []) + [{"role": "user", "content": text}]
    return llm.tokenizer.encode_chat(messages)


def samples(output) -> list[tuple[list[int], list[float]]]:
    """Each sample's tokens and their logprobs (none where not asked for), in the order of its index."""
    return [(list(o.token_ids), [step[t].logprob for step, t in zip(o.logprobs or [], o.token_ids, strict=False)])
            for o in sorted(output.outputs, key=lambda o: o.index)]


@pytest.fixture(scope="module")
def solo(make_llm):
    """Each (question, target kind)'s tokens, run alone with nothing cached."""
    llm = make_llm(max_model_len=512, enable_prefix_caching=False)
    return {(q, kind): samples(llm.generate({"prompt_token_ids": chat(llm, q)}, params)[0])
            for q in QUESTIONS for kind, params in TARGETS.items()}


def test_the_same_chat_twice_gives_the_same_tokens(make_llm):
    """A new user's first check: the second request hits the prefix cache and prefills only its tail."""
    llm = make_llm()
    params = SamplingParams(temperature=0.0, max_tokens=48)
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        first, second = (llm.chat(messages, params)[0] for _ in range(2))
        assert second.num_cached_tokens > 0
        assert second.outputs[0].token_ids == first.outputs[0].token_ids, question


ENGINES = st.fixed_dictionaries({
    "block_size": st.sampled_from([8, 16, 32]),
    "max_num_batched_tokens": st.sampled_from([24, 40, 96, 2048]),
    "pool": st.sampled_from(["roomy", "recompute", "swap"]),
    # n-gram proposals verified in the step (any single token counts as a match, so they come often)
    "speculative": st.booleans(),
})


@st.composite
def workloads(draw):
    return {
        "question": draw(st.sampled_from(QUESTIONS)),
        "target": draw(st.sampled_from(list(TARGETS))),
        # the prefix the cache holds when the request arrives: that many of its prompt's tokens, from a warm-up
        # request that shared them (0: nothing cached)
        "cached_fraction": draw(st.sampled_from([0.0, 0.3, 0.6, 0.9, 1.0])),
        "mates": draw(st.lists(st.tuples(st.sampled_from(MATES), st.integers(1, 24), st.integers(0, 6),
                                         st.booleans()), max_size=4)),
        "arrives": draw(st.integers(0, 3)),
        "resize": draw(st.sampled_from([None, "grow", "shrink"])),
        "resize_at": draw(st.integers(1, 8)),
    }


def build(make_llm, engine: dict):
    kwargs = {"max_model_len": 256, "block_size": engine["block_size"],
              "max_num_batched_tokens": engine["max_num_batched_tokens"]}
    if engine["pool"] != "roomy":  # room for one request of max_model_len, not for it and its mates: preemption
        kwargs.update(num_blocks=256 // engine["block_size"], preemption_mode=engine["pool"], swap_space=0.05)
    if engine["speculative"]:
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    return make_llm(**kwargs)


# No shrinking: each example runs an engine for seconds, and the failing example is reported as drawn.
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
          phases=[Phase.explicit, Phase.generate])
@given(engine=ENGINES, work=workloads())
def test_a_request_gives_its_solo_tokens_in_any_company(make_llm, solo, engine, work):
    llm = build(make_llm, engine)
    core = llm.engine
    target = chat(llm, work["question"])
    cached = int(len(target) * work["cached_fraction"])
    if cached:  # a request that shares the first `cached` tokens fills the cache, then finishes
        llm.generate({"prompt_token_ids": target[:cached] + chat(llm, "Say hello.", system=False)},
                     SamplingParams(temperature=0.0, max_tokens=2))
    arrivals: dict[int, list[tuple[list[int], SamplingParams]]] = {}
    arrivals.setdefault(work["arrives"], []).append((target, TARGETS[work["target"]]))
    for text, max_tokens, step, seeded in work["mates"]:
        params = (SamplingParams(temperature=0.8, seed=7, max_tokens=max_tokens, ignore_eos=True) if seeded
                  else SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        arrivals.setdefault(step, []).append((chat(llm, text, system=step % 2 == 0), params))
    ids: dict[str, list[list[int]]] = {}
    target_id = None
    step = 0
    while step <= max(arrivals) or core.has_unfinished_requests():
        for prompt, params in arrivals.get(step, []):
            rid = core.add_request(prompt, params, prompt_token_ids=prompt)
            target_id = target_id or (rid if prompt is target else None)
        assert step < 1000, f"no progress: {engine}, {work}"
        # a resize of the elastic pool (a fixed one is what its size says: shrunk, it could not grow back)
        if step == work["resize_at"] and work["resize"] is not None and engine["pool"] == "roomy":
            pool = core.pool
            if work["resize"] == "grow":
                pool._resize(core.kv_manager.num_blocks + 16, "test")
            else:
                pool.shrink(max(pool.num_used_blocks() + 1, 1), "test")
        for out in core.step():
            if out.finished:
                ids[out.request_id] = samples(out)
        step += 1
    assert ids[target_id] == solo[work["question"], work["target"]], (engine, work)
