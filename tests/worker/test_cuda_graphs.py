"""Decode steps replayed from captured graphs (worker/cuda_graphs.py).

On the CPU the runner is given ``eager_capture``: the same static buffers, padding rows, size choice and
invalidation on a KV change as with CUDA graphs, only without the graph, so the mechanism is tested here;
the test marked ``cuda`` captures real CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tideserve import SamplingParams, native
from tideserve.worker.cuda_graphs import DecodeGraphs, capture_sizes, eager_capture

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The capital of France is", "List three colours:", "Once upon a time",
           "def fibonacci(n):", "Water boils at"]  # five: padded to a captured size of 8

needs_native = pytest.mark.skipif(native.load_library() is None, reason="no C compiler to build the native kernels")


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(1000)[-1] == 256


def test_a_backend_without_static_metadata_is_refused():
    with pytest.raises(ValueError, match="no static decode metadata"):
        DecodeGraphs(torch.nn.Identity(), (), torch.device("cpu"), 8, 64, eager_capture)


@pytest.mark.slow
@needs_native
def test_replayed_decodes_give_the_eager_tokens(make_llm):
    eager = make_llm(dtype="float32", max_model_len=256, enable_prefix_caching=False, attention_backend="cpu-native")
    want = tokens(eager.generate(PROMPTS, GREEDY))

    llm = make_llm(dtype="float32", max_model_len=256, enable_prefix_caching=False, attention_backend="cpu-native")
    runner = llm.engine.executor.driver_worker.runner
    assert runner.enable_graphs(max_num_seqs=8, max_model_len=256, capture=eager_capture)
    got = tokens(llm.generate(PROMPTS, GREEDY))
    assert got == want
    graphs = runner.graphs
    # Every decode-only step replayed (prompts finish prefill in the first steps); batches of 5, 4, ... rows
    # ran padded to captured sizes, each size captured once.
    assert graphs.num_replays >= GREEDY.max_tokens - 2
    assert graphs.num_captures == len(graphs._graphs) <= len(graphs.sizes)

    # One request alone runs in the size-1 graph and still gets its own tokens.
    assert tokens(llm.generate(PROMPTS[:1], GREEDY)) == want[:1]


@pytest.mark.slow
@needs_native
def test_graphs_survive_resizes_of_a_store_with_fixed_caches_and_not_a_block_size_change(make_llm):
    """A store over one reserved range hands the graphs views of its whole reservation (``fixed_caches``):
    growing and shrinking the pool changes no address or shape they hold, so nothing is recaptured. A block-
    size change reshapes every view: then every graph is dropped and recaptured."""
    llm = make_llm(dtype="float32", max_model_len=256, enable_prefix_caching=False, attention_backend="cpu-native")
    engine = llm.engine
    runner = engine.executor.driver_worker.runner
    assert runner.enable_graphs(max_num_seqs=8, max_model_len=256, capture=eager_capture)
    want = tokens(llm.generate(PROMPTS[:2], GREEDY))
    graphs = runner.graphs
    before = graphs.num_captures
    assert before >= 1
    for target in (engine.kv_manager.num_blocks + 64, 40, engine.kv_manager.num_blocks + 200):
        assert engine.pool._resize(target, "test")
        assert tokens(llm.generate(PROMPTS[:2], GREEDY)) == want
    assert graphs.num_captures == before and graphs.num_invalidations == 0
    assert engine.pool.change_block_size(32, "test")
    assert tokens(llm.generate(PROMPTS[:2], GREEDY)) == want
    assert graphs.num_captures > before and graphs.num_invalidations == 1


@pytest.mark.slow
@needs_native
def test_graphs_are_recaptured_when_a_copying_store_resizes(make_llm, monkeypatch):
    """A copying store's resize reallocates its tensors: the graphs read stale addresses and are dropped."""
    from tideserve.worker import kv_store

    monkeypatch.setattr(kv_store.ReservedKVStore, "try_create", classmethod(lambda cls, *a, **k: None))
    llm = make_llm(dtype="float32", max_model_len=256, enable_prefix_caching=False, attention_backend="cpu-native")
    engine = llm.engine
    runner = engine.executor.driver_worker.runner
    assert isinstance(runner.kv_storage.device_store, kv_store.CopyKVStore)
    assert runner.enable_graphs(max_num_seqs=8, max_model_len=256, capture=eager_capture)
    want = tokens(llm.generate(PROMPTS[:2], GREEDY))
    graphs = runner.graphs
    before = graphs.num_captures
    engine.pool._resize(engine.kv_manager.num_blocks + 64, "test")
    assert tokens(llm.generate(PROMPTS[:2], GREEDY)) == want
    assert graphs.num_captures > before and graphs.num_invalidations == 1


def test_graph_validity_is_keyed_on_every_layers_addresses_shapes_and_the_block_size():
    captured: list[int] = []

    def capture(fn):
        captured.append(1)
        return eager_capture(fn)

    class Model(torch.nn.Module):
        def forward(self, ids, pos, kv_caches, meta):
            return torch.zeros(ids.shape[0], 4)

    @dataclasses.dataclass
    class Meta:
        num_decode_tokens: int
        slot_mapping: torch.Tensor

    graphs = DecodeGraphs(Model(), ("slot_mapping",), torch.device("cpu"), 4, 64, capture)
    pool = torch.zeros(2, 2, 100, 16, 1, 4)
    caches = [(pool[0, 0], pool[0, 1]), (pool[1, 0], pool[1, 1])]
    meta = Meta(2, torch.zeros(2, dtype=torch.long))
    ids, pos = torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long)

    def run(kv, block_size=16):
        assert graphs.run(ids, pos, meta, kv, block_size) is not None

    run(caches)
    run(list(caches))  # another list over the same tensors: still valid
    assert (len(captured), graphs.num_invalidations) == (1, 0)
    run([(pool[0, 0], pool[0, 1]), (pool[1, 0][:50], pool[1, 1])])  # a later layer's shape changed
    assert (len(captured), graphs.num_invalidations) == (2, 1)
    other = torch.zeros_like(pool)
    run([(pool[0, 0], pool[0, 1]), (pool[1, 0][:50], other[1, 1])])  # a later layer's V moved
    assert (len(captured), graphs.num_invalidations) == (3, 2)
    kv = [(pool[0, 0], pool[0, 1]), (pool[1, 0][:50], other[1, 1])]
    run(kv, block_size=32)  # the same tensors read with another block size
    assert (len(captured), graphs.num_invalidations) == (4, 3)


def test_the_torch_backend_stays_eager(make_llm):
    llm = make_llm(dtype="float32", max_model_len=256, attention_backend="torch")
    assert not llm.engine.executor.driver_worker.runner.enable_graphs(max_num_seqs=8, max_model_len=256,
                                                                      capture=eager_capture)
    assert llm.engine.executor.driver_worker.runner.graphs is None


@needs_native
def test_a_mixture_of_experts_stays_eager(tiny_checkpoint, smollm2_tokenizer):
    from tideserve import LLM
    from tideserve.model.loader import load_model

    loaded = load_model(str(tiny_checkpoint("mixtral-e4-top2")), dtype="float32")
    llm = LLM.from_loaded(loaded, smollm2_tokenizer, max_model_len=128, attention_backend="cpu-native")
    runner = llm.engine.executor.driver_worker.runner
    assert not runner.enable_graphs(max_num_seqs=8, max_model_len=128, capture=eager_capture)
    assert runner.graphs is None


@pytest.mark.cuda
def test_cuda_graphs_give_the_eager_tokens(make_llm):
    # benchmarks/gpu_check.sh names a model of the default's shape where the embedded one is not installed
    model = os.environ.get("TIDESERVE_TEST_MODEL") or None
    eager = make_llm(model=model, dtype="bfloat16", device="cuda", max_model_len=256, enforce_eager=True,
                     enable_prefix_caching=False)
    want = tokens(eager.generate(PROMPTS, GREEDY))
    llm = make_llm(model=model, dtype="bfloat16", device="cuda", max_model_len=256, enable_prefix_caching=False)
    assert llm.engine.executor.driver_worker.runner.graphs is not None
    assert tokens(llm.generate(PROMPTS, GREEDY)) == want
    assert llm.engine.executor.driver_worker.runner.graphs.num_replays > 0


@pytest.mark.cuda
def test_cuda_graphs_are_recaptured_after_the_kv_tensors_change_twice(make_llm):
    """Dropping every graph frees their private memory pool: the next generation of graphs must capture
    into a fresh one (capturing into the freed pool's handle fails an assertion in torch's allocator),
    and the one after it as well. A block-size change reshapes the KV views of every store."""
    model = os.environ.get("TIDESERVE_TEST_MODEL") or None
    llm = make_llm(model=model, dtype="bfloat16", device="cuda", max_model_len=256, enable_prefix_caching=False)
    engine = llm.engine
    want = tokens(llm.generate(PROMPTS, GREEDY))
    graphs = engine.executor.driver_worker.runner.graphs
    assert graphs is not None and graphs.num_captures > 0
    for block_size in (32, 16):
        before = graphs.num_captures
        assert engine.pool.change_block_size(block_size, "test")  # every graph is stale
        assert tokens(llm.generate(PROMPTS, GREEDY)) == want
        assert graphs.num_captures > before
