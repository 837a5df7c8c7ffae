"""Every attention backend, each through its own metadata builder (the one the runner asks), on tiny random
Llama (GQA) and Qwen2 (qkv bias) models over batches that mix decodes, fresh prefills, chunks after a cached
prefix and prefix-cache hits on shared blocks: the same greedy tokens and close logits as the torch
reference, and a prefix hit gives the logits of computing the whole sequence afresh. And selection: what
``auto`` picks, and the errors of a choice that cannot run here.

The Triton backend is checked against its kernels' contract with torch stand-ins for them (its builder's
int32 tables, query start offsets and context lengths, and the K/V stored before the call); the kernels
themselves are checked against the torch backend when they are importable and TRITON_INTERPRET=1, with
full attention and with sliding windows and soft-capped scores.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch
from tiny_models import tiny_llama

from tideserve import LLM, native
from tideserve.model.attention import (
    ATTENTION_BACKENDS,
    CpuNativeMetadata,
    TorchMetadata,
    TritonBackend,
    TritonMetadata,
    select_attention_backend,
)
from tideserve.model.llama import LlamaForCausalLM
from tideserve.platform import platform_for

HAS_NATIVE = native.load_library() is not None
DECODE_MODULE = "tideserve.model.attention.triton.paged_decode"
PREFILL_MODULE = "tideserve.model.attention.triton.paged_prefill"


def tiny(kind: str) -> LlamaForCausalLM:
    return tiny_llama(qwen2=kind == "qwen2")


# ----------------------------------------------------------------------- the Triton kernels' contract in torch
def _context(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """The first n cached [KVH, D] rows of one request, through its block table."""
    return cache[table[: -(-n // cache.shape[1])].long()].flatten(0, 1)[:n]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_from: int) -> torch.Tensor:
    """q [Lq, H, D] at positions causal_from.., over keys k, v [Lk, KVH, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.to(q.dtype).repeat_interleave(group, 1), v.to(q.dtype).repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    allowed = torch.arange(k.shape[0])[None, :] <= causal_from + torch.arange(q.shape[0])[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def contract_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out) -> None:
    assert block_tables.dtype == context_lens.dtype == torch.int32
    assert q.is_contiguous() and out.is_contiguous() and out.shape == q.shape == (len(context_lens), *q.shape[1:])
    for i, n in enumerate(context_lens.tolist()):
        k, v = _context(k_cache, block_tables[i], n), _context(v_cache, block_tables[i], n)
        out[i] = _attend(q[i:i + 1], k, v, scale, n - 1)[0]


def contract_prefill(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, out) -> None:
    assert block_tables.dtype == query_start_loc.dtype == context_lens.dtype == torch.int32
    starts = query_start_loc.tolist()
    assert starts[0] == 0 and starts[-1] == q.shape[0] and q.is_contiguous() and out.is_contiguous()
    for s, n in enumerate(context_lens.tolist()):
        a, b = starts[s], starts[s + 1]
        k, v = _context(k_cache, block_tables[s], n), _context(v_cache, block_tables[s], n)
        out[a:b] = _attend(q[a:b], k, v, scale, n - (b - a))  # the chunk's queries are the last positions


@pytest.fixture
def triton_contract(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Torch stand-ins for the Triton kernels (as importable modules), counting their calls."""
    calls = {"decode": 0, "prefill": 0}

    def counted(name, fn):
        def call(*args, **hints):  # hints (max_context_len, max_query_len) only save the kernels a device read
            assert not hints.get("window") and not hints.get("softcap"), "the stand-ins attend the whole context"
            calls[name] += 1
            fn(*args)
        return call

    for module_name, attr, name, fn in ((DECODE_MODULE, "paged_decode_attention", "decode", contract_decode),
                                        (PREFILL_MODULE, "paged_prefill_attention", "prefill", contract_prefill)):
        module = types.ModuleType(module_name)
        setattr(module, attr, counted(name, fn))
        monkeypatch.setitem(sys.modules, module_name, module)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return calls


# ----------------------------------------------------------------------- mixed batches
def run_steps(model: LlamaForCausalLM, backend: str, paged_cache, kv_dtype=torch.float32, steps: int = 6):
    """Greedy decoding of A and B; C arrives at step 2 with a prefix hit on A's first two blocks (shared
    block ids) and prefills in two chunks while the others decode; D arrives at step 3 (fresh prefill).
    Returns (logits of every step, each request's greedy tokens, the metadata types seen)."""
    g = torch.Generator().manual_seed(7)
    vocab = model.arch.vocab_size
    prompts = {"A": torch.randint(0, vocab, (10,), generator=g).tolist(),
               "B": torch.randint(0, vocab, (5,), generator=g).tolist(),
               "D": torch.randint(0, vocab, (3,), generator=g).tolist()}
    prompts["C"] = prompts["A"][:8] + torch.randint(0, vocab, (6,), generator=g).tolist()
    cache = paged_cache(model.arch, num_blocks=48, block_size=4, dtype=kv_dtype, backend=backend,
                        model_dtype=model.dtype)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    logits, kinds = [], set()
    for step in range(steps):
        decodes = [(rid, tokens[rid][-1:]) for rid in prompts if tokens[rid]]
        prefills = []
        if step == 0:
            prefills = [("A", prompts["A"]), ("B", prompts["B"])]
        elif step == 2:
            cache.share_prefix("A", "C", 2)  # 8 tokens cached, in A's own blocks
            prefills = [("C", prompts["C"][8:11])]
        elif step == 3:
            prefills = [("C", prompts["C"][11:]), ("D", prompts["D"])]
        ids, positions, meta = cache.step(decodes + prefills)
        kinds.add(type(meta))
        out = model.compute_logits(model(ids, positions, cache.kv_caches, meta))
        logits.append(out)
        ends = torch.cumsum(torch.tensor([len(t) for _, t in decodes + prefills]), 0) - 1
        for (rid, _), row in zip(decodes + prefills, ends.tolist(), strict=True):
            if rid != "C" or step != 2:  # C's first chunk does not reach its last prompt token
                tokens[rid].append(int(out[row].argmax()))
    return logits, tokens, kinds


BACKENDS = ["torch", "cpu-native", "triton"]


def _needs(backend: str, request: pytest.FixtureRequest) -> None:
    if backend == "cpu-native" and not HAS_NATIVE:
        pytest.skip("no C compiler to build the native kernels")
    if backend == "triton":
        request.getfixturevalue("triton_contract")


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["kv-f32", "kv-bf16"])
@pytest.mark.parametrize("backend", BACKENDS[1:])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_backends_give_the_torch_references_tokens_and_logits(kind, backend, kv_dtype, paged_cache, request):
    _needs(backend, request)
    model = tiny(kind)
    want_logits, want_tokens, _ = run_steps(model, "torch", paged_cache, kv_dtype)
    got_logits, got_tokens, kinds = run_steps(model, backend, paged_cache, kv_dtype)
    assert kinds == {CpuNativeMetadata if backend == "cpu-native" else TritonMetadata}  # its own builder's
    assert got_tokens == want_tokens and all(len(t) >= 3 for t in got_tokens.values())
    # A fresh prefill attends to its own keys in the torch reference (and cpu-native), but to the cache in the
    # Triton kernels' contract: with a bfloat16 cache those keys are rounded to bf16 (2^-8 relative).
    # cpu-native over a bfloat16 cache: on an Intel Xeon (AVX-512, no AMX) the steps from the one that
    # mixes a cached-prefix chunk with a fresh prefill differ from the torch reference by up to 2.8e-5 (on
    # every ISA path, scalar included; 1e-6 on the AMD hosts and for qwen2); greedy tokens agree. Both read
    # the same bf16 cache, so 1e-4 still fails on a key or value read wrongly or rounded once more.
    if kv_dtype == torch.bfloat16:
        tolerance = 2e-2 if backend == "triton" else 1e-4
    else:
        tolerance = 1e-5
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    if backend == "triton":
        calls = request.getfixturevalue("triton_contract")
        assert calls["decode"] == 2 * 5 and calls["prefill"] == 2 * 3  # per layer: steps with decodes / prefills


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prefix_hit_gives_the_logits_of_computing_it_afresh(backend, paged_cache, request):
    """C's rows after the shared blocks, against C's whole sequence prefilled alone in a fresh cache."""
    _needs(backend, request)
    model = tiny("llama")
    logits, tokens, _ = run_steps(model, backend, paged_cache)
    g = torch.Generator().manual_seed(7)  # C's prompt again, as run_steps draws it
    a = torch.randint(0, 96, (10,), generator=g).tolist()
    torch.randint(0, 96, (5,), generator=g), torch.randint(0, 96, (3,), generator=g)
    c = a[:8] + torch.randint(0, 96, (6,), generator=g).tolist()
    alone = paged_cache(model.arch, num_blocks=8, block_size=4, backend=backend)
    ids, positions, meta = alone.step([("C", c)])
    fresh = model.compute_logits(model(ids, positions, alone.kv_caches, meta))
    torch.testing.assert_close(logits[2][-3:], fresh[8:11], rtol=1e-5, atol=1e-5)  # step 2: A, B decode, C
    torch.testing.assert_close(logits[3][2:5], fresh[11:14], rtol=1e-5, atol=1e-5)  # step 3: A, B decode, C, D
    assert tokens["C"][0] == int(fresh[-1].argmax())


def test_the_torch_builder_groups_sorted_decodes_and_pads_unsorted_ones(paged_cache):
    model = tiny("llama")
    cache = paged_cache(model.arch, num_blocks=64, block_size=4)
    for rid, n in (("a", 3), ("b", 90), ("c", 91), ("d", 2)):
        cache.step([(rid, list(range(n)))])
    _, _, meta = cache.step([("a", [1]), ("d", [1]), ("b", [1]), ("c", [1])])  # contexts 4, 3, 91, 92
    assert isinstance(meta, TorchMetadata) and [(g.start, g.end) for g in meta.decode_groups] == [(0, 4)]
    _, _, meta = cache.step([("d", [1]), ("a", [1]), ("b", [1]), ("c", [1])])  # sorted: 4, 5, 92, 93
    assert [(g.start, g.end) for g in meta.decode_groups] == [(0, 2), (2, 4)]  # blocks 1, 2 | 23, 24
    assert meta.decode_groups[0].block_tables.shape == (2, 2) and meta.decode_groups[1].mask.shape[-1] == 96


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not TritonBackend.available(),
                    reason="the Triton kernels are checked here only when importable and TRITON_INTERPRET=1")
@pytest.mark.parametrize("attention", ["full", "windowed"])
def test_the_triton_kernels_follow_the_torch_backend(paged_cache, attention):
    """``windowed``: a window of 3 keys with soft-capped scores on layer 0 and of 6 on layer 1, which the
    contexts (up to 17 tokens in blocks of 4) and C's cached prefix outgrow."""
    model = tiny("qwen2")
    if attention == "windowed":
        for layer, window, softcap in ((0, 3, 0.5), (1, 6, 0.0)):
            model.model.layers[layer].self_attn.window = window
            model.model.layers[layer].self_attn.softcap = softcap
    want_logits, want_tokens, _ = run_steps(model, "torch", paged_cache, steps=4)
    got_logits, got_tokens, _ = run_steps(model, "triton", paged_cache, steps=4)
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # starts a process
def test_the_real_triton_kernels_run_behind_the_backend_under_the_interpreter():
    """The test above, in a process where TRITON_INTERPRET=1 is set before triton is imported (the rest of
    the suite never sees the variable): the real kernels, not the stand-ins, on mixed batches."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    node = f"{__file__}::test_the_triton_kernels_follow_the_torch_backend"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]


# ----------------------------------------------------------------------- selection
HEADS = (4, 2, 16)


def test_auto_picks_the_native_kernels_on_the_cpu_where_the_dtypes_fit():
    fits = select_attention_backend("auto", "cpu", torch.float32, torch.bfloat16, *HEADS)
    assert fits.name == ("cpu-native" if HAS_NATIVE else "torch")
    assert select_attention_backend("auto", "cpu", torch.float32, torch.float16, *HEADS).name == "torch"
    assert select_attention_backend("auto", "cpu", torch.float16, torch.float16, *HEADS).name == "torch"
    assert select_attention_backend("torch", "cpu", torch.float32, torch.float32, *HEADS).rope_store is None
    fp8 = select_attention_backend("auto", "cpu", torch.float32, torch.float8_e4m3fn, *HEADS)
    assert fp8.name == ("cpu-native" if HAS_NATIVE else "torch")


def test_triton_declines_an_fp8_cache(monkeypatch):
    """Its kernels read 16- and 32-bit caches: auto passes over it, asked for by name it says so."""
    monkeypatch.setattr(TritonBackend, "available", staticmethod(lambda: True))
    monkeypatch.setattr(type(platform_for(torch.device("cpu"))), "attention_backends", ("triton", "torch"))
    assert select_attention_backend("auto", "cpu", torch.float32, torch.float8_e4m3fn, *HEADS).name == "torch"
    with pytest.raises(ValueError, match="attention_backend='triton' has no kernels for an fp8 KV cache"):
        select_attention_backend("triton", "cpu", torch.float32, torch.float8_e4m3fn, *HEADS)


def test_auto_is_torch_without_the_native_library(monkeypatch):
    monkeypatch.setattr(native, "load_library", lambda: None)
    assert select_attention_backend("auto", "cpu", torch.float32, torch.float32, *HEADS).name == "torch"
    with pytest.raises(ValueError, match=r"attention_backend='cpu-native' cannot run here: the native kernels are "
                                         r"not available .*TIDESERVE_NATIVE=0"):
        select_attention_backend("cpu-native", "cpu", torch.float32, torch.float32, *HEADS)


@pytest.mark.skipif(not HAS_NATIVE, reason="no C compiler to build the native kernels")
def test_cpu_native_says_what_does_not_fit():
    with pytest.raises(ValueError, match=r"cpu-native.*KV cache dtype float16 has no kernel \(kernels: float32, "
                                         r"bfloat16, float8_e4m3fn\); use attention_backend='auto' or 'torch'"):
        select_attention_backend("cpu-native", "cpu", torch.float32, torch.float16, *HEADS)
    with pytest.raises(ValueError, match="cpu-native.*the model's dtype float16"):
        select_attention_backend("cpu-native", "cpu", torch.float16, torch.float32, *HEADS)
    with pytest.raises(ValueError, match="cpu-native.*runs on the CPU, not meta"):
        select_attention_backend("cpu-native", "meta", torch.float32, torch.float32, *HEADS)


def test_triton_on_the_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"attention_backend='triton' runs on CUDA devices, not cpu .*"
                                         r"TRITON_INTERPRET=1"):
        select_attention_backend("triton", "cpu", torch.float32, torch.float32, *HEADS)


def test_triton_without_its_kernels_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, DECODE_MODULE, None)  # importing it raises ImportError
    with pytest.raises(ValueError, match="attention_backend='triton' needs the triton package and tideserve's "
                                         "Triton kernels"):
        select_attention_backend("triton", "cpu", torch.float32, torch.float32, *HEADS)


def test_an_unknown_backend_lists_the_choices():
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, cpu-native, triton, got "
                                         "'flash'"):
        select_attention_backend("flash", "cpu", torch.float32, torch.float32, *HEADS)
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, cpu-native, triton"):
        LLM(dtype="float32", attention_backend="flash")
    assert ATTENTION_BACKENDS == ("auto", "torch", "cpu-native", "triton")


def test_the_engine_refuses_triton_on_the_cpu_at_start_up(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend='triton' runs on CUDA devices, not cpu"):
        LLM(dtype="float32", max_model_len=256, attention_backend="triton")
