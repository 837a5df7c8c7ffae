"""The draft-model method through ``LLM(speculative_config={"model": ...})``: tiny random-weight Llama targets
and drafts saved as HF directories (driven by token ids), and the embedded SmolLM2 file as its own draft.

Whatever the draft proposes, greedy output is the target's own token for token, and a seeded sampled request
draws the tokens it draws without proposals: with the target's own weights as the draft (every proposal
accepted), a near copy (some accepted, some not) and an unrelated smaller draft (nearly all rejected); across
recompute and swap preemption and pool resizes, with the pool's blocks all back at the end. Drafts whose KV
cannot share the target's pool, or whose vocabulary differs, are refused at start with both values named."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tideserve import LLM, SamplingParams
from tideserve.model.loader import load_model

VOCAB = 256
K = 3


def _save_llama(directory: Path, *, hidden: int, heads: int, kv_heads: int = 2, layers: int = 2, vocab: int = VOCAB,
                seed: int = 0, base: torch.nn.Module | None = None, noise: float = 0.0) -> torch.nn.Module:
    """A random Llama (head size 16) saved by transformers; ``base``: its weights plus Gaussian ``noise``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16, vocab_size=vocab,
                         max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
        if base is not None:
            for p, q in zip(model.parameters(), base.parameters(), strict=True):
                p.copy_(q + noise * torch.randn_like(q))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    """Paths: the target, a copy of its files, a near copy, an unrelated smaller draft with the same KV shape
    (1 layer, 2 query heads), one with another KV shape (1 KV head) and one with another vocabulary."""
    root = tmp_path_factory.mktemp("draft_models")
    target = _save_llama(root / "target", hidden=64, heads=4)
    shutil.copytree(root / "target", root / "copy")
    _save_llama(root / "near", hidden=64, heads=4, seed=1, base=target, noise=0.01)
    _save_llama(root / "small", hidden=32, heads=2, layers=1, seed=2)
    _save_llama(root / "kv1", hidden=32, heads=2, kv_heads=1, layers=1, seed=3)
    _save_llama(root / "vocab", hidden=32, heads=2, layers=1, vocab=300, seed=4)
    return {name: str(root / name) for name in ("target", "copy", "near", "small", "kv1", "vocab")}


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf_path):
    from tideserve.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(str(smollm2_gguf_path))


@pytest.fixture(scope="module")
def target(tiny):
    return load_model(tiny["target"], dtype="float32")


def prompts(n: int = 4) -> list[dict]:
    gen = torch.Generator().manual_seed(11)
    return [{"prompt_token_ids": torch.randint(0, VOCAB, (5 + 13 * i,), generator=gen).tolist()} for i in range(n)]


def token_ids(llm: LLM, params: SamplingParams | list[SamplingParams], batch: list[dict] | None = None):
    return [o.outputs[0].token_ids for o in llm.generate(batch or prompts(), params)]


def spec_llm(target, tokenizer, draft: str, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 256)
    return LLM.from_loaded(target, tokenizer, speculative_config={"model": draft, "num_speculative_tokens": K},
                           **kwargs)


GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(target, tokenizer) -> list[list[int]]:
    return token_ids(LLM.from_loaded(target, tokenizer, max_model_len=256), GREEDY)


@pytest.mark.parametrize("draft", ["target", "copy", "near", "small"])
def test_greedy_tokens_equal_the_targets_own(target, tokenizer, tiny, reference, draft):
    llm = spec_llm(target, tokenizer, tiny[draft])
    assert token_ids(llm, GREEDY) == reference
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_drafts > 20
    if draft in ("target", "copy"):  # the target's own weights: every proposal is its next token
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    elif draft == "near":
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens / 2
    kv = llm.engine.kv_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks  # every lookahead and rejected slot went back


def test_the_targets_own_file_shares_its_weights_and_the_pool_counts_the_draft_layers(target, tokenizer, tiny):
    own = spec_llm(target, tokenizer, tiny["target"])
    runner = own.engine.executor.driver_worker.runner
    assert runner.draft_model is target.model
    assert own.engine.kv_manager.num_blocks > 0
    small = spec_llm(target, tokenizer, tiny["small"])
    layout = small.engine.executor.driver_worker.kv_storage.layout
    assert layout.num_layers == 2 + 1  # target layers, then the draft's
    plain = LLM.from_loaded(target, tokenizer, max_model_len=256)
    assert (small.engine.pool.bytes_per_block * 2 == plain.engine.pool.bytes_per_block * 3)


def test_seeded_sampling_draws_the_same_tokens(target, tokenizer, tiny):
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=40, ignore_eos=True)
              for i in range(4)]
    want = token_ids(LLM.from_loaded(target, tokenizer, max_model_len=256), params)
    for draft in ("copy", "near"):
        llm = spec_llm(target, tokenizer, tiny[draft])
        assert token_ids(llm, params) == want, draft
        assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_tokens(target, tokenizer, tiny, reference, mode):
    llm = spec_llm(target, tokenizer, tiny["near"], block_size=16, num_blocks=9, max_model_len=128,
                   preemption_mode=mode,
                   enable_prefix_caching=False)
    assert token_ids(llm, GREEDY) == reference
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    if mode == "swap":
        assert engine.scheduler.num_swap_ins > 0
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks and not engine.kv_manager.swapped


@pytest.mark.parametrize("resize", ["grow", "shrink"])
def test_pool_resizes_mid_generation_keep_the_tokens(target, tokenizer, tiny, reference, resize):
    llm = spec_llm(target, tokenizer, tiny["near"], block_size=16)
    engine = llm.engine
    ids = [engine.add_request(p["prompt_token_ids"], GREEDY, prompt_token_ids=p["prompt_token_ids"])
           for p in prompts()]
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 12:
            if resize == "grow":
                assert engine.pool._resize(engine.kv_manager.num_blocks + 40, "test")
            else:  # compaction moves live blocks (target and draft layers alike) towards the start
                engine.pool.shrink(engine.pool.num_used_blocks() + 1, "test")
    assert [finished[i] for i in ids] == reference
    assert engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_prefix_cache_hits_carry_the_drafts_kv(target, tokenizer, tiny, reference):
    """A request whose prompt starts with another's reuses its blocks, the draft layers' KV included: with
    the target's own weights as the draft, every proposal is still accepted after the hit."""
    llm = spec_llm(target, tokenizer, tiny["copy"], block_size=16)
    first = prompts()[3]["prompt_token_ids"]  # 44 tokens: two full blocks to share
    assert token_ids(llm, GREEDY, [{"prompt_token_ids": first}]) == [reference[3]]
    stats = llm.engine.scheduler.spec_stats
    before = stats.num_draft_tokens
    again = {"prompt_token_ids": first[:32] + [7, 9, 11]}
    out = llm.generate([again], GREEDY)[0]
    assert out.num_cached_tokens == 32
    want = token_ids(LLM.from_loaded(target, tokenizer, max_model_len=256), GREEDY, [again])
    assert [out.outputs[0].token_ids] == want
    assert stats.num_draft_tokens > before and stats.num_accepted_tokens == stats.num_draft_tokens


def test_max_tokens_and_logprobs_land_as_without_proposals(target, tokenizer, tiny):
    plain = LLM.from_loaded(target, tokenizer, max_model_len=256)
    llm = spec_llm(target, tokenizer, tiny["copy"])
    for params in (SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=30, logprobs=2, ignore_eos=True)):
        got = [o.outputs[0] for o in llm.generate(prompts(), params)]
        want = [o.outputs[0] for o in plain.generate(prompts(), params)]
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        if params.logprobs:
            assert [len(g.logprobs) for g in got] == [len(w.logprobs) for w in want]


def test_near_max_model_len_no_slot_past_it(target, tokenizer, tiny):
    """Proposals and lookahead stop short of max_model_len: a request running up to it ends the same."""
    batch = [{"prompt_token_ids": list(range(50))}]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)  # up to max_model_len
    plain = LLM.from_loaded(target, tokenizer, max_model_len=64)
    want = token_ids(plain, params, batch)
    llm = LLM.from_loaded(target, tokenizer, max_model_len=64,
                          speculative_config={"model": tiny["copy"], "num_speculative_tokens": 5})
    assert token_ids(llm, params, batch) == want and len(want[0]) == 14


@pytest.mark.parametrize(("draft", "message"), [
    ("kv1", r"KV geometry differs \(target 2 KV heads of size 16, draft 1 KV heads of size 16\)"),
    ("vocab", r"vocabularies differ \(target 256 tokens, draft 300\)"),
    ("missing", r"speculative_config.model='.*missing'.*cannot be loaded"),
])
def test_drafts_that_cannot_share_the_pool_are_refused(target, tokenizer, tiny, draft, message):
    path = tiny.get(draft, str(Path(tiny["target"]).parent / "missing"))
    with pytest.raises(ValueError, match=message):
        spec_llm(target, tokenizer, path)


def test_settings_that_do_not_fit_the_method_are_refused(target, tokenizer, tiny):
    from tideserve.config import SpeculativeConfig

    with pytest.raises(ValueError, match="tensor_parallel_size 1 only"):
        spec_llm(target, tokenizer, tiny["copy"], tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r'model must name the draft model .* got None'):
        SpeculativeConfig(method="draft_model", num_speculative_tokens=2)
    with pytest.raises(ValueError, match=r'is for method "draft_model"'):
        SpeculativeConfig(method="ngram", model="x", num_speculative_tokens=2)
    config = SpeculativeConfig(model="x", num_speculative_tokens=2)
    assert config.method == "draft_model"


@pytest.mark.slow  # the embedded model end to end, twice
def test_the_embedded_model_as_its_own_draft(make_llm, smollm2_gguf_path):
    """Nearly every proposal accepted (the draft is the target; its passes differ only in rounding), the
    output the target's own, a JSON schema's output too (proposals cut to what the grammar allows)."""
    import json

    plain = make_llm(max_model_len=1024)
    spec = make_llm(max_model_len=1024, speculative_config={"model": str(smollm2_gguf_path),
                                                              "num_speculative_tokens": 4})
    params = SamplingParams(temperature=0.0, max_tokens=60)
    for text in ("Why is the sky blue?", "Write a haiku about the sea."):
        chat = {"prompt_token_ids": plain.tokenizer.encode_chat([{"role": "user", "content": text}])}
        assert (spec.generate(chat, params)[0].outputs[0].token_ids
                == plain.generate(chat, params)[0].outputs[0].token_ids), text
    stats = spec.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 50 and stats.acceptance_rate > 0.9, vars(stats)
    record = {"name": "Ada Lovelace", "born": 1815}
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"}},
              "required": list(record), "additionalProperties": False}
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"json": schema})
    chat = {"prompt_token_ids": plain.tokenizer.encode_chat(
        [{"role": "user", "content": f"Copy this record as JSON: {json.dumps(record)}"}])}
    before = stats.num_accepted_tokens
    got = spec.generate(chat, params)[0].outputs[0]
    assert got.token_ids == plain.generate(chat, params)[0].outputs[0].token_ids
    assert set(json.loads(got.text)) == set(record) and stats.num_accepted_tokens - before > 5


@pytest.mark.slow  # its own load of the embedded model: sleeping drops the weights this engine alone holds
def test_sleep_and_wake_with_the_target_as_its_own_draft(smollm2_gguf_path):
    llm = LLM(max_model_len=512, enable_sleep_mode=True,
              speculative_config={"model": str(smollm2_gguf_path), "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = llm.generate("Tell me about the harbour.", params)[0].outputs[0].token_ids
    worker = llm.engine.executor.driver_worker
    llm.sleep(2)
    assert worker.model is None and worker.draft_model is None  # the shared weights are dropped too
    llm.wake_up()
    assert worker.draft_model is worker.model is not None
    assert llm.generate("Tell me about the harbour.", params)[0].outputs[0].token_ids == want


def _arch(**over):
    from types import SimpleNamespace

    from tideserve.core.kv_cache.groups import KVCacheGroups

    groups = over.pop("groups", KVCacheGroups.single(2))
    values = {"generates": True, "vocab_size": 256, "num_key_value_heads": 2, "head_dim": 16,
              "max_position_embeddings": 512, **over}
    return SimpleNamespace(kv_cache_groups=lambda: groups, **values)


def test_sliding_window_models_and_short_drafts_are_refused():
    from tideserve.core.kv_cache.groups import KVCacheGroups
    from tideserve.spec_decode.draft import check_draft_model

    check_draft_model(_arch(), _arch(), "t", "d", 512, 1)  # the same shape: accepted
    hybrid = _arch(groups=KVCacheGroups.from_windows([0, 8, 8, 8]))
    with pytest.raises(ValueError, match=r"the target mixes sliding-window and global layers \(4 KV cache groups"):
        check_draft_model(hybrid, _arch(), "t", "d", 512, 1)
    with pytest.raises(ValueError, match="the draft mixes sliding-window and global layers"):
        check_draft_model(_arch(), hybrid, "t", "d", 512, 1)
    with pytest.raises(ValueError, match=r"the draft reaches 256 positions, fewer than max_model_len \(512\)"):
        check_draft_model(_arch(), _arch(max_position_embeddings=256), "t", "d", 512, 1)
    with pytest.raises(ValueError, match=r"KV geometry differs \(target 2 KV heads of size 16, draft 2 KV heads of "
                                         r"size 32\)"):
        check_draft_model(_arch(), _arch(head_dim=32), "t", "d", 512, 1)
