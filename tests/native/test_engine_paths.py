"""Engine level: the bfloat16 model (what ``LLM()`` picks on CPUs with native bf16) decodes through the native
kernels, and its greedy output follows the torch path's; the torch-only path (TIDESERVE_NATIVE=0) still runs.

How close "follows" must be: a bfloat16 model's logits are bfloat16 numbers, 0.125 apart at magnitudes 16-32,
and two correct implementations whose float32 sums differ in the last bits (the kernel keeps attention
weights in float32; torch's bf16 attention does not) can move a logit by one such step. Where the best two
logits are that close, greedy decoding may pick either, and the continuations part. So: the two paths must
give the same tokens up to their first difference, and at that position each path must rank the other's
token second, within two bf16 steps (0.25) of its own pick. Anything else is a real disagreement.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from tideserve import LLM, SamplingParams, native
from tideserve.model.layers.norm import RMSNorm
from tideserve.model.loader import resolve_dtype

pytestmark = [pytest.mark.skipif(native.load_library() is None, reason="no C compiler to build the kernels"),
              pytest.mark.slow]  # the model end to end for seconds: `make test` runs it

QUESTIONS = ["What is the boiling point of water?", "Who wrote Hamlet?", "Why is the sky blue?",
             "Write a haiku about the sea."]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
BF16_TIE = 0.25  # two bf16 steps of a logit in [16, 32)


def generate(llm: LLM) -> list:
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    return [o.outputs[0] for o in llm.generate(prompts, GREEDY)]


def decode_attention_line(caplog: pytest.LogCaptureFixture) -> str:
    lines = [r.getMessage() for r in caplog.records if "decode attention:" in r.getMessage()]
    assert len(lines) == 1
    return lines[0]


@pytest.fixture(scope="module")
def torch_path() -> Iterator[tuple[list, str]]:
    """Greedy outputs of the bf16 model with TIDESERVE_NATIVE=0, and its start-up line."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDESERVE_NATIVE", "0")
        native.load_library.cache_clear()
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        engine_logger = logging.getLogger("tideserve.engine.builder")
        engine_logger.addHandler(handler)
        level = engine_logger.level
        engine_logger.setLevel(logging.INFO)
        try:
            assert native.load_library() is None
            # Its own load, outside the shared models: its norms are bound to torch when it loads.
            llm = LLM(dtype="bfloat16", enable_prefix_caching=False, max_model_len=256)
            outputs = generate(llm)
        finally:
            engine_logger.removeHandler(handler)
            engine_logger.setLevel(level)
            native.load_library.cache_clear()
    line = next(r.getMessage() for r in records if "decode attention:" in r.getMessage())
    yield outputs, line
    native.load_library.cache_clear()


def test_torch_only_path_still_runs(torch_path):
    outputs, line = torch_path
    assert line.endswith("decode attention: torch")
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outputs)


def test_bf16_native_greedy_follows_the_torch_path(make_llm, torch_path, caplog):
    caplog.set_level(logging.INFO)
    llm = make_llm(dtype="bfloat16", enable_prefix_caching=False, max_model_len=256)
    assert llm.engine.dtype == llm.engine.kv_dtype == llm.engine.executor.driver_worker.runner.kv_caches[0][0].dtype
    assert str(llm.engine.dtype) == "torch.bfloat16"
    assert "decode attention: cpu-native (native kernel" in decode_attention_line(caplog)
    # Every kernel bound at load: the backend's rotary + store and decode attention, every norm's pass.
    backend = llm.engine.executor.driver_worker.runner.attn_backend
    assert backend.name == "cpu-native" and backend.rope_store is not None
    norms = [m for m in llm.engine.executor.driver_worker.runner.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m._kernels is not None for m in norms)
    calls = []
    kernel = backend._paged_decode
    backend._paged_decode = lambda *a: calls.append(True) or kernel(*a)
    ours = generate(llm)
    assert len(calls) >= (GREEDY.max_tokens - 1) * llm.engine.arch.num_hidden_layers

    theirs, _ = torch_path
    for mine, other in zip(ours, theirs, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(mine.token_ids, other.token_ids)) if a != b), None)
        if n is None:
            continue
        a, b = mine.token_ids[n], other.token_ids[n]
        for top in (mine.logprobs[n], other.logprobs[n]):
            assert a in top and b in top, f"token {n}: {a} against {b} is not a near tie ({top})"
            assert abs(top[a].logprob - top[b].logprob) <= BF16_TIE, f"token {n}: {top}"


def test_default_dtype_runs_the_native_kernels(make_llm, caplog):
    """Whatever ``LLM()`` picks here (bf16 with AMX / AVX512-BF16, else float32), decode is native. (The dtype
    is passed by name only so the model loaded for the other tests is reused.)"""
    caplog.set_level(logging.INFO)
    auto = str(resolve_dtype("auto", "cpu")).removeprefix("torch.")
    llm = make_llm(dtype=auto, enable_prefix_caching=False, max_model_len=256)
    assert llm.engine.executor.driver_worker.runner.attn_backend.name == "cpu-native"
    assert "decode attention: cpu-native (native kernel" in decode_attention_line(caplog)
