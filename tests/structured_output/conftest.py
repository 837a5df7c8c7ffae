"""A grammar compiler over the embedded model's real tokenizer (49,152 tokens), shared by the module."""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path):
    from tideserve.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(str(smollm2_gguf_path))


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    from tideserve.structured_output.backend import GrammarCompiler

    c = GrammarCompiler(smollm2_tokenizer.hf, 49152, smollm2_tokenizer.stop_token_ids)
    yield c
    c.shutdown()
