"""Structured output through ``LLM.generate``/``LLM.chat`` on the real SmolLM2: outputs parse and validate
against their schemas (greedy and sampled, n > 1, with penalties, seeds and logprobs), unconstrained
neighbours are unchanged token for token, and the constraint survives preemption, recompute and
prefix-cache hits. Requests run in a few shared batches to keep the module fast."""

from __future__ import annotations

import json
import re

import pytest

from tideserve import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow  # the model end to end for seconds: `make test` runs it, `-m 'not slow'` does not

jsonschema = pytest.importorskip("jsonschema")

PERSON = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "email", "role"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.com$"},
        "role": {"enum": ["admin", "user", "guest"]},
    },
}
ORDER = {
    "type": "object", "additionalProperties": False, "required": ["id", "items", "paid"],
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "items": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
            "type": "object", "additionalProperties": False, "required": ["sku", "qty", "price"],
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]$"},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                           "price": {"type": "number", "minimum": 0, "maximum": 100}}}},
        "paid": {"type": "boolean"},
    },
}
POINTS = {"type": "array", "minItems": 1, "maxItems": 3,
          "items": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9},
                    "minItems": 2, "maxItems": 2}}
CASES = [("A user account as JSON.", PERSON), ("A shop order as JSON.", ORDER), ("Some 2D points as JSON.", POINTS)]
PLAIN = ["Name three colors.", "What is 2 + 2?"]
PLAIN_PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
MAX_TOKENS = 120


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def schema_params(schema: dict, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), **kwargs)


def assert_valid(output, schema: dict) -> None:
    assert output.finish_reason == "stop", (output.finish_reason, output.text)
    jsonschema.validate(json.loads(output.text), schema)


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(dtype="float32", max_model_len=512, num_blocks=160, max_num_seqs=16)


@pytest.fixture(scope="module")
def mixed_batch(llm):
    """One batch: the 3 schemas greedy, the same sampled with seeds, n=3 with penalties and logprobs, and
    two unconstrained greedy requests; plus those two run alone."""
    convs = ([chat(t) for t, _ in CASES] * 2 + [chat(CASES[0][0])] + [chat(p) for p in PLAIN])
    params = ([schema_params(s, temperature=0.0) for _, s in CASES]
              + [schema_params(s, temperature=1.0, seed=11 + i) for i, (_, s) in enumerate(CASES)]
              + [schema_params(PERSON, n=3, temperature=1.0, seed=5, presence_penalty=0.5, repetition_penalty=1.2,
                               logprobs=2)]
              + [PLAIN_PARAMS] * 2)
    outs = llm.chat(convs, params)
    alone = [o.outputs[0].token_ids for o in llm.chat([chat(p) for p in PLAIN], PLAIN_PARAMS)]
    return outs, alone


def test_greedy_and_sampled_outputs_validate(llm, mixed_batch):
    outs, _ = mixed_batch
    for out, (_, schema) in zip(outs[:6], CASES * 2, strict=True):
        assert_valid(out.outputs[0], schema)
    # A fixed seed reproduces the sampled output, here without batch-mates.
    again = llm.chat([chat(CASES[0][0])], [schema_params(PERSON, temperature=1.0, seed=11)])[0].outputs[0]
    assert again.token_ids == outs[3].outputs[0].token_ids


def test_n_samples_each_follow_the_grammar_with_penalties_and_logprobs(mixed_batch):
    out = mixed_batch[0][6]
    assert len(out.outputs) == 3
    for completion in out.outputs:
        assert_valid(completion, PERSON)
        assert len(completion.logprobs) == len(completion.token_ids)
        assert all(t in lp for t, lp in zip(completion.token_ids, completion.logprobs, strict=True))
    assert len({c.text for c in out.outputs}) > 1


def test_unconstrained_neighbours_are_unchanged_token_for_token(mixed_batch):
    outs, alone = mixed_batch
    assert [o.outputs[0].token_ids for o in outs[7:]] == alone


def test_preemption_recompute_and_prefix_cache_keep_the_grammar(make_llm, mixed_batch):
    """A pool far too small for the batch preempts requests mid-JSON; their recompute re-runs tokens the
    matcher has already seen, and resumed requests hit cached prefixes: outputs equal the unpreempted
    greedy ones (from the mixed batch), and stay valid."""
    reference = [o.outputs[0].token_ids for o in mixed_batch[0][:3]]
    tiny = make_llm(dtype="float32", max_model_len=96, block_size=8, num_blocks=12, max_num_seqs=6)
    outs = tiny.chat([chat(t) for t, _ in CASES], [schema_params(s, temperature=0.0, max_tokens=56) for _, s in CASES])
    assert tiny.engine.scheduler.num_preemptions > 0
    assert tiny.engine.kv_manager.prefix_stats.hits > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    for out, (_, schema) in zip(outs, CASES, strict=True):
        assert_valid(out.outputs[0], schema)


def test_regex_choice_grammar_json_object_and_limits(llm):
    cases = [
        ("My phone number is ", {"regex": r"\(\d{3}\) \d{3}-\d{4}"}, {}, r"^\(\d{3}\) \d{3}-\d{4}$"),
        ("The sky is ", {"choice": ["blue", "green", "red"]}, {}, r"^(blue|green|red)$"),
        ("Numbers: ", {"grammar": 'root ::= num ("," num){2}\nnum ::= [1-9][0-9]?'}, {},
         r"^[1-9][0-9]?(,[1-9][0-9]?){2}$"),
        ("Answer: ", {"choice": ["yes", "no"]}, {"min_tokens": 8}, r"^(yes|no)$"),  # min_tokens cannot break it
    ]
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=c, **kw) for _, c, kw, _ in cases]
    outs = llm.generate([p for p, *_ in cases], params)
    for out, (*_, pattern) in zip(outs, cases, strict=True):
        assert out.outputs[0].finish_reason == "stop"
        assert re.match(pattern, out.outputs[0].text), out.outputs[0].text
    # JSON mode, a max_tokens cut (finish_reason "length", as OpenAI does) and a stop string, in one batch.
    outs = llm.chat([chat("A cat as a JSON object."), chat(CASES[1][0]), chat(CASES[0][0])],
                    [SamplingParams(temperature=0, max_tokens=24, structured_outputs={"json_object": True}),
                     schema_params(ORDER, temperature=0, max_tokens=5),
                     schema_params(PERSON, temperature=0, stop=['"age"'])])
    obj, cut, stopped = (o.outputs[0] for o in outs)
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.finish_reason == "length" and obj.text.startswith("{")
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5
    assert stopped.finish_reason == "stop" and stopped.stop_reason == '"age"'
    assert stopped.text.startswith('{"name": ')


def test_invalid_constraints_fail_before_anything_runs(llm):
    with pytest.raises(ValueError, match=r"structured_outputs.json is invalid: Invalid type: foo"):
        llm.generate(["x", "y"], [PLAIN_PARAMS, SamplingParams(structured_outputs={"json": {"type": "foo"}})])
    with pytest.raises(ValueError, match=r"structured_outputs.regex is invalid"):
        llm.generate("x", SamplingParams(structured_outputs={"regex": "(unclosed"}))
    assert not llm.engine.has_unfinished_requests()
