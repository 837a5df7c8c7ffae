"""Every check of a request in one place: the typed request the engine core queues as it is, the caps the
offline API now shares with the server, and token ids checked whichever way they arrive."""

from __future__ import annotations

import asyncio

import pytest

from tideserve import SamplingParams
from tideserve.engine.async_engine import AsyncEngine
from tideserve.engine.input_processor import MAX_N
from tideserve.errors import InvalidParameterError
from tideserve.pooling_params import PoolingParams

SMALL = {"dtype": "float32", "max_model_len": 64}


@pytest.fixture(scope="module")
def llm(shared_model):
    from tideserve import LLM

    return LLM.from_loaded(*shared_model(**SMALL), **SMALL)


def test_a_checked_request_carries_what_the_core_needs(llm):
    processor = llm.engine.input_processor
    request = processor.process("The capital of France is", SamplingParams(max_tokens=None, n=2))
    assert request.prompt == "The capital of France is" and request.prompt_token_ids
    assert request.max_tokens == 64 - len(request.prompt_token_ids)  # the room left in the context
    embedding = processor.process([1, 2, 3], PoolingParams())
    assert embedding.is_embedding and embedding.max_tokens == 0 and embedding.params.pooling.dimensions


def test_the_offline_api_has_the_servers_caps(llm):
    with pytest.raises(InvalidParameterError, match=f"n must be <= {MAX_N}, got 500") as raised:
        llm.generate("Hi", SamplingParams(n=500))
    assert raised.value.param == "n"
    with pytest.raises(ValueError, match="Requested sample logprobs of 21, which is greater than max allowed: 20"):
        llm.generate("Hi", SamplingParams(logprobs=21))
    assert not llm.engine.has_unfinished_requests()  # nothing was added


def test_request_names_reach_the_messages(llm):
    processor = llm.engine.input_processor
    names = {"prompt": "messages", "max_tokens": "max_completion_tokens", "logprobs": "top_logprobs"}
    with pytest.raises(InvalidParameterError, match=r"max_completion_tokens=500 is too large") as raised:
        processor.process([1, 2, 3], SamplingParams(max_tokens=500), names=names)
    assert raised.value.param == "max_completion_tokens" and "3 in the messages" in str(raised.value)
    with pytest.raises(InvalidParameterError) as raised:
        processor.process([1, 2, 3], SamplingParams(logprobs=99), names=names)
    assert raised.value.param == "top_logprobs"
    with pytest.raises(InvalidParameterError, match="n must be <= 2"):
        processor.process([1, 2, 3], SamplingParams(n=3), max_n=2)  # a server may lower the cap


def test_token_ids_given_beside_a_prompt_are_checked_too(llm):
    """``prompt_token_ids`` were once trusted as given; now they are checked like a token-id prompt."""
    engine = AsyncEngine(llm.engine)
    try:
        async def add() -> None:
            await engine.add_request("text", SamplingParams(max_tokens=2), prompt_token_ids=[5, 10**8])

        with pytest.raises(ValueError, match=r"prompt token id 100000000 is out of range"):
            asyncio.run(add())
        with pytest.raises(ValueError, match="prompt must not be empty"):
            llm.engine.add_request("text", SamplingParams(), prompt_token_ids=[])
    finally:
        engine.shutdown(timeout=5)
