"""Engines built over an already loaded model: ``LLM.from_loaded``, ``LLMEngine.from_loaded`` and
``AsyncEngine.from_loaded`` share the weights, own their KV memory, and refuse settings that do not
describe the loaded model. The suite shares models this way only: no test patches the loaders."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tideserve import LLM, AsyncEngine, LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = ["The capital of France is", "Paged attention is"]


def test_engines_on_one_loaded_model_share_weights_and_own_their_kv(shared_model):
    loaded, tokenizer = shared_model(dtype="float32")
    a = LLM.from_loaded(loaded, tokenizer, max_model_len=256, num_blocks=64)
    b = LLM.from_loaded(loaded, tokenizer, max_model_len=256, block_size=32, num_blocks=16,
                        enable_prefix_caching=False)
    assert a.engine.model is b.engine.model is loaded.model and a.tokenizer is tokenizer
    assert (a.engine.executor.driver_worker.kv_storage.caches[0][0].data_ptr()
            != b.engine.executor.driver_worker.kv_storage.caches[0][0].data_ptr())
    assert (a.engine.kv_manager.block_size, b.engine.kv_manager.block_size) == (16, 32)
    outs_a = [o.outputs[0].token_ids for o in a.generate(PROMPTS, GREEDY)]
    assert outs_a == [o.outputs[0].token_ids for o in b.generate(PROMPTS, GREEDY)]
    assert all(len(t) == GREEDY.max_tokens for t in outs_a)
    # Settings left at auto take the loaded model's; an explicit one that agrees is accepted.
    engine = LLMEngine.from_loaded({"max_model_len": 128, "num_blocks": 16, "dtype": "float",
                                    "model": loaded.path}, loaded)
    assert engine.dtype == loaded.dtype and engine.model_name == loaded.name and engine.quantization == "none"


@pytest.mark.parametrize(("setting", "message"), [
    ({"dtype": "bfloat16"}, "dtype='bfloat16' does not match the loaded model, which computes in float32"),
    ({"quantization": "int4"}, "quantization='int4' does not match the loaded model (quantization 'none')"),
    ({"model": "/nowhere/other.gguf"}, "model='/nowhere/other.gguf' does not match the loaded model"),
    ({"device": "cuda"}, "device='cuda' does not match the loaded model, whose weights are on cpu"),
])
def test_settings_that_contradict_the_loaded_model_are_refused(shared_model, setting, message):
    loaded, tokenizer = shared_model(dtype="float32")
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM.from_loaded(loaded, tokenizer, max_model_len=128, num_blocks=16, **setting)
    with pytest.raises(ValueError, match=re.escape(message)):
        AsyncEngine.from_loaded({"max_model_len": 128, "num_blocks": 16, **setting}, loaded, tokenizer)


def test_no_test_patches_the_model_or_tokenizer_loaders():
    """Tests share models through ``shared_model`` / ``make_llm``, not by replacing module globals."""
    loaders = "|".join(["load" + "_model", "load" + "_tokenizer", "Load" + "edModel"])
    patch = re.compile(r"setattr\([^)]*['\"](" + loaders + r")['\"]")
    offenders = [str(path) for path in Path(__file__).parents[1].rglob("*.py") if patch.search(path.read_text())]
    assert not offenders, offenders
