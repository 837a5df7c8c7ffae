"""Embedding requests in the engine (``LLM.embed``, ``PoolingParams``): the pooled vector equals
transformers' last hidden layer pooled the same way, for tiny random Llama and Qwen2 checkpoints and the
embedded SmolLM2, however the engine splits the prompt: chunked prefill, prefix-cache hits, preemption by
recompute and by swap, batches shared with generation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from tideserve import LLM, PoolingParams, SamplingParams
from tideserve.model.loader import load_model

COMMON: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "num_hidden_layers": 2,
}
CONFIGS = {"llama": lambda: LlamaConfig(**COMMON), "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=False)}
LENGTHS = (1, 5, 37, 90, 200)


def reference(hf_model, token_ids: list[int], pooling: str, normalize: bool) -> torch.Tensor:
    with torch.no_grad():
        states = hf_model(torch.tensor([token_ids]), output_hidden_states=True).hidden_states[-1][0].float()
    vector = {"LAST": states[-1], "MEAN": states.mean(dim=0), "CLS": states[0]}[pooling]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def prompts(vocab: int, lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def vectors(outs) -> list[torch.Tensor]:
    return [torch.tensor(o.outputs.embedding) for o in outs]


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor], atol: float = 2e-5) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, i
        torch.testing.assert_close(g, w, atol=atol, rtol=1e-4, msg=lambda m, i=i: f"prompt {i}: {m}")


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory, shared_model) -> tuple[Any, Any, Any]:
    """(transformers model, our LoadedModel of its files, a tokenizer) for a random checkpoint."""
    directory: Path = tmp_path_factory.mktemp(f"embed-{request.param}")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS[request.param](), attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.1)
    hf.save_pretrained(directory)
    tokenizer = shared_model(dtype="float32", quantization="none")[1]  # prompts are token ids
    return hf.eval(), load_model(str(directory), dtype="float32"), tokenizer


def tiny_llm(tiny, **kwargs) -> LLM:
    _, loaded, tokenizer = tiny
    return LLM.from_loaded(loaded, tokenizer, dtype="float32", **kwargs)


@pytest.mark.parametrize(("pooling", "normalize"), [("LAST", True), ("MEAN", False), ("CLS", False), ("MEAN", True)])
def test_pooled_vectors_match_transformers(tiny, pooling, normalize):
    hf, _, _ = tiny
    batch = prompts(256)
    llm = tiny_llm(tiny)
    got = vectors(llm.embed(batch, PoolingParams(pooling_type=pooling, normalize=normalize)))
    assert_close(got, [reference(hf, p, pooling, normalize) for p in batch])
    norms = torch.stack([g.norm() for g in got])
    assert torch.allclose(norms, torch.ones_like(norms)) == normalize


@pytest.mark.parametrize("pooling", ["MEAN", "LAST", "CLS"])
def test_chunked_prefill_pools_every_chunk(tiny, pooling):
    """A 16-token step budget cuts the 200-token prompt into 13 chunks: MEAN must sum all of them, LAST
    must take the last chunk's last row, CLS the first chunk's first row."""
    hf, _, _ = tiny
    batch = prompts(256)
    llm = tiny_llm(tiny, max_num_batched_tokens=16, max_num_seqs=4)
    got = vectors(llm.embed(batch, PoolingParams(pooling_type=pooling, normalize=False)))
    assert_close(got, [reference(hf, p, pooling, False) for p in batch])


def test_mean_pooling_skips_the_prefix_cache_and_last_uses_it(tiny):
    """After the same prompts ran, their blocks are cached. A MEAN request that took the hit would average
    only the uncached positions; a LAST request takes it and still gets the last position's state."""
    hf, _, _ = tiny
    batch = prompts(256, lengths=(100, 150))
    llm = tiny_llm(tiny, block_size=16)
    llm.generate(batch, SamplingParams(max_tokens=1))
    stats = llm.engine.kv_manager.prefix_stats
    hits_before = stats.hits
    mean = vectors(llm.embed(batch, PoolingParams(pooling_type="MEAN", normalize=False)))
    assert stats.hits == hits_before
    assert_close(mean, [reference(hf, p, "MEAN", False) for p in batch])
    last = vectors(llm.embed(batch, PoolingParams(pooling_type="LAST")))
    assert stats.hits > hits_before
    assert_close(last, [reference(hf, p, "LAST", True) for p in batch])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_mid_prefill_the_sum_is_kept_or_restarted(tiny, mode):
    """A 200-token MEAN request is three 32-token chunks into its prefill when a higher-priority request
    takes its only seat. Recompute starts the sum again at position 0; swap copies the KV back and the sum
    continues where it stopped. Either way the vector is the uninterrupted one."""
    hf, _, _ = tiny
    prompt = prompts(256, lengths=(200,), seed=1)[0]
    kwargs = {"swap_space": 0.05} if mode == "swap" else {}
    llm = tiny_llm(tiny, scheduling_policy="priority", max_num_seqs=1, max_num_batched_tokens=32,
                   enable_prefix_caching=False, preemption_mode=mode, **kwargs)
    engine = llm.engine
    embed_id = engine.add_request(prompt, PoolingParams(pooling_type="MEAN", normalize=False),
                                  prompt_token_ids=prompt, priority=1)
    for _ in range(3):
        engine.step()
    engine.add_request([5] * 10, SamplingParams(max_tokens=4), prompt_token_ids=[5] * 10, priority=0)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.scheduler.num_preemptions == 1
    assert engine.scheduler.num_swap_ins == (1 if mode == "swap" else 0)
    torch.testing.assert_close(torch.tensor(done[embed_id].embedding), reference(hf, prompt, "MEAN", False),
                               atol=2e-5, rtol=1e-4)


def test_embeddings_share_batches_with_generation(tiny):
    """Generation beside embedding requests gives the tokens it gives alone; each vector is unchanged."""
    hf, _, _ = tiny
    gen_prompts, emb_prompts = prompts(256, lengths=(30, 60), seed=2), prompts(256, lengths=(80, 20, 120), seed=3)
    llm = tiny_llm(tiny, max_num_batched_tokens=64)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(gen_prompts, greedy)]
    engine = llm.engine
    gen_ids = [engine.add_request(p, greedy, prompt_token_ids=p) for p in gen_prompts]
    emb_ids = [engine.add_request(p, PoolingParams(pooling_type="MEAN", normalize=False), prompt_token_ids=p)
               for p in emb_prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert [done[i].outputs[0].token_ids for i in gen_ids] == alone
    assert all(done[i].embedding is None for i in gen_ids)
    for i, p in zip(emb_ids, emb_prompts):
        assert done[i].outputs[0].token_ids == [] and done[i].num_generated_tokens == 0
        torch.testing.assert_close(torch.tensor(done[i].embedding), reference(hf, p, "MEAN", False), atol=2e-5,
                                   rtol=1e-4)


def test_pooler_config_sets_the_default_and_requests_override_normalize(tiny):
    hf, _, _ = tiny
    batch = prompts(256, lengths=(40,))
    llm = tiny_llm(tiny, pooler_config='{"pooling_type": "mean", "normalize": false}')
    assert_close(vectors(llm.embed(batch)), [reference(hf, batch[0], "MEAN", False)])
    assert_close(vectors(llm.embed(batch, PoolingParams(normalize=True))), [reference(hf, batch[0], "MEAN", True)])


def test_bad_requests_are_refused_before_anything_runs(tiny):
    llm = tiny_llm(tiny, max_model_len=64)
    limit = llm.engine.max_model_len
    assert len(llm.embed([[3] * limit])[0].outputs.embedding) == 64  # an input may fill the context
    with pytest.raises(ValueError, match=f"maximum context length is {limit} tokens. However, you requested "
                                         f"{limit + 1} tokens in the input for embedding generation"):
        llm.embed([[1] * 5, [3] * (limit + 1)])
    with pytest.raises(ValueError, match="dimensions=32 is not supported: this model's embeddings have 64"):
        llm.embed([[1, 2]], PoolingParams(dimensions=32))
    assert len(llm.embed([[1, 2]], PoolingParams(dimensions=64))[0].outputs.embedding) == 64
    with pytest.raises(ValueError, match="pooling_type must be one of LAST, MEAN, CLS, got 'max'"):
        PoolingParams(pooling_type="max")
    with pytest.raises(ValueError, match="must not be empty"):
        llm.embed([[]])
    assert len(llm.embed([[1] * 70], truncate_prompt_tokens=64)[0].outputs.embedding) == 64
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_smollm2_embeddings_match_transformers(make_llm, hf_smollm2):
    """The embedded model in float32, a 300-token text chunked by a 64-token budget, beside a short one."""
    hf, hf_tokenizer = hf_smollm2
    llm = make_llm(dtype="float32", quantization="none", max_num_batched_tokens=64)
    texts = ["Paris is the capital of France.", " ".join(f"word{i}" for i in range(120))]
    ids = [llm.tokenizer.encode(t) for t in texts]
    assert ids == [hf_tokenizer(t)["input_ids"] for t in texts] and len(ids[1]) > 128
    for pooling, normalize in (("LAST", True), ("MEAN", False)):
        got = vectors(llm.embed(texts, PoolingParams(pooling_type=pooling, normalize=normalize)))
        assert_close(got, [reference(hf, p, pooling, normalize) for p in ids], atol=2e-4)


HEADLESS = {"LlamaModel": lambda: LlamaConfig(**COMMON), "Qwen2Model": lambda: Qwen2Config(**COMMON),
            "Qwen3Model": lambda: Qwen3Config(**COMMON, head_dim=32)}


@pytest.mark.parametrize("architecture", list(HEADLESS))
def test_a_headless_embedding_checkpoint_embeds_and_refuses_generation(architecture, tmp_path, shared_model):
    """Embedding models (e5-mistral, gte-Qwen2, ...) are saved as ``LlamaModel``/``Qwen2Model``/``Qwen3Model``:
    no LM head, tensors named without "model.". They load, embed as transformers' AutoModel computes, and a
    generation request is refused with what to use instead."""
    from transformers import AutoModel

    torch.manual_seed(0)
    hf = AutoModel.from_config(HEADLESS[architecture](), attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32")
    assert loaded.arch.architecture == architecture and not loaded.arch.generates
    llm = LLM.from_loaded(loaded, shared_model(dtype="float32", quantization="none")[1], dtype="float32")
    batch = prompts(256, lengths=(7, 60))
    for pooling, normalize in (("LAST", True), ("MEAN", False)):
        got = vectors(llm.embed(batch, PoolingParams(pooling_type=pooling, normalize=normalize)))
        want = []
        for p in batch:
            with torch.no_grad():
                states = hf(torch.tensor([p])).last_hidden_state[0]
            vector = states[-1] if pooling == "LAST" else states.mean(dim=0)
            want.append(torch.nn.functional.normalize(vector, dim=0) if normalize else vector)
        assert_close(got, want)
    with pytest.raises(ValueError, match=f"The model does not support generation: .* is an embedding model \\(a "
                                         f"{architecture} checkpoint, without a language-model head\\). Use "
                                         "/v1/embeddings"):
        llm.generate([batch[0]], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
