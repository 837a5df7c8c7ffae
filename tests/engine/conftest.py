"""Engines in these tests share one loaded model and tokenizer per (path, dtype): the weights and the
tokenizer are read-only, and every engine still owns its KV cache, scheduler and runner."""

import functools

import pytest

import tideserve.engine.llm_engine as llm_engine


@pytest.fixture(scope="session", autouse=True)
def _share_loaded_models():
    mp = pytest.MonkeyPatch()
    mp.setattr(llm_engine, "load_model", functools.lru_cache(maxsize=4)(llm_engine.load_model))
    mp.setattr(llm_engine, "load_tokenizer", functools.lru_cache(maxsize=4)(llm_engine.load_tokenizer))
    yield
    mp.undo()
