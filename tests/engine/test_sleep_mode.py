"""Sleep mode through the offline API: an idle engine gives its weights and KV pool back to the system
(the process's resident set falls to what the interpreter, torch and the tokenizer hold), refuses
requests while asleep, and answers exactly as before once woken, at either level; a busy engine is not
put to sleep."""

from __future__ import annotations

import pytest

from tideserve import LLM, SamplingParams
from tideserve.errors import EngineBusyError, EngineSleepingError
from tideserve.platform.host_memory import process_rss_bytes

pytestmark = pytest.mark.slow  # the model end to end for seconds: `make test` runs it, `-m 'not slow'` does not

MiB = 2**20
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # Its own load, not the shared model: sleeping drops the weights this engine alone holds.
    return LLM(max_model_len=512, enable_sleep_mode=True)


def prompts() -> list[str]:
    return [f"Question {i}: tell me about the harbour and its ferries. " * 6 for i in range(16)]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def solo(llm: LLM) -> list[list[int]]:
    """Greedy answers of a few prompts, each run alone: the same kernels whatever the pool did before (a
    request's tokens may still depend on its batch-mates by rounding)."""
    return [tokens(llm.generate(p, GREEDY))[0] for p in prompts()[:3]]


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    return solo(llm)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_gives_the_memory_back_and_waking_answers_the_same(llm, reference, level):
    llm.generate(prompts(), GREEDY)  # a burst: the pool has grown, the heap holds activations
    engine = llm.engine
    store = engine.executor.driver_worker.kv_storage.device_store
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    awake = process_rss_bytes()
    llm.sleep(level)
    asleep = process_rss_bytes()
    assert llm.is_sleeping() and engine.stats().sleep_level == level
    assert engine.model is None  # the weights are dropped (the CPU's weights are host memory: nothing to keep)
    assert store.committed_bytes == 0 or store._ahead_target == 0 and store.num_blocks == engine.pool.min_blocks
    assert awake - asleep > 0.8 * weights, (awake / MiB, asleep / MiB, weights / MiB)
    with pytest.raises(EngineSleepingError, match=f"asleep \\(sleep level {level}"):
        llm.generate(prompts()[:1], GREEDY)
    llm.wake_up()
    assert not llm.is_sleeping() and engine.stats().sleep_level == 0
    assert solo(llm) == reference


def test_waking_in_parts_and_sleeping_deeper(llm, reference):
    llm.sleep(1)
    llm.sleep(1)  # already asleep at that level: nothing to do
    llm.wake_up(["weights"])
    assert llm.is_sleeping() and llm.engine.model is not None  # the KV pool is still released
    with pytest.raises(EngineSleepingError, match="kv_cache released"):
        llm.generate(prompts()[:1], GREEDY)
    llm.sleep(2)  # deeper: the weights go again
    assert llm.engine.model is None and llm.engine.sleep_level == 2
    llm.wake_up(["kv_cache"])
    llm.wake_up(["weights"])
    assert solo(llm) == reference


def test_a_busy_engine_is_not_put_to_sleep(llm):
    llm.engine.add_request("Once upon a time", SamplingParams(max_tokens=4))
    with pytest.raises(EngineBusyError, match="in flight \\(0 running, 1 waiting\\)"):
        llm.sleep(1)
    assert not llm.is_sleeping()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def test_bad_sleep_arguments_and_an_engine_without_sleep_mode(llm, make_llm):
    with pytest.raises(ValueError, match="level must be 1 or 2, got 3"):
        llm.sleep(3)
    with pytest.raises(ValueError, match="tags must be weights and/or kv_cache, got \\['gpu'\\]"):
        llm.wake_up(["gpu"])
    with pytest.raises(ValueError, match="sleep mode is not enabled.*--enable-sleep-mode"):
        make_llm(dtype="float32", max_model_len=128).sleep(1)
