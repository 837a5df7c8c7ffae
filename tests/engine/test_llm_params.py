"""The offline API's request controls end to end on the real model: logit_bias, allowed_token_ids,
bad_words, best_of, priority scheduling and chat templates (per call, from a file, with variables)."""

import pytest

from tideserve import SamplingParams

PROMPT = "The capital of France is"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(dtype="float32", max_model_len=512, num_blocks=160, scheduling_policy="priority",
               enable_prefix_caching=False)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, **kwargs)


def test_logit_bias_forces_and_bans_tokens(llm):
    base = llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids
    forced = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    out = llm.generate(PROMPT, greedy(logit_bias={forced: 100}))[0].outputs[0].token_ids
    assert out == [forced] * 6
    banned = llm.generate(PROMPT, greedy(logit_bias={str(base[0]): -100}))[0].outputs[0].token_ids
    assert banned[0] != base[0]


def test_allowed_token_ids_and_bad_words(llm):
    allowed = llm.tokenizer.encode(" one two three", add_special_tokens=False)
    out = llm.generate(PROMPT, greedy(allowed_token_ids=allowed))[0].outputs[0].token_ids
    assert set(out) <= set(allowed)
    base = llm.generate(PROMPT, GREEDY)[0].outputs[0].text
    assert "Paris" in base
    text = llm.generate(PROMPT, greedy(bad_words=["Paris"]))[0].outputs[0].text
    assert "Paris" not in text


def test_token_ids_beyond_the_vocabulary_are_refused_before_anything_runs(llm):
    vocab = llm.engine.arch.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias\['{vocab}'\] is not a token id: it must be in \[0, {vocab}\)"):
        llm.generate(["fine", PROMPT], [GREEDY, greedy(logit_bias={vocab: 1.0})])
    with pytest.raises(ValueError, match="allowed_token_ids has"):
        llm.generate(PROMPT, greedy(allowed_token_ids=[1, vocab + 5]))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_best_of_returns_the_n_samples_with_the_highest_cumulative_logprob(llm):
    sample = dict(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    every = llm.generate(PROMPT, SamplingParams(n=5, logprobs=0, **sample))[0]
    ranked = sorted(every.outputs, key=lambda c: c.cumulative_logprob, reverse=True)
    best = llm.generate(PROMPT, SamplingParams(n=2, best_of=5, **sample))[0]
    assert [c.index for c in best.outputs] == [0, 1]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    assert best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob
    assert all(c.logprobs is None for c in best.outputs)  # computed only to rank them: not returned
    assert best.num_generated_tokens == 5 * 8  # every sample's tokens count
    with_lp = llm.generate(PROMPT, SamplingParams(n=1, best_of=3, logprobs=2, **sample))[0].outputs
    assert len(with_lp) == 1 and len(with_lp[0].logprobs) == 8


def test_priority_orders_admission(make_llm, llm):
    one_at_a_time = make_llm(dtype="float32", max_model_len=256, num_blocks=32, scheduling_policy="priority",
                        max_num_seqs=1)
    prompts = ["first", "second", "third", "fourth"]
    outs = one_at_a_time.generate(prompts, greedy(), priority=[3, 0, 2, 1])
    order = sorted(range(4), key=lambda i: outs[i].metrics["first_scheduled_time"])
    assert order == [1, 3, 2, 0]
    with pytest.raises(ValueError, match="priority has 1 entries but there are 4 prompts"):
        llm.generate(prompts, GREEDY, priority=[1])


def test_non_zero_priority_needs_the_priority_policy(make_llm):
    fcfs = make_llm(dtype="float32", max_model_len=256, num_blocks=64)
    with pytest.raises(ValueError, match=r"^Got priority 2 but Priority scheduling is not enabled\.$"):
        fcfs.generate([PROMPT], GREEDY, priority=[2])
    assert fcfs.generate([PROMPT], GREEDY, priority=[0])[0].finished


def test_chat_template_per_call_from_a_file_and_with_variables(llm, tmp_path):
    messages = [{"role": "user", "content": "Name a color."}]
    template = "{{ greeting }}|{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    out = llm.chat(messages, greedy(), chat_template=template, chat_template_kwargs={"greeting": "Hi"})[0]
    assert out.prompt == "Hi|user: Name a color.\nassistant:"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    from_file = llm.chat(messages, greedy(), chat_template=str(path), chat_template_kwargs={"greeting": "Yo"})[0]
    assert from_file.prompt.startswith("Yo|user:")
    assert llm.chat(messages, greedy())[0].prompt.startswith("<|im_start|>")  # the model's own template
    with pytest.raises(ValueError, match="Jinja syntax error at line 1"):
        llm.chat(messages, greedy(), chat_template="{% if %}")
    with pytest.raises(ValueError, match="looks like a file path, but no such file exists"):
        llm.chat(messages, greedy(), chat_template=str(tmp_path / "missing.jinja"))


def test_continue_final_message(llm):
    messages = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello, my name"}]
    out = llm.chat(messages, greedy(), add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt.rstrip().endswith("Hello, my name") and "<|im_end|>" not in out.prompt[-20:]
    with pytest.raises(ValueError, match="Cannot set both"):
        llm.chat(messages, greedy(), continue_final_message=True)
