"""``tideserve bench offline`` through the CLI on a few tiny prompts (the embedded SmolLM2, float32)."""

from __future__ import annotations

import json

import pytest

from tideserve.cli import main

pytestmark = pytest.mark.slow  # the model end to end for seconds: `make test` runs it, `-m 'not slow'` does not

ENGINE = ["--dtype", "float32", "--max-num-seqs", "4", "--max-model-len", "128", "--disable-tqdm"]


def test_offline_bench_reports_exact_counts_and_counts_refused_requests(tokenizer_path, tmp_path):
    # Three good prompts, and one whose output cannot fit max_model_len: the engine refuses it.
    lines = [{"prompt": p, "output_len": 4}
             for p in ("The tide comes in", "Paged attention is", "A scheduler decides")]
    lines.append({"prompt": "Too long", "output_len": 1000})
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    out = tmp_path / "offline.json"
    rc = main(["bench", "offline", *ENGINE, "--dataset", "prompts-file",
               "--dataset-path", str(tmp_path / "p.jsonl"),
               "--num-prompts", "4", "--ignore-eos", "--max-concurrency", "2", "--save-result", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["kind"] == "offline"
    assert result["config"]["engine"]["resolved_dtype"] == "torch.float32"
    [run] = result["runs"]
    m, records = run["metrics"], run["records"]
    assert (m["completed"], m["failed"]) == (3, 1)
    assert "max_tokens=1000 is too large" in records[3]["error"]
    for rec in records[:3]:
        assert rec["success"] and rec["output_tokens"] == 4 and len(rec["itl_s"]) == 3
        assert rec["prompt_tokens"] > 0 and rec["ttft_s"] <= rec["e2el_s"]
    assert m["total_output_tokens"] == 12
    assert 1 <= m["peak_concurrent_requests"] <= 2
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        s = m[key]
        assert s["median"] <= s["p90"] <= s["p99"], key


def test_offline_sweep_random_prompts(tmp_path):
    out = tmp_path / "sweep.json"
    rc = main(["bench", "offline", *ENGINE, "--num-prompts", "3", "--input-len", "10", "--output-len", "3",
               "--sweep-concurrency", "1,3", "--save-result", str(out)])
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["max_concurrency"] for r in runs] == [1, 3]
    for run in runs:
        assert run["metrics"]["completed"] == 3
        assert run["metrics"]["total_input_tokens"] == 30  # random prompts have exact lengths
        assert run["metrics"]["total_output_tokens"] == 9  # random prompts ignore EOS by default
    assert runs[0]["metrics"]["peak_concurrent_requests"] == 1


def test_the_warm_up_leaves_no_cached_prefix_for_the_timed_run(make_llm):
    """The warm-up runs the first requests, which the timed run then repeats: their prompts must be
    computed again (a prefix cache hit would skip their prefill and inflate the figures)."""
    from tideserve.bench.datasets import SampleRequest
    from tideserve.bench.offline import run_offline_benchmark

    llm = make_llm(dtype="float32", max_model_len=256, enable_prefix_caching=True)
    tok = llm.tokenizer
    texts = ["The tide comes in and the tide goes out, twice a day, " * 3, "Paged attention splits the cache " * 4]
    requests = [SampleRequest(t, tok.encode(t), 2) for t in texts]
    computed = [0]
    execute = llm.engine.executor.driver_worker.runner.execute

    def counting(out):
        computed[0] += out.total_num_scheduled_tokens
        return execute(out)

    llm.engine.executor.driver_worker.runner.execute = counting
    run_offline_benchmark(llm, requests, warmup=2, progress=False)
    prompts = sum(r.prompt_len for r in requests)
    # warm-up and timed run each compute every prompt token and one decode per request
    assert computed[0] == 2 * (prompts + len(requests))
