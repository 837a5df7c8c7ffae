"""The runner's decode paths: grouping by context length (torch) is optimal by its cost model, and
neither it nor the native kernel's in-place reads show in the outputs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tideserve.model.attention.torch_sdpa as torch_sdpa
from tideserve import SamplingParams, native
from tideserve.model.attention import group_by_blocks
from tideserve.native import quant

pytestmark = pytest.mark.slow  # the model end to end for seconds: `make test` runs it, `-m 'not slow'` does not


def cost(blocks: list[int], groups: list[tuple[int, int]], overhead: int) -> int:
    return sum((hi - lo) * blocks[hi - 1] + overhead for lo, hi in groups)


def brute_force(blocks: list[int], overhead: int) -> int:
    n = len(blocks)
    best = None
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            bounds = [0, *cuts, n]
            c = cost(blocks, list(zip(bounds, bounds[1:])), overhead)
            best = c if best is None else min(best, c)
    return best


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=9), st.integers(0, 30))
def test_grouping_is_contiguous_complete_and_optimal(blocks, overhead):
    blocks = sorted(blocks)
    groups = group_by_blocks(np.array(blocks), overhead)
    assert groups[0][0] == 0 and groups[-1][1] == len(blocks)
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(groups, groups[1:]))
    assert cost(blocks, groups, overhead) == brute_force(blocks, overhead)


@pytest.mark.parametrize("decode_path", ["torch", "native", "int4-one-call"])
def test_batched_decodes_give_the_same_tokens_as_requests_alone(make_llm, monkeypatch, request, decode_path):
    seen, calls = [], []
    original = torch_sdpa.group_by_blocks
    monkeypatch.setattr(torch_sdpa, "group_by_blocks", lambda nbs, *a: seen.append(len(original(nbs, *a)))
                        or original(nbs, *a))
    if decode_path != "torch" and native.load_library() is None:
        pytest.skip("no C compiler to build the native kernel")
    quantization = "int4" if decode_path == "int4-one-call" else "none"
    if quantization == "int4" and quant.cpu_isa() in ("amx", "avx2"):
        # AMX tiles round x to bfloat16 and the row kernels to int8 blocks, and AVX2's tiles sum in another
        # order, so a row's numbers change when its batch crosses the tiles' threshold (12 rows); one path for
        # every batch size keeps rows independent.
        previous = quant.set_tile_min_rows(1)
        request.addfinalizer(lambda: quant.set_tile_min_rows(previous))
    llm = make_llm(dtype="float32", max_model_len=1024, enable_prefix_caching=False, quantization=quantization,
                   attention_backend="torch" if decode_path == "torch" else "cpu-native")
    backend = llm.engine.executor.driver_worker.runner.attn_backend
    if decode_path == "native":  # count the bound kernel's calls
        kernel = backend._paged_decode
        backend._paged_decode = lambda *a: calls.append(True) or kernel(*a)
    elif quantization == "int4":  # every decode-only step runs the decoder layers in one native call
        model = llm.engine.executor.driver_worker.runner.model
        one_call = model.native_decode
        assert one_call is not None
        model.native_decode = lambda *a: calls.append(one_call(*a)) or calls[-1]
    words = "tide moon harbour boat gull rope bread sand shell wave storm flag".split()
    prompts = [" ".join(words[: 2 + 3 * i] * (1 + 12 * (i % 3))) for i in range(8)]  # 3 to ~600 tokens
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    if decode_path == "torch":
        assert max(seen) > 1  # contexts this far apart were split into several groups
    elif decode_path == "native":
        assert not seen and calls  # the decodes went through the kernel, none through torch's groups
    else:
        assert calls.count(True) >= 5  # the steps with only decodes (prefill steps return False)
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=8), st.integers(1, 64))
def test_slabs_cut_the_flat_batch_in_order_and_never_past_the_limit(counts, limit):
    from tideserve.worker.model_runner import ModelRunner

    pieces = [(f"r{i}", 7 * i, n) for i, n in enumerate(counts)]
    slabs = ModelRunner._slabs(pieces, limit)
    sizes = [sum(n for _, _, n in slab) for slab in slabs]
    assert all(0 < s <= limit for s in sizes) and all(s == limit for s in sizes[:-1])
    # Read back in order, the slabs hold every request's tokens once, each request's from its first
    # position on without gaps.
    flat = [(rid, start + j) for slab in slabs for rid, start, n in slab for j in range(n)]
    assert flat == [(rid, start + j) for rid, start, n in pieces for j in range(n)]


def test_a_step_past_the_slab_size_runs_as_slabs_with_the_same_results(make_llm, monkeypatch):
    """Prompts and decodes sharing steps of up to 512 tokens, with passes of at most 96: each pass holds
    no more, a request cut between two passes reads its first part from the cache, and the tokens and
    their logprobs are those of one pass per step."""
    llm = make_llm(dtype="float32", max_model_len=1024, enable_prefix_caching=False, max_num_batched_tokens=512,
                   max_num_seqs=8)
    runner = llm.engine.executor.driver_worker.runner
    words = "tide moon harbour boat gull rope bread sand shell wave storm flag".split()
    prompts = [" ".join(words[: 3 + i] * (3 + 9 * (i % 3))) for i in range(6)]  # ~10 to ~300 tokens
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)

    def run(slab):
        monkeypatch.setattr(runner.platform, "forward_slab_tokens", slab)
        passes: list[list[tuple[str, int, int]]] = []
        forward = runner._forward
        monkeypatch.setattr(runner, "_forward",
                            lambda pieces, *a, **k: passes.append(pieces) or forward(pieces, *a, **k))
        outs = llm.generate(prompts, params)
        monkeypatch.setattr(runner, "_forward", forward)
        return outs, passes

    sliced, passes = run(96)
    whole, whole_passes = run(None)
    assert max(sum(n for _, _, n in p) for p in passes) <= 96
    assert max(sum(n for _, _, n in p) for p in whole_passes) > 96  # the same steps, unsliced
    cut = {rid for p in passes for rid, start, n in p[:1]} & {rid for p in passes for rid, start, n in p[-1:]}
    assert cut  # some request ended one pass and went on at the start of the next
    for a, b in zip(sliced, whole, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)
