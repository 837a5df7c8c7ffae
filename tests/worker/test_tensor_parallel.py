"""Tensor parallelism through ``LLM(tensor_parallel_size=2)``: greedy outputs equal one rank's on tiny Llama,
Qwen2, Qwen3, Phi-3, Gemma 3, Mixtral and Qwen3-MoE models (KV heads split, replicated and split unevenly) and
on the embedded model; the elastic pool's moves (compaction, shrink, grow, block-size change) and swap
preemption act on every rank; a killed rank fails the requests instead of hanging; shutdown leaves no process
behind.

Each TP engine starts one extra process (a torch import, ~3 s): the tests keep to few engines and tokens.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tideserve import LLM, SamplingParams
from tideserve.model.loader import load_model
from tideserve.worker.tp_executor import TensorParallelError

pytestmark = pytest.mark.slow  # starts processes: run by `make test`, skipped by `-m "not slow"`

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SCORED = SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=1)


def _prompts(vocab: int) -> list[list[int]]:
    shared = [(7 * i + 3) % vocab for i in range(40)]  # a 40-token prefix shared by two prompts
    return [shared + [5, 9], shared + [11], [(13 * i + 1) % vocab for i in range(23)], [4]]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _wait_gone(pids: set[int], timeout: float = 15.0) -> set[int]:
    deadline = time.monotonic() + timeout
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in alive if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"}
        time.sleep(0.05)
    return alive


@pytest.mark.parametrize("name", ["llama-kv4-untied", "llama-kv1-tied", "qwen2-kv3-bias", "qwen3-kv2-bias",
                                  "phi3-kv2-longrope", "mixtral-e4-top2", "qwen3moe-dense0", "gemma3-kv2-window"])
def test_tp2_greedy_equals_tp1_and_pool_moves_stay_in_lockstep(name, tiny_checkpoint, smollm2_tokenizer, caplog):
    loaded = load_model(str(tiny_checkpoint(name)), dtype="float32")
    vocab = loaded.arch.vocab_size
    unrelated, prompts = [(3 * i + 2) % vocab for i in range(64)], _prompts(vocab)
    settings = {"max_model_len": 128, "block_size": 16}
    one = LLM.from_loaded(loaded, smollm2_tokenizer, **settings)
    first = _greedy(one, [unrelated])
    want = _greedy(one, prompts)
    before = _children()
    two = LLM.from_loaded(loaded, smollm2_tokenizer, tensor_parallel_size=2, **settings)
    ranks = _children() - before
    assert len(ranks) == 1  # one process per rank beyond the driver
    assert _greedy(two, [unrelated]) == first  # its blocks come first in the pool
    assert _greedy(two, prompts) == want
    # Shrinking keeps the shared prefix's cached blocks (they were hit) and moves them down over the
    # unrelated prompt's: the next run reads them from their new ids, on every rank.
    pool = two.engine.pool
    with caplog.at_level(logging.INFO, logger="tideserve.engine.pool_controller"):
        pool.shrink(pool.num_used_blocks() + 3, "test")
    assert "KV cache compacted: moved" in caplog.text
    assert pool._resize(pool.kv.num_blocks + 24, "test")  # then a grow
    assert _greedy(two, prompts) == want
    assert two.engine.kv_manager.prefix_stats.hits > 0
    assert pool.change_block_size(32, "test") and two.engine.executor.driver_worker.kv_storage.block_size == 32
    assert _greedy(two, prompts) == want
    del two
    assert not _wait_gone(ranks), "a rank outlived `del llm`"


def test_tp2_swap_preemption_matches_tp1(tiny_checkpoint, smollm2_tokenizer):
    """A pool too small for every request at once: swapped-out blocks leave and return on every rank."""
    loaded = load_model(str(tiny_checkpoint("qwen2-kv3-bias")), dtype="float32")
    prompts = [[(5 * i + k) % 130 for i in range(30)] for k in range(6)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    settings = {"max_model_len": 64, "block_size": 8, "num_blocks": 16, "preemption_mode": "swap",
                "swap_space": "1MiB", "max_num_seqs": 6}
    one = LLM.from_loaded(loaded, smollm2_tokenizer, **settings)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    assert one.engine.scheduler.num_swap_ins > 0  # the test exercises swap
    two = LLM.from_loaded(loaded, smollm2_tokenizer, tensor_parallel_size=2, **settings)
    got = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
    assert got == want and two.engine.scheduler.num_swap_ins > 0


def test_tp2_disk_tier_serves_a_restart_from_each_ranks_shard(tiny_checkpoint, smollm2_tokenizer, tmp_path):
    """Each rank writes its shard of every block to its own directory; a restart on it loads every rank's
    shard back (read on each rank's threads) and the outputs equal one rank's without a tier."""
    loaded = load_model(str(tiny_checkpoint("qwen2-kv3-bias")), dtype="float32")
    prompts = [[(5 * i + 2) % 130 for i in range(45)]]
    settings = {"max_model_len": 64, "block_size": 8}
    want = _greedy(LLM.from_loaded(loaded, smollm2_tokenizer, **settings), prompts)
    first = LLM.from_loaded(loaded, smollm2_tokenizer, tensor_parallel_size=2, kv_cache_dir=str(tmp_path), **settings)
    assert _greedy(first, prompts) == want
    first.engine.shutdown()
    assert {p.name for p in tmp_path.glob("*/rank*")} == {"rank0", "rank1"}
    again = LLM.from_loaded(loaded, smollm2_tokenizer, tensor_parallel_size=2, kv_cache_dir=str(tmp_path), **settings)
    out = again.generate(prompts, GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == want[0] and out.num_cached_tokens == 40
    assert again.engine.kv_disk_tier.snapshot().hits == 5
    again.engine.shutdown()


def test_tp2_speculative_proposals_match_tp1(tiny_checkpoint, smollm2_tokenizer):
    """N-gram proposals verified on two ranks (the other rank learns the accepted tokens with the next step
    and cuts its tables as rank 0 does), under swap preemption: the tokens of one rank without proposals."""
    loaded = load_model(str(tiny_checkpoint("llama-kv4-untied")), dtype="float32")
    vocab = loaded.arch.vocab_size
    prompts = [[(k + i % 5) % vocab for i in range(30)] for k in range(6)]  # repeating: proposals come often
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    settings = {"max_model_len": 64, "block_size": 8, "num_blocks": 24, "preemption_mode": "swap",
                "swap_space": "1MiB", "max_num_seqs": 6}
    one = LLM.from_loaded(loaded, smollm2_tokenizer, **settings)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    two = LLM.from_loaded(loaded, smollm2_tokenizer, tensor_parallel_size=2, **settings, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 64})
    got = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert two.engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_tp2_on_the_embedded_model_float32(make_llm):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=10)
    settings = {"dtype": "float32", "quantization": "none", "max_model_len": 256}
    want = [o.outputs[0].text for o in make_llm(**settings).generate(prompts, params, use_tqdm=False)]
    one_scored = make_llm(**settings).generate(prompts[0], SCORED, use_tqdm=False)[0]
    two = make_llm(tensor_parallel_size=2, **settings)
    assert [o.outputs[0].text for o in two.generate(prompts, params, use_tqdm=False)] == want
    # Logprobs of the samples and of the prompt (the all-gathered logits, on every rank in lockstep).
    two_scored = two.generate(prompts[0], SCORED, use_tqdm=False)[0]
    assert two_scored.outputs[0].token_ids == one_scored.outputs[0].token_ids
    for got, ref in ((two_scored.outputs[0].logprobs, one_scored.outputs[0].logprobs),
                     (two_scored.prompt_logprobs[1:], one_scored.prompt_logprobs[1:])):
        assert len(got) == len(ref) and all(g.keys() == r.keys() for g, r in zip(got, ref, strict=True))
        for g, r in zip(got, ref, strict=True):
            for token, lp in g.items():
                assert lp.logprob == pytest.approx(r[token].logprob, abs=1e-3)
    stats = two.engine.stats()
    assert stats.kv_cache_pool_blocks > 0 and stats.kv_cache_budget_bytes > 0


def test_killed_rank_fails_requests_instead_of_hanging(tiny_checkpoint, smollm2_tokenizer):
    loaded = load_model(str(tiny_checkpoint("llama-kv4-untied")), dtype="float32")
    before = _children()
    llm = LLM.from_loaded(loaded, smollm2_tokenizer, tensor_parallel_size=2, max_model_len=128)
    (rank,) = _children() - before
    os.kill(rank, signal.SIGKILL)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=50), use_tqdm=False)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "generate hung after a rank died"
    assert len(errors) == 1 and isinstance(errors[0], TensorParallelError)
    assert f"tensor-parallel rank 1 (pid {rank}) was killed by SIGKILL" in str(errors[0])
    with pytest.raises(TensorParallelError, match="rank 1"):  # and every later call says so
        llm.generate([[1]], GREEDY, use_tqdm=False)


def test_settings_tp_cannot_split_are_refused_before_any_process_starts(make_llm):
    before = _children()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs float weights, but quantization='gguf'.*"
                                         r"--quantization none"):
        make_llm(tensor_parallel_size=2, quantization="gguf")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 cannot split the model's 3 KV heads \(9 attention "
                                         r"heads\).*at most 3"):
        make_llm(tensor_parallel_size=4, dtype="float32", quantization="none")
    assert _children() == before


EXIT_SCRIPT = """
import sys
import psutil
from tideserve import LLM
from tideserve.model.loader import load_model
from tideserve.tokenizer.tokenizer import load_tokenizer
llm = LLM.from_loaded(load_model(sys.argv[1], dtype="float32"), load_tokenizer(sys.argv[2]), tensor_parallel_size=2,
                      max_model_len=64)
llm.generate([[1, 2, 3]])
print(" ".join(str(p.pid) for p in psutil.Process().children()), flush=True)
"""  # and exits with the engine alive: interpreter exit must stop the rank


def test_interpreter_exit_leaves_no_rank(tiny_checkpoint, smollm2_gguf_path):
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tiny_checkpoint("llama-kv1-tied")),
                           str(smollm2_gguf_path)], capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Exception ignored" not in done.stderr, done.stderr[-3000:]
    (rank,) = map(int, done.stdout.split())
    assert not _wait_gone({rank}), "a rank outlived the interpreter"


def test_tp2_sleeps_and_wakes_on_every_rank(tiny_checkpoint, smollm2_tokenizer):
    """Sleep releases the weights on both ranks (rank 1's own resident set falls too) and a wake reloads
    each rank's shard: the answers are the same as before."""
    from tideserve.platform.host_memory import process_rss_bytes

    loaded = load_model(str(tiny_checkpoint("qwen2-kv3-bias")), dtype="float32")
    settings = {"max_model_len": 128, "block_size": 16}
    prompts = _prompts(loaded.arch.vocab_size)
    before = _children()
    two = LLM.from_loaded(loaded, smollm2_tokenizer, tensor_parallel_size=2, enable_sleep_mode=True, **settings)
    (rank,) = _children() - before
    want = _greedy(two, prompts)
    del loaded  # the engine's reload reads the file again: nothing else holds these weights
    rank_awake, here_awake = psutil.Process(rank).memory_info().rss, process_rss_bytes()
    two.sleep(2)
    assert psutil.Process(rank).memory_info().rss < rank_awake and process_rss_bytes() < here_awake
    two.wake_up()
    assert _greedy(two, prompts) == want
