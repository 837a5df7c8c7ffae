"""The sampler's allowed-token mask (structured output): masked rows only sample allowed tokens, with
every other stage still applied; unmasked rows are untouched; min_tokens cannot starve a finished
grammar; logprobs stay those of the model."""

from __future__ import annotations

import pytest
import torch

from tideserve.model.layers.sampler import (
    AllowedTokenMask,
    Sampler,
    SamplingMetadata,
    apply_allowed_token_mask,
    unpack_bitmask,
)
from tideserve.sampling_params import SamplingParams

V = 70  # not a multiple of 32: the last bitmask word is partly beyond the vocabulary


def _words(sets: list[set[int]]) -> torch.Tensor:
    """Allowed token sets as 32-bit words (in int64, so bit 31 is a plain bit)."""
    words = torch.zeros(len(sets), (V + 31) // 32, dtype=torch.int64)
    for row, tokens in enumerate(sets):
        for t in tokens:
            words[row, t // 32] |= 1 << (t % 32)
    return words


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """The int32 bitmask the grammar engine writes (bit 31 is the sign bit)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def meta_for(params, eos=None, outputs=None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(params=params, generators=[None] * n, prompt_token_ids=[[]] * n,
                                  output_token_ids=outputs or [[]] * n, eos_token_ids=eos, device="cpu")


def test_unpack_matches_bits_including_bit_31():
    sets = [{0, 31, 32, 69}, set(), set(range(V))]
    unpacked = unpack_bitmask(_to_int32(_words(sets)), V)
    for row, tokens in enumerate(sets):
        assert set(unpacked[row].nonzero().flatten().tolist()) == tokens


def test_greedy_picks_the_best_allowed_token_and_leaves_other_rows_alone():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    allowed = {3, 40, 66}
    mask = AllowedTokenMask(rows=[1], bitmask=_to_int32(_words([allowed])))
    meta = meta_for([SamplingParams(temperature=0)] * 3)
    meta.allowed_token_mask = mask
    out = Sampler()(logits, meta).sampled_token_ids
    best_allowed = max(allowed, key=lambda t: logits[1, t].item())
    assert out == [logits[0].argmax().item(), best_allowed, logits[2].argmax().item()]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=2),
    SamplingParams(temperature=1.3, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5, seed=3),
])
def test_sampled_rows_stay_inside_the_mask(params):
    allowed = {1, 5, 9, 33, 64}
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(7)) * 4
    logits[0, 20] = 50.0  # a token the model loves and the grammar forbids
    seen = set()
    for step in range(40):
        g = torch.Generator().manual_seed(step)
        meta = SamplingMetadata.build([params], [g], [[5, 9]], [[1, 20]], "cpu")
        meta.allowed_token_mask = AllowedTokenMask([0], _to_int32(_words([allowed])))
        seen.add(Sampler()(logits, meta).sampled_token_ids[0])
    assert seen <= allowed and len(seen) > 1


def test_min_tokens_cannot_starve_a_finished_grammar():
    """The grammar allows only EOS (it is complete) while min_tokens forbids EOS: the grammar wins."""
    eos = 7
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    meta = meta_for([SamplingParams(temperature=0, min_tokens=5), SamplingParams(temperature=1.0, min_tokens=5)],
                    eos=[eos, eos])
    meta.allowed_token_mask = AllowedTokenMask([0, 1], _to_int32(_words([{eos}, {eos, 12}])))
    out = Sampler()(logits, meta).sampled_token_ids
    assert out[0] == eos  # only EOS is allowed: it is taken
    assert out[1] == 12  # EOS is masked by min_tokens, 12 is still allowed


def test_logprobs_are_the_models_own():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(2))
    meta = meta_for([SamplingParams(temperature=0, logprobs=2)])
    meta.allowed_token_mask = AllowedTokenMask([0], _to_int32(_words([{4}])))
    out = Sampler()(logits, meta)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.sampled_token_ids == [4]
    assert out.logprobs[0][4].logprob == pytest.approx(raw[0, 4].item(), abs=1e-5)
    top = raw[0].topk(2).indices.tolist()
    assert [t for t in out.logprobs[0] if t != 4][:2] == [t for t in top if t != 4][:2]


def test_bitmask_wider_than_logits_is_cut_and_narrower_forbids_the_tail():
    logits = torch.zeros(1, 40)
    wide = _to_int32(_words([{2, 39, 60}]))  # 3 words: bits past the logits are ignored
    kept = torch.isfinite(apply_allowed_token_mask(logits.clone(), AllowedTokenMask([0], wide)))
    assert kept.nonzero()[:, 1].tolist() == [2, 39]
    logits = torch.zeros(1, 100)
    narrow = _to_int32(_words([{2, 39}]))  # covers 96 tokens: 96..99 are never allowed
    kept = torch.isfinite(apply_allowed_token_mask(logits, AllowedTokenMask([0], narrow)))
    assert kept.nonzero()[:, 1].tolist() == [2, 39]
