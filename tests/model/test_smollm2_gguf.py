"""The real default model: our float32 load of the SmolLM2 Q4_1 GGUF against transformers' load of the same
file. Matching greedy tokens and logits proves dequantization, the Q/K un-permutation and the metadata."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tideserve.model.llama import LlamaForCausalLM

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4,",
    CHAT.format("What is the tallest mountain on Earth?"),
    CHAT.format("Write a haiku about autumn leaves."),
    CHAT.format("Explain what a hash table is in two sentences."),
    "Q",  # a one-token prompt goes through the decode path from the first step
]
NEW_TOKENS = 32


def _greedy(model: LlamaForCausalLM, prompt: list[int], paged_cache: Any) -> list[int]:
    """One request, prefill then decodes, argmax each step, through the paged cache (block size 16)."""
    cache = paged_cache(model.arch, num_blocks=(len(prompt) + NEW_TOKENS) // 16 + 2, block_size=16)
    chunk = prompt
    out: list[int] = []
    while len(out) < NEW_TOKENS:
        ids, positions, meta = cache.step([("r", chunk)])
        logits = model.compute_logits(model(ids, positions, cache.kv_caches, meta)[-1:])
        out.append(int(logits.argmax(-1)))
        chunk = out[-1:]
    return out


def _hf_greedy(hf_model: Any, prompt: list[int], pad_id: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=pad_id)
    return gen[0, len(prompt):].tolist()


def test_arch_from_gguf_metadata(smollm2_f32: Any) -> None:
    arch = smollm2_f32.arch
    assert smollm2_f32.name == "SmolLM2-135M-Instruct.Q4_1"
    assert (arch.architecture, arch.num_hidden_layers, arch.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (9, 3, 64)
    assert (arch.vocab_size, arch.intermediate_size, arch.max_position_embeddings) == (49152, 1536, 8192)
    assert arch.rope_theta == 100000.0 and arch.rope_scaling is None and arch.tie_word_embeddings
    assert arch.bos_token_id == 1 and arch.eos_token_ids == [2]


def test_prefill_logits_match_transformers(smollm2_f32: Any, hf_smollm2: tuple[Any, Any],
                                           paged_cache: Any) -> None:
    model = smollm2_f32.model
    hf_model, tokenizer = hf_smollm2
    prompt = tokenizer(PROMPTS[4]).input_ids
    cache = paged_cache(model.arch, num_blocks=8, block_size=16)
    ids, positions, meta = cache.step([("r", prompt)])
    ours = model.compute_logits(model(ids, positions, cache.kv_caches, meta))
    with torch.no_grad():
        want = hf_model(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-3)


@pytest.mark.slow
def test_greedy_generation_matches_transformers(smollm2_f32: Any, hf_smollm2: tuple[Any, Any],
                                                paged_cache: Any) -> None:
    model = smollm2_f32.model
    hf_model, tokenizer = hf_smollm2
    for text in PROMPTS:
        prompt = tokenizer(text).input_ids
        want = _hf_greedy(hf_model, prompt, tokenizer.eos_token_id)
        got = _greedy(model, prompt, paged_cache)
        # transformers stops at EOS; up to there (EOS included) the tokens must be identical
        assert got[: len(want)] == want, (
            f"prompt {text!r}: ours {tokenizer.decode(got)!r} != transformers {tokenizer.decode(want)!r}")
