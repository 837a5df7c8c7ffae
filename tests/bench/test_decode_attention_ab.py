"""benchmarks/decode_attention_ab.py's block placements: each must put the KV where its name says, or the
split of decode attention into memory and arithmetic that it measures means nothing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def ab():
    """benchmarks/ is not a package: load the script by its path (it imports kernel_ab by name)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("decode_attention_ab", BENCHMARKS / "decode_attention_ab.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_shuffled_and_consecutive_give_every_request_its_own_blocks(ab):
    gen = torch.Generator().manual_seed(0)
    for placement in ("shuffled", "consecutive", "one-layer"):
        tables = ab.block_tables(placement, 8, 5, gen)
        assert tables.shape == (8, 5)
        assert sorted(tables.flatten().tolist()) == list(range(40)), placement
    assert torch.equal(ab.block_tables("consecutive", 8, 5, gen), torch.arange(40).view(8, 5))
    shuffled = ab.block_tables("shuffled", 8, 5, gen)
    assert not torch.equal(shuffled, torch.arange(40).view(8, 5))  # scattered, not in order


def test_hot_has_every_request_read_the_same_few_blocks(ab):
    tables = ab.block_tables("hot", 8, 5, torch.Generator().manual_seed(0))
    assert tables.shape == (8, 5)
    assert all(torch.equal(row, torch.arange(5)) for row in tables)
