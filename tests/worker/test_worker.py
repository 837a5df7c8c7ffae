"""The engine reaches its workers through one call, ``collective_rpc``: an operation added to the worker
(here by vLLM's ``worker_extension_cls``, with nothing else written) runs on every rank of a TP=2 engine;
an error on one rank comes back after every rank answered, and the ranks stay in step; one process runs
the same calls in-process."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from tideserve import LLM, SamplingParams
from tideserve.model.loader import load_model
from tideserve.worker.executor import UniprocExecutor
from tideserve.worker.worker import Worker

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

EXTENSION = textwrap.dedent('''
    import os


    class Probe:
        """Operations a user adds to the worker: each runs on every rank through collective_rpc."""

        def whoami(self):
            return self.rank, os.getpid(), self.kv_storage.layout.num_kv_heads, self.kv_storage.num_blocks

        def add(self, x, y=0):
            return 100 * self.rank + x + y

        def fail_on(self, rank):
            if self.rank == rank:
                raise ValueError(f"refused on rank {rank}")
            return "fine"
''')


@pytest.fixture
def extension_module(tmp_path, monkeypatch) -> str:
    """A module on the path of this process and of the ranks it starts (they inherit PYTHONPATH)."""
    (tmp_path / "tideserve_test_probe.py").write_text(EXTENSION)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    sys.modules.pop("tideserve_test_probe", None)
    return "tideserve_test_probe.Probe"


@pytest.mark.slow  # starts a process
def test_an_operation_added_to_the_worker_runs_on_both_ranks(extension_module, tiny_checkpoint,
                                                              smollm2_tokenizer):
    loaded = load_model(str(tiny_checkpoint("llama-kv4-untied")), dtype="float32")
    settings = {"max_model_len": 128, "block_size": 16}
    want = [o.outputs[0].token_ids for o in LLM.from_loaded(loaded, smollm2_tokenizer, **settings).generate(
        [[1, 2, 3, 4, 5]], GREEDY)]
    llm = LLM.from_loaded(loaded, smollm2_tokenizer, tensor_parallel_size=2, worker_extension_cls=extension_module,
                          **settings)
    (rank0, pid0, heads0, blocks0), (rank1, pid1, heads1, blocks1) = llm.collective_rpc("whoami")
    assert (rank0, rank1) == (0, 1) and pid0 == os.getpid() and pid1 != pid0  # two processes
    assert heads0 == heads1 == 2 and blocks0 == blocks1 > 0  # each rank its shard of the same pool
    assert llm.collective_rpc("add", args=(5,), kwargs={"y": 1}) == [6, 106]
    with pytest.raises(ValueError, match="refused on rank 1") as raised:
        llm.collective_rpc("fail_on", args=(1,))
    assert "raised on tensor-parallel rank 1" in "".join(getattr(raised.value, "__notes__", []))
    assert llm.collective_rpc("fail_on", args=(7,)) == ["fine", "fine"]  # the ranks are still in step
    assert [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3, 4, 5]], GREEDY)] == want
    # The engine's own operations are worker methods too: a pool resize reaches both ranks.
    pool = llm.engine.pool
    assert pool._resize(pool.geometry.num_blocks + 8, "test")
    assert [r[3] for r in llm.collective_rpc("whoami")] == [pool.geometry.num_blocks] * 2
    with pytest.raises(ValueError, match="timeout"):
        llm.collective_rpc("whoami", timeout=1.0)


def test_one_process_runs_the_same_calls_in_process(extension_module, make_llm):
    llm = make_llm(dtype="float32", max_model_len=128, worker_extension_cls=extension_module)
    (rank, pid, _, blocks), = llm.collective_rpc("whoami")
    assert (rank, pid) == (0, os.getpid()) and blocks == llm.engine.pool.geometry.num_blocks
    assert llm.collective_rpc(Worker.kv_token_bytes) == [llm.engine.pool.geometry.token_bytes]
    executor = llm.engine.executor
    assert isinstance(executor, UniprocExecutor)
    assert executor.collective_rpc("add", 2, unique_reply_rank=0) == 2  # only rank 0's answer, unwrapped
    with pytest.raises(ValueError, match="refused on rank 0"):
        llm.collective_rpc("fail_on", args=(0,))
    with pytest.raises(ValueError, match="the worker has no method 'nothing_here'"):
        llm.collective_rpc("nothing_here")


def test_a_worker_extension_that_cannot_be_imported_is_refused(make_llm):
    with pytest.raises(ValueError, match=r"worker_extension_cls='no_such_module.Thing' cannot be imported"):
        make_llm(dtype="float32", max_model_len=128, worker_extension_cls="no_such_module.Thing")
