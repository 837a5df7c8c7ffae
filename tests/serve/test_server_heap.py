"""A server process freezes what start-up left, so the cyclic collector stops walking the model and the
tokenizer's objects during steps (tideserve/serve/openai/server.py)."""

from __future__ import annotations

import gc

from tideserve.serve.openai.server import _with_frozen_heap


def test_the_engine_and_what_start_up_left_are_frozen_once_the_factory_returns():
    made: list[dict] = []

    def factory() -> dict:
        vocabulary = {f"token{i}": [i] for i in range(1000)}  # tracked containers, as a tokenizer's
        made.append(vocabulary)
        return vocabulary

    before = gc.get_freeze_count()
    try:
        engine = _with_frozen_heap(factory)()
        assert engine is made[0]
        assert gc.get_freeze_count() >= before + 1000  # the vocabulary's lists at least
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
