"""``quantization="int8"`` and ``"int4"`` end to end on the embedded SmolLM2: the engine runs, its
predictions stay close to the float model's, and the float model it was made from (shared between
engines) is untouched."""

from __future__ import annotations

import math

import pytest
import torch

from tideserve import LLM, SamplingParams
from tideserve.model.layers.quant.methods import unavailable_reason

TEXT = ("The harbour town woke slowly. Fishing boats returned with the tide, and gulls circled above the "
        "market square where traders set out bread, cheese and rope. A teacher explained to her class how "
        "the moon pulls the water twice a day, and why the highest tides arrive near the full moon.")


def scored(llm: LLM, ids: list[int]) -> tuple[float, list[int]]:
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0))[0]
    logprobs = [entry[tok].logprob for tok, entry in zip(ids[1:], out.prompt_logprobs[1:])]
    top1 = [max(entry.items(), key=lambda kv: kv[1].logprob)[0] for entry in out.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs)), top1


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4", "gguf"])
def test_quantized_engine_stays_close_to_float_and_leaves_the_shared_model_alone(make_llm, method):
    if unavailable_reason(method, torch.device("cpu")):
        pytest.skip(unavailable_reason(method, torch.device("cpu")))
    float_llm = make_llm(dtype="float32", max_model_len=256, quantization="none")
    ids = float_llm.tokenizer.encode(TEXT)
    ref_ppl, ref_top1 = scored(float_llm, ids)

    q_llm = make_llm(dtype="float32", max_model_len=256, quantization=method)
    assert q_llm.engine.model is not float_llm.engine.model
    ppl, top1 = scored(q_llm, ids)
    agreement = sum(a == b for a, b in zip(top1, ref_top1)) / len(ref_top1)
    assert agreement >= 0.75, agreement
    assert ppl < ref_ppl * 1.25, (ppl, ref_ppl)
    out = q_llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert out.outputs[0].text.strip()

    # The float engine (same loaded model object underneath) still gives exactly what it gave before.
    assert scored(float_llm, ids) == (ref_ppl, ref_top1)


def test_quantization_is_validated(make_llm):
    with pytest.raises(ValueError, match="quantization must be one of auto, none, gguf, int8, int4, got 'fp4'"):
        make_llm(dtype="float32", max_model_len=256, quantization="fp4")
