"""logit_bias, allowed_token_ids and bad_words in the batched sampler, against dense references."""

from __future__ import annotations

import math

import pytest
import torch

from tideserve.model.layers.logit_bias import LogitBias, apply_logit_bias
from tideserve.model.layers.sampler import Sampler, SamplingMetadata
from tideserve.sampling_params import SamplingParams

V = 64
sampler = Sampler()


def meta_for(params, outputs=None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(params=list(params), generators=[None] * n, prompt_token_ids=[[]] * n,
                                  output_token_ids=list(outputs) if outputs is not None else [[]] * n,
                                  device="cpu")


def logits(n: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_no_row_using_them_builds_nothing() -> None:
    assert meta_for([SamplingParams(), SamplingParams(temperature=0)]).logit_bias is None


def test_biases_are_added_to_exactly_their_cells_for_a_large_batch() -> None:
    rows, per_row = 256, 300
    gen = torch.Generator().manual_seed(1)
    params, dense = [], torch.zeros(rows, 1024)
    for r in range(rows):
        if r % 3 == 2:  # some rows without a bias
            params.append(SamplingParams())
            continue
        ids = torch.randperm(1024, generator=gen)[:per_row].tolist()
        values = (torch.rand(per_row, generator=gen) * 200 - 100).tolist()
        params.append(SamplingParams(logit_bias={str(i): v for i, v in zip(ids, values)}))  # OpenAI's string keys
        dense[r, ids] = torch.tensor(values)
    x = logits(rows, 1024)
    out = apply_logit_bias(x.clone(), LogitBias.build(params, [[]] * rows, torch.device("cpu")))
    torch.testing.assert_close(out, x + dense)


def test_a_bias_moves_the_greedy_choice_and_minus_100_bans() -> None:
    x = logits(2)
    top = int(x[0].argmax())
    second = int(x[0].topk(2).indices[1])
    params = [SamplingParams(temperature=0, logit_bias={second: 100.0}),
              SamplingParams(temperature=0, logit_bias={int(x[1].argmax()): -100.0})]
    out = sampler(x, meta_for(params)).sampled_token_ids
    assert out[0] == second != top
    assert out[1] != int(x[1].argmax())


def test_banned_tokens_are_never_sampled_and_logprobs_stay_raw() -> None:
    x = logits(1).expand(400, V).contiguous()  # 400 random draws of one distribution
    banned = x[0].topk(5).indices.tolist()  # the most likely tokens
    params = [SamplingParams(temperature=1.0, logprobs=0, logit_bias={t: -100 for t in banned})] * 400
    out = sampler(x, meta_for(params))
    assert not set(out.sampled_token_ids) & set(banned)
    raw = torch.log_softmax(x[0], -1)
    token = out.sampled_token_ids[0]
    assert math.isclose(out.logprobs[0][token].logprob, float(raw[token]), rel_tol=1e-5)


def test_allowed_token_ids_restrict_each_row_to_its_own_set() -> None:
    x = logits(300)
    sets = [[3, 9], [40], [5, 6, 7, 63]]
    params = [SamplingParams(temperature=1.5, allowed_token_ids=sets[r % 3]) if r % 4 else SamplingParams()
              for r in range(300)]
    out = sampler(x, meta_for(params)).sampled_token_ids
    for r, token in enumerate(out):
        if r % 4:
            assert token in sets[r % 3]
    greedy = sampler(x[:1], meta_for([SamplingParams(temperature=0, allowed_token_ids=[11, 12])]))
    assert greedy.sampled_token_ids == [11 if x[0, 11] > x[0, 12] else 12]


def test_bad_words_ban_single_tokens_always_and_sequences_after_their_prefix() -> None:
    p = SamplingParams(temperature=0, bad_words=["unused"])
    p.bad_words_token_ids = [[7], [3, 4, 5]]  # what the engine resolves with the tokenizer
    x = torch.zeros(4, V)
    x[:, 7] = 10.0  # 7 is the favourite, 5 the runner-up
    x[:, 5] = 9.0
    outputs = [[], [3, 4], [9, 4], [4]]
    out = sampler(x, meta_for([p] * 4, outputs)).sampled_token_ids
    assert 7 not in out
    assert out == [5, 0, 5, 5]  # after "3 4", 5 would complete the bad word: the next best is a zero logit


def test_derived_tensors_are_built_once_per_request() -> None:
    p = SamplingParams(logit_bias={1: 2.0}, allowed_token_ids=[1, 2])
    meta_for([p])
    first = p.derived["logit_bias"]
    meta_for([p])
    assert p.derived["logit_bias"] is first
    assert "logit_bias" not in SamplingParams(logit_bias={1: 2.0}).derived


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"logit_bias": {"1": 101}}, r"logit_bias\['1'\] must be in \[-100, 100\], got 101"),
    ({"logit_bias": {"-1": 1}}, r"logit_bias\['-1'\] is not a token id"),
    ({"logit_bias": {"one": 1}}, "must be keyed by a token id"),
    ({"logit_bias": [1]}, "logit_bias must be a mapping"),
    ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
    ({"allowed_token_ids": [-2]}, "allowed_token_ids must be a list of integers >= 0"),
    ({"bad_words": [" "]}, "bad_words must be a list of non-empty strings"),
    ({"n": 2, "best_of": 1}, r"best_of must be an integer >= n \(2\)"),
])
def test_validation_messages(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
