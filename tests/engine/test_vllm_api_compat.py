"""The Python calls the seeds copy from vLLM: ``AsyncLLMEngine.from_engine_args({...})``,
``LLMEngine.from_engine_args``, ``LLM(tensor_parallel_size=..., enforce_eager=...)``, sizes with units.
Multi-device layouts and foreign checkpoint formats fail before anything loads, saying what to do."""

from __future__ import annotations

import asyncio

import pytest

import tideserve
from tideserve import LLM, AsyncEngine, AsyncLLMEngine, EngineArgs, LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
SMALL = {"dtype": "float32", "max_model_len": 256, "num_blocks": 32}


@pytest.mark.slow
def test_async_llm_engine_from_a_dict_as_in_the_seed():
    assert issubclass(AsyncLLMEngine, AsyncEngine) and "AsyncLLMEngine" in tideserve.__all__
    # seed 004: AsyncLLMEngine.from_engine_args({"model": ..., "tensor_parallel_size": 2, "max_num_seqs": 512,
    # "enable_chunked_prefill": True}), with the embedded model and one device
    engine = AsyncLLMEngine.from_engine_args({**SMALL, "tensor_parallel_size": 1, "max_num_seqs": 512,
                                              "enable_chunked_prefill": True}, log_stats_interval=None)
    try:
        async def generate(prompt: str) -> str:
            text = ""
            async for result in engine.generate(prompt, GREEDY, request_id=f"req-{hash(prompt)}"):
                text = result.outputs[0].text
            return text

        async def main() -> list[str]:
            return await asyncio.gather(*(generate(p) for p in ["写一首关于春天的诗", "The capital of France is"]))

        outputs = asyncio.run(asyncio.wait_for(main(), 60))
        assert len(outputs) == 2 and all(outputs)
        assert engine.engine.scheduler_config.max_num_seqs == 512 and engine.num_active() == 0
    finally:
        engine.shutdown(5)


def test_multi_device_settings_beyond_tensor_parallelism_are_explained():
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 .*Pipeline parallelism is not implemented"):
        LLMEngine.from_engine_args(EngineArgs(pipeline_parallel_size=4))
    with pytest.raises(ValueError, match="data_parallel_size=2 .*one tideserve server per device"):
        LLM(data_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        LLMEngine.from_engine_args({"tensor_parallel_size": 0})
    # seed 004's LLM(model=..., tensor_parallel_size=2): accepted; here the hub model is what cannot load
    with pytest.raises(ValueError, match="Llama-2-7b-chat-hf") as info:
        LLM(model="meta-llama/Llama-2-7b-chat-hf", tensor_parallel_size=2, max_num_seqs=256, max_model_len=8192)
    assert "tensor_parallel" not in str(info.value)


def test_from_engine_args_refuses_unknown_keys_and_other_types():
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\): \['tensor_parallel'\]; known: .*"
                                         r"tensor_parallel_size"):
        AsyncLLMEngine.from_engine_args({"tensor_parallel": 1})
    with pytest.raises(ValueError, match="must be an EngineArgs or a dict of its fields, got list"):
        LLMEngine.from_engine_args(["model"])


def test_foreign_checkpoint_quantization_is_explained():
    # seed 001: LLM(model=..., quantization="awq", enforce_eager=True)
    with pytest.raises(ValueError, match=r"quantization='awq' is not supported: tideserve cannot read awq "
                                         r"checkpoints.*use a GGUF export of the model"):
        LLM(model="meta-llama/Llama-2-70b-chat-hf", quantization="awq", enforce_eager=True)
    with pytest.raises(ValueError, match="quantization must be one of auto, none, gguf, int8, int4, got 'int3'"):
        LLM(quantization="int3")


def test_vllm_spellings_are_accepted(make_llm, shared_model):
    llm = make_llm(**{**SMALL, "dtype": "float"}, enforce_eager=True, swap_space="512MiB", quantization=None)
    assert llm.engine.dtype.itemsize == 4 and llm.engine.cache_config.swap_space == 0.5
    assert llm.generate("The capital of France is", GREEDY)[0].outputs[0].text
    args = {**SMALL, "swap_space": "16G", "kv_cache_memory": None}  # a dict, as from_engine_args takes
    engine = LLMEngine.from_loaded(args, *shared_model(args))
    assert engine.cache_config.swap_space == 16.0
    assert EngineArgs(swap_space=4).configs()[1].swap_space == 4.0  # a bare number means GiB, as in vLLM
    assert EngineArgs(kv_cache_memory="512M").configs()[1].kv_cache_memory == 512 * 2**20
    assert EngineArgs(kv_cache_memory="2Gi").configs()[1].kv_cache_memory == 2 * 2**30
    assert EngineArgs(kv_cache_memory="1.5GB").configs()[1].kv_cache_memory == 1_500_000_000
    for bad in ("lots", "-1G", "inf", "nanG"):
        with pytest.raises(ValueError, match="must be a size such as"):
            EngineArgs(swap_space=bad).configs()
        with pytest.raises(ValueError, match="kv_cache_memory must be a size such as"):
            EngineArgs(kv_cache_memory=bad).configs()


def test_vllm_prompt_dicts_are_prompts(make_llm):
    """vLLM's TextPrompt and TokensPrompt dicts, alone or in a list, give what the plain forms give; a dict
    with a field we would drop (multi-modal data) or neither field is refused before anything runs."""
    llm = make_llm(**SMALL)
    text = "The capital of France is"
    ids = llm.tokenizer.encode(text)
    want = llm.generate(text, GREEDY)[0].outputs[0].token_ids
    assert llm.generate({"prompt": text}, GREEDY)[0].outputs[0].token_ids == want
    both = llm.generate([{"prompt_token_ids": ids}, {"prompt": text}], GREEDY)
    assert [o.outputs[0].token_ids for o in both] == [want, want]
    assert both[0].prompt_token_ids == ids
    for bad, match in [({"prompt": text, "multi_modal_data": {}}, "unsupported key.*'multi_modal_data'"),
                       ({}, "exactly one of"), ({"prompt": text, "prompt_token_ids": ids}, "exactly one of"),
                       ({"prompt_token_ids": "abc"}, "must be a list of token ids"),
                       ({"prompt": ids}, "'prompt' must be a string")]:
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt": text}, bad], GREEDY)
    assert not llm.engine.has_unfinished_requests()
