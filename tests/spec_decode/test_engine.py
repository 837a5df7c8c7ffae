"""Speculative decoding through the engine (the embedded SmolLM2 file, its own blocks on the native kernels):
with n-gram proposals a greedy request gives exactly the tokens it gives without them, and so does a seeded
sampled one (its generator is rewound to the rows it keeps), with proposals really accepted; stop strings,
``max_tokens`` and logprobs land where they land without proposals; and sampled output keeps the model's
distribution (a chi-square test over hundreds of draws)."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from tideserve import SamplingParams

pytestmark = pytest.mark.slow  # the model end to end for seconds: `make test` runs it, `-m 'not slow'` does not

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
SOURCE = '''def mean(values):
    """The arithmetic mean of a non-empty list."""
    total = 0.0
    for value in values:
        total += value
    return total / len(values)


def variance(values):
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)
'''
EDIT = f"Rename the function `mean` to `average` in this code and print the whole file.\n\n{SOURCE}"
QUESTION = "Why is the sky blue?"


@pytest.fixture(scope="module")
def llms(make_llm):
    return make_llm(max_model_len=1024), make_llm(max_model_len=1024, speculative_config=SPEC)


def chat(llm, text: str) -> dict:
    return {"prompt_token_ids": llm.tokenizer.encode_chat([{"role": "user", "content": text}])}


def run(llm, text: str, params: SamplingParams):
    return llm.generate(chat(llm, text), params)[0].outputs[0]


def test_greedy_tokens_equal_and_proposals_are_accepted(llms):
    plain, spec = llms
    stats = spec.engine.scheduler.spec_stats
    before = stats.num_accepted_tokens
    params = SamplingParams(temperature=0.0, max_tokens=120)
    for text in (EDIT, QUESTION):
        assert run(spec, text, params).token_ids == run(plain, text, params).token_ids, text
    assert stats.num_accepted_tokens - before > 40  # the edit copies its source: most proposals pass
    assert stats.mean_acceptance_length > 1.5


def test_seeded_sampling_draws_the_same_tokens_with_proposals(llms):
    plain, spec = llms
    for seed in (1, 2, 3):
        params = SamplingParams(temperature=0.7, top_p=0.95, seed=seed, max_tokens=80)
        assert run(spec, EDIT, params).token_ids == run(plain, EDIT, params).token_ids, seed


def test_stop_strings_max_tokens_and_logprobs_land_as_without_proposals(llms):
    plain, spec = llms
    for params in (SamplingParams(temperature=0.0, max_tokens=200, stop=["variance"]),
                   SamplingParams(temperature=0.0, max_tokens=200, stop=["total +="], include_stop_str_in_output=True),
                   SamplingParams(temperature=0.0, max_tokens=37),
                   SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[]),
                   SamplingParams(temperature=0.0, max_tokens=30, logprobs=2)):
        a, b = run(spec, EDIT, params), run(plain, EDIT, params)
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason), params
        if params.logprobs:
            for mine, theirs in zip(a.logprobs, b.logprobs, strict=True):
                assert mine.keys() == theirs.keys()
                for token, lp in mine.items():
                    assert math.isclose(lp.logprob, theirs[token].logprob, abs_tol=1e-5)


def test_sampled_tokens_keep_the_models_distribution(make_llm):
    """The prompt repeats a pattern, so the lookup proposes its continuation at the second output token; the
    model samples (temperature 1, top-k 3) the second and third tokens. Their joint frequencies over many
    requests, given the first token, fit the model's own probabilities (from its logprobs without proposals);
    keeping proposals at the wrong rate (always, never, or the draft's token on a rejection) fails the test."""
    plain = make_llm(max_model_len=256)
    spec = make_llm(max_model_len=256, max_num_seqs=128,
                    speculative_config={**SPEC, "prompt_lookup_min": 1, "disable_by_batch_size": 1000})
    prompt = plain.tokenizer.encode("red green blue. red green blue. red green blue. red green blue. red")
    k = 3

    def top(ids: list[int]) -> dict[int, float]:
        """The model's next-token probabilities after ``ids``, top-k renormalized (what the sampler draws)."""
        lp = plain.generate({"prompt_token_ids": ids},
                            SamplingParams(temperature=0.0, max_tokens=1, logprobs=k))[0].outputs[0].logprobs[0]
        best = sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:k]
        z = sum(math.exp(v.logprob) for _, v in best)
        return {t: math.exp(v.logprob) / z for t, v in best}

    first = max(top(prompt).items(), key=lambda kv: kv[1])[0]
    expected = {(t2, t3): p2 * p3 for t2, p2 in top(prompt + [first]).items()
                for t3, p3 in top(prompt + [first, t2]).items()}
    params = SamplingParams(temperature=1.0, top_k=k, max_tokens=3, ignore_eos=True)
    stats = spec.engine.scheduler.spec_stats
    outputs = spec.generate([{"prompt_token_ids": prompt}] * 600, params)
    assert stats.num_drafts > 100 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    seen = Counter(tuple(o.outputs[0].token_ids[1:]) for o in outputs if o.outputs[0].token_ids[0] == first)
    n = sum(seen.values())
    assert n > 200
    # Pearson's chi-square over the cells expected 5 times or more, the rest pooled in one cell.
    cells = [(seen[key], n * p) for key, p in expected.items() if n * p >= 5]
    rest = n - sum(o for o, _ in cells), n - sum(e for _, e in cells)
    if rest[1] >= 5:
        cells.append(rest)
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    assert dof >= 1
    # the 0.999 quantile of chi-square with dof degrees of freedom (Wilson-Hilferty), so the test fails by
    # chance once in a thousand runs
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, (chi2, limit, dof, seen, expected)


def test_structured_output_masks_every_verified_row(llms):
    """A JSON schema request whose answer copies its prompt: proposals the grammar allows are verified, each
    row masked by the grammar after the proposals before it; the output is the one without proposals and
    parses under the schema."""
    import json

    plain, spec = llms
    record = {"name": "Ada Lovelace", "born": 1815, "field": "mathematics", "known_for": "the first program"}
    schema = {"type": "object", "properties": {k: {"type": "integer" if isinstance(v, int) else "string"}
                                               for k, v in record.items()},
              "required": list(record), "additionalProperties": False}
    text = f"Copy this record as JSON, exactly: {json.dumps(record)}"
    params = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs={"json": schema})
    stats = spec.engine.scheduler.spec_stats
    before = stats.num_accepted_tokens
    out = run(spec, text, params)
    assert out.token_ids == run(plain, text, params).token_ids
    assert set(json.loads(out.text)) == set(record)
    assert stats.num_accepted_tokens - before > 5
