"""Benchmark workloads: exact, seeded, and the same tokens for HTTP and in-process engines."""

from __future__ import annotations

import pytest

from tideserve.bench.datasets import build_requests


@pytest.fixture(scope="module")
def tokenizer(tokenizer_path):
    from tideserve.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_path)


def test_random_prompts_reencode_to_their_exact_lengths(tokenizer):
    reqs = build_requests(tokenizer, "random", 8, input_len=40, output_len=10, range_ratio=0.5, seed=3)
    for r in reqs:
        assert tokenizer.encode(r.prompt) == r.prompt_token_ids  # what a server tokenizes = what we feed
        assert 20 <= r.prompt_len <= 60 and 5 <= r.output_len <= 15
    again = build_requests(tokenizer, "random", 8, input_len=40, output_len=10, range_ratio=0.5, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]  # seeded


def test_shared_prefix_leads_every_prompt(tokenizer):
    reqs = build_requests(tokenizer, "random", 4, input_len=8, output_len=4, prefix_len=64, seed=1)
    head = reqs[0].prompt_token_ids[:60]  # the boundary token may merge with the suffix
    assert all(r.prompt_token_ids[:60] == head for r in reqs)
    assert all(r.prompt_len == 72 for r in reqs)


def test_mixed_lengths_stay_in_range(tokenizer):
    reqs = build_requests(tokenizer, "mixed", 16, seed=0)
    assert all(20 <= r.prompt_len <= 1000 and 16 <= r.output_len <= 512 for r in reqs)
    assert len({r.output_len for r in reqs}) > 8  # actually mixed


def test_prompts_file_errors_name_the_problem(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="needs --dataset-path"):
        build_requests(tokenizer, "prompts-file", 2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        build_requests(tokenizer, "prompts-file", 2, dataset_path=str(bad))
    with pytest.raises(ValueError, match="num_prompts=0"):
        build_requests(tokenizer, "random", 0)
