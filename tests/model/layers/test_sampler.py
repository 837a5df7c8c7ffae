"""Batched sampler: each stage against a hand-computed reference, seeded reproducibility, logprobs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from tideserve.model.layers.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
)
from tideserve.sampling_params import SamplingParams

V = 50


def meta_for(params: Sequence[SamplingParams], *, generators: Sequence[torch.Generator | None] | None = None,
             prompts: Sequence[Sequence[int]] | None = None, outputs: Sequence[Sequence[int]] | None = None,
             eos: Sequence[int | Sequence[int] | None] | None = None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params=list(params),
        generators=list(generators) if generators is not None else [None] * n,
        prompt_token_ids=list(prompts) if prompts is not None else [[]] * n,
        output_token_ids=list(outputs) if outputs is not None else [[]] * n,
        eos_token_ids=eos,
        device="cpu",
    )


def random_logits(n: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


sampler = Sampler()


def test_greedy_is_argmax_and_skips_everything() -> None:
    logits = random_logits(6)
    meta = meta_for([SamplingParams(temperature=0.0)] * 6)
    assert meta.all_greedy and meta.temperature is None and meta.top_k is None
    assert meta.output_token_ids is None
    out = sampler(logits, meta)
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_input_logits_are_not_modified() -> None:
    logits = random_logits(3)
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, repetition_penalty=1.3,
                             presence_penalty=0.5, min_tokens=2, logprobs=3)] * 3
    sampler(logits, meta_for(params, outputs=[[1, 2]] * 3, prompts=[[3]] * 3, eos=[0, 0, 0]))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.5, top_p=1e-6),
    SamplingParams(temperature=1.0, min_p=1.0),
])
def test_degenerate_filters_equal_greedy(params: SamplingParams) -> None:
    logits = random_logits(8, seed=1)
    for _ in range(5):
        assert sampler(logits, meta_for([params] * 8)).sampled_token_ids == logits.argmax(-1).tolist()


def test_mixed_greedy_and_random_rows() -> None:
    logits = random_logits(4, seed=2)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0), SamplingParams(temperature=2.0)]
    meta = meta_for(params)
    assert not meta.all_greedy and not meta.all_random
    for _ in range(5):
        out = sampler(logits, meta).sampled_token_ids
        assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_top_k_top_p_reference() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0],
                           [1.0, 4.0, 3.0, 2.0, 0.0],
                           [1.0, 4.0, 3.0, 2.0, 0.0]])
    probs = torch.softmax(logits[0], -1)  # sorted: 4 (0.64), 3 (0.24), 2 (0.09), 1, 0
    top_k = torch.tensor([2, 0, 0])
    top_p = torch.tensor([1.0, float(probs[1]) + 1e-3, float(probs[1]) - 1e-3])
    out = apply_top_k_top_p(logits.clone(), top_k, top_p)
    kept = torch.isfinite(out)
    assert kept.tolist() == [[False, True, True, False, False],   # k = 2
                             [False, True, True, False, False],   # 0.64 is just short of p: add 0.24
                             [False, True, False, False, False]]  # 0.64 alone reaches p
    assert torch.equal(out[kept], logits[kept])  # kept logits unchanged


def test_min_p_reference() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = apply_min_p(logits.clone(), torch.tensor([0.5, 0.0]))
    assert torch.isfinite(out).tolist() == [[True, True, False, False], [True] * 4]


def reference_penalties(logits: list[float], prompt: list[int], output: list[int],
                        rep: float, freq: float, pres: float) -> list[float]:
    result = list(logits)
    for t in set(prompt) | set(output):
        result[t] = result[t] / rep if result[t] > 0 else result[t] * rep
    for t in set(output):
        result[t] -= freq * output.count(t) + pres
    return result


def test_penalties_match_reference() -> None:
    logits = random_logits(3, vocab=8, seed=3)
    prompts = [[1, 2, 2], [0], [5]]
    outputs = [[2, 3, 3, 3], [4, 4], []]
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams(frequency_penalty=-0.5),  # no repetition penalty: the prompt is ignored
              SamplingParams()]
    meta = meta_for(params, prompts=prompts, outputs=outputs)
    out = apply_penalties(logits.clone(), meta)
    for row, p in enumerate(params):
        expected = reference_penalties(logits[row].tolist(), prompts[row], outputs[row],
                                       p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        assert out[row].tolist() == pytest.approx(expected, abs=1e-6)
    assert not torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])


def test_repetition_penalty_steers_greedy() -> None:
    logits = torch.tensor([[3.0, 2.9, -1.0, -1.1]])
    meta = meta_for([SamplingParams(temperature=0.0, repetition_penalty=2.0)], prompts=[[0, 2]], outputs=[[]])
    assert sampler(logits, meta).sampled_token_ids == [1]  # 3.0/2 < 2.9


def test_no_penalties_skip_the_stage() -> None:
    meta = meta_for([SamplingParams(temperature=1.0)], outputs=[[1, 2]])
    assert meta.output_token_ids is None and meta.repetition_penalty is None


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.full((4, 6), -5.0)
    logits[:, 0] = 10.0  # EOS wins unless masked
    logits[:, 1] = 9.0  # a stop token id, next best
    logits[:, 2] = 8.0
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1]),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1]),
              SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])]
    outputs = [[5], [5, 5, 5], [5], [5]]
    out = sampler(logits, meta_for(params, outputs=outputs, eos=[0, 0, 0, [0, 2]])).sampled_token_ids
    assert out == [2, 0, 0, 3]  # row 2 ignores EOS, so EOS is not masked; row 3 has two EOS ids


def test_min_tokens_masks_extra_stop_ids() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    params = SamplingParams(temperature=0.0, min_tokens=1, extra_stop_token_ids=[1])
    assert sampler(logits, meta_for([params], eos=[None])).sampled_token_ids == [2]


def run_steps(params: list[SamplingParams], seeds: list[int | None], row_logits: list[torch.Tensor],
              steps: int) -> list[list[int]]:
    """Sample `steps` tokens per row, each row with its own fixed logits, all rows in one batch."""
    gens = [gen(s) if s is not None else None for s in seeds]
    outputs: list[list[int]] = [[] for _ in params]
    logits = torch.stack(row_logits)
    for _ in range(steps):
        meta = meta_for(params, generators=gens, outputs=outputs)
        for row, token in enumerate(sampler(logits, meta).sampled_token_ids):
            outputs[row].append(token)
    return outputs


def test_seeded_rows_do_not_depend_on_batch_mates() -> None:
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=7, presence_penalty=0.3)
    target_logits = random_logits(1, seed=10)[0]
    alone = run_steps([target], [7], [target_logits], steps=12)[0]

    others = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.2),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=3)]
    other_logits = list(random_logits(4, seed=11))
    torch.manual_seed(123)
    first = run_steps([target] + others, [7, 1, None, None, None], [target_logits] + other_logits, steps=12)
    torch.manual_seed(456)  # the unseeded rows now draw different noise
    middle = run_steps(others[:2] + [target] + others[2:], [1, None, 7, None, None],
                       other_logits[:2] + [target_logits] + other_logits[2:], steps=12)
    assert first[0] == alone and middle[2] == alone
    assert len(set(alone)) > 1  # really random, not collapsed to greedy


def test_different_seeds_differ() -> None:
    params = [SamplingParams(temperature=1.0)] * 2
    logits = [torch.zeros(V)] * 2
    a, b = run_steps(params, [1, 2], logits, steps=20)
    assert a != b


def test_logprobs_from_raw_distribution() -> None:
    logits = random_logits(4, seed=5)
    raw = torch.log_softmax(logits, dim=-1)
    params = [SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.2, logprobs=5),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0, logprobs=2)]
    out = sampler(logits, meta_for(params, prompts=[[1, 2], [], [], []], outputs=[[3], [], [], []]))
    assert out.logprobs is not None and out.logprobs[2] is None
    for row, k in [(0, 5), (1, 0), (3, 2)]:
        entry = out.logprobs[row]
        token = out.sampled_token_ids[row]
        ids = list(entry)
        assert ids[0] == token  # the sampled token comes first
        assert entry[token].logprob == pytest.approx(raw[row, token].item(), abs=1e-5)
        assert entry[token].rank == int((raw[row] > raw[row, token]).sum()) + 1
        top = raw[row].topk(k)
        expected_top = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        alternatives = {t: lp for t, lp in entry.items() if t != token or t in expected_top}
        assert set(alternatives) == set(expected_top)
        for t, lp in expected_top.items():
            assert entry[t].logprob == pytest.approx(lp, abs=1e-5)
        ranked = sorted((lp.rank, t) for t, lp in entry.items() if t in expected_top)
        values = [entry[t].logprob for _, t in ranked]
        assert values == sorted(values, reverse=True)  # top-k sorted best first
        assert [r for r, _ in ranked] == list(range(1, k + 1))
    assert len(out.logprobs[1]) == 1  # logprobs=0: the sampled token only


def test_bfloat16_logits() -> None:
    logits = random_logits(3).to(torch.bfloat16)
    out = sampler(logits, meta_for([SamplingParams(temperature=0.0, logprobs=1)] * 3))
    assert out.sampled_token_ids == logits.float().argmax(-1).tolist()


def draw_frequencies(logits: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    torch.manual_seed(0)
    batch = logits.unsqueeze(0).expand(draws, -1).contiguous()
    tokens = sampler(batch, meta_for([params] * draws)).sampled_token_ids
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[0]).float() / draws


TOP_TWO = [0.0, 0.0, 1 / (1 + math.e), math.e / (1 + math.e)]  # softmax over logits 2 and 3 only


@pytest.mark.parametrize(("params", "expected"), [
    (SamplingParams(temperature=0.7), None),
    (SamplingParams(temperature=1.0, top_k=2), TOP_TWO),
    (SamplingParams(temperature=1.0, top_p=0.7), TOP_TWO),  # 0.64 < 0.7 <= 0.64 + 0.24
])
def test_sampling_frequencies_match_probabilities(
    params: SamplingParams, expected: list[float] | None
) -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    target = torch.softmax(logits / params.temperature, -1) if expected is None else torch.tensor(expected)
    freq = draw_frequencies(logits, params, draws=20000)
    # 20000 draws: the standard error is below 0.004, so 0.03 cannot flake.
    assert torch.allclose(freq, target, atol=0.03), (freq, target)


def test_seeded_frequencies_match_probabilities() -> None:
    """A single seeded row over many steps samples the same distribution."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    g = gen(3)
    params = [SamplingParams(temperature=1.0, seed=3)]
    counts = torch.zeros(4)
    for _ in range(3000):
        meta = meta_for(params, generators=[g])
        counts[sampler(logits, meta).sampled_token_ids[0]] += 1
    assert torch.allclose(counts / 3000, torch.softmax(logits[0], -1), atol=0.04)


def test_build_validates_row_counts() -> None:
    with pytest.raises(ValueError, match="generators has 1 rows but params has 2"):
        SamplingMetadata.build([SamplingParams()] * 2, [None], [[], []], [[], []], "cpu")
    with pytest.raises(ValueError, match="logits must be"):
        sampler(torch.zeros(3, V), meta_for([SamplingParams()] * 2))
