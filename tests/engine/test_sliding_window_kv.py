"""Sliding-window layers' KV blocks allocated and freed by the window, through the engine: a tiny random Gemma 3
(five local layers per global one) whose contexts outgrow the window, small blocks so that blocks really go
back to the pool, transformers' greedy tokens on the torch and CPU-native backends (chunked prefill, a
prefix-cache hit whose window starts inside the cached prefix, recompute and swap preemption), and the KV
a running request holds, read from the engine's pool metrics, equal to the exact count the window allows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from tideserve import LLM, SamplingParams, native
from tideserve.core.kv_cache.hybrid import HybridKVCacheManager
from tideserve.model.loader import load_model

TINY: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 24, "num_hidden_layers": 6,  # layers 0-4 local, layer 5 global
}


def _save(directory: Path, window: int) -> Any:
    """A random tiny Gemma 3 with sliding ``window``, saved as an HF checkpoint."""
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(Gemma3TextConfig(**TINY, sliding_window=window),
                                                dtype=torch.float32).eval()
    hf_model.save_pretrained(directory)
    return hf_model


def _hf_greedy(hf_model: Any, prompt: list[int], steps: int) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(hf_model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str]:
    directory = tmp_path_factory.mktemp("gemma3-window8")
    return _save(directory, 8), str(directory)


def _llm(path: str, tokenizer: Any, backend: str, max_model_len: int = 128, **kwargs: Any) -> LLM:
    if backend == "cpu-native" and native.load_library() is None:
        pytest.skip("no C compiler to build the native kernels")
    return LLM.from_loaded(load_model(path, dtype="float32"), tokenizer, dtype="float32", attention_backend=backend,
                           max_model_len=max_model_len, **kwargs)


@pytest.mark.parametrize("backend", ["torch", "cpu-native"])
def test_greedy_tokens_with_window_freeing(tiny_gemma3: tuple[Any, str], backend: str, shared_model: Any) -> None:
    """Blocks of 8, window 8: 40-token prompts in 16-token chunks, then a prompt sharing 35 tokens (a 32-token
    hit: the global group's 4 blocks and the local groups' block 3, which holds keys 25-31), transformers'
    tokens, with the local groups' blocks given back as the window moves."""
    hf_model, path = tiny_gemma3
    tokenizer = shared_model(dtype="float32", quantization="none")[1]
    llm = _llm(path, tokenizer, backend, max_num_batched_tokens=16, block_size=8, enable_prefix_caching=True)
    kv = llm.engine.kv_manager
    assert isinstance(kv, HybridKVCacheManager) and kv.groups.num_groups == 6
    # Every slot NaN, as a fresh pool may hold: the null block is zeroed before it is read, any other slot is
    # written before it is read, so no NaN may reach a logit (0 * NaN would).
    storage = llm.engine.executor.driver_worker.kv_storage
    storage.device_store.fill_slots(torch.arange(storage.num_blocks * storage.block_size), float("nan"))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    first = [(5 * i + 1) % 256 for i in range(40)]
    second = first[:35] + [3, 1, 4, 1, 5]
    for prompt, cached in ((first, 0), (second, 32)):
        out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
        assert out.num_cached_tokens == cached
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf_model, prompt, 10)
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks - 1  # everything back but the null block


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_tokens(tiny_gemma3: tuple[Any, str], mode: str, shared_model: Any) -> None:
    """A pool too small for four requests at once: preempted requests (recomputed, or swapped out and back
    with only their window's blocks) still give transformers' tokens."""
    hf_model, path = tiny_gemma3
    tokenizer = shared_model(dtype="float32", quantization="none")[1]
    llm = _llm(path, tokenizer, "torch", max_model_len=64, block_size=8, num_blocks=48, preemption_mode=mode,
               swap_space=0.01, enable_prefix_caching=False)
    prompts = [[(3 * i + 7 * r) % 256 for i in range(12 + r)] for r in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf_model, prompt, 24)
    llm.engine.kv_manager.check_invariants()


def held_blocks(n: int, window: int, block_size: int, num_full: int, num_sliding: int) -> int:
    """Blocks a request holds right after the step that computes its n-th token (its computed tokens were
    n - 1, so a local layer still reads keys n - window .. n - 1): every block in a full group, the blocks
    from floor((n - window) / B) on in a sliding one. The pool also holds the null block."""
    blocks = -(-n // block_size)
    return num_full * blocks + num_sliding * (blocks - max(0, n - window) // block_size)


def test_held_kv_follows_the_window(tmp_path: Path, shared_model: Any) -> None:
    """Window 32, blocks of 8, one request at a 128-token context: the pool's metrics (used blocks, pool bytes
    over pool blocks) say it holds 1 full group x 16 blocks + 5 local groups x 4 blocks (+ the null block),
    i.e. (1/6 + 5/6 x 32/128) of the KV bytes full attention would hold, exactly."""
    window, bs, n = 32, 8, 128
    _save(tmp_path, window)
    tokenizer = shared_model(dtype="float32", quantization="none")[1]
    llm = _llm(str(tmp_path), tokenizer, "torch", max_model_len=256, block_size=bs, num_blocks=200,
               enable_prefix_caching=False)
    engine = llm.engine
    rid = engine.add_request([(11 * i + 5) % 256 for i in range(100)],
                             SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    request = engine.scheduler.requests[rid]
    while request.num_computed_tokens < n:
        engine.step()
    stats = engine.stats()
    bytes_per_block = stats.kv_cache_pool_bytes // stats.kv_cache_pool_blocks
    expected = held_blocks(n, window, bs, num_full=1, num_sliding=5)
    assert expected == 16 + 5 * 4
    assert stats.kv_cache_used_blocks == expected + 1  # + the null block
    assert stats.kv_cache_usage == pytest.approx((expected + 1) / stats.kv_cache_pool_blocks)
    # Full attention: every layer's K and V for all n tokens; a block holds one layer (6 groups of 1).
    layer_token_bytes = 2 * TINY["num_key_value_heads"] * TINY["head_dim"] * 4
    full_bytes = TINY["num_hidden_layers"] * n * layer_token_bytes
    assert bytes_per_block == bs * layer_token_bytes
    assert expected * bytes_per_block / full_bytes == pytest.approx(1 / 6 + 5 / 6 * window / n)
    engine.abort_request(rid)


def test_speculative_proposals_keep_the_tokens(tiny_gemma3: tuple[Any, str], shared_model: Any) -> None:
    """N-gram proposals verified in one step per request, rejected ones handed back in every group's table
    while the window frees the local groups' blocks: transformers' greedy tokens, and no leak."""
    hf_model, path = tiny_gemma3
    tokenizer = shared_model(dtype="float32", quantization="none")[1]
    llm = _llm(path, tokenizer, "cpu-native", block_size=8, enable_prefix_caching=True,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    prompts = [[(7 * i) % 11 + 20 * r for i in range(30)] for r in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf_model, prompt, 20)
    stats = llm.engine.scheduler.spec_stats
    assert 0 < stats.num_draft_tokens and stats.num_accepted_tokens < stats.num_draft_tokens  # some rejected
    kv = llm.engine.kv_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks - 1
