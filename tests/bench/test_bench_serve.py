"""``tideserve bench serve`` and ``bench plot`` through the CLI, against the stub OpenAI server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tideserve.cli import main

STUB_MODEL = "stub-model"  # what the stub server in conftest.py lists
STUB_PROMPT_TOKENS_EXTRA = 1000  # the stub adds this to usage.prompt_tokens

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _assert_percentiles_ordered(metrics: dict) -> None:
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        stats = metrics[key]
        assert set(stats) == {"mean", "median", "p90", "p99"}, key
        assert stats["median"] is not None, key
        assert 0 <= stats["median"] <= stats["p90"] <= stats["p99"], (key, stats)


def _bench(args: list[str], out: Path) -> dict:
    assert main(["bench", "serve", "--disable-tqdm", "--save-result", str(out), *args]) == 0
    return json.loads(out.read_text())


def test_serve_report_uses_server_usage_and_counts_failures(stub_server, tokenizer_path, tmp_path):
    prompts = ["tell me about tides", "FAIL on purpose", "what is a paged cache",
               "explain continuous batching", "FAIL again", "why stream tokens"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    result = _bench(["--base-url", stub_server, "--tokenizer", tokenizer_path, "--dataset", "prompts-file",
                     "--dataset-path", str(tmp_path / "prompts.txt"), "--num-prompts", "6",
                     "--output-len", "5", "--max-concurrency", "2"], tmp_path / "out.json")

    assert result["kind"] == "serve" and result["label"] == STUB_MODEL  # model discovered from /v1/models
    assert result["config"]["ignore_eos"] is False  # real prompts: EOS is honoured by default
    [run] = result["runs"]
    m, records = run["metrics"], run["records"]
    assert (m["completed"], m["failed"]) == (4, 2)
    assert any("stub failure" in e for e in m["errors"])
    assert len(records) == 6
    for rec, prompt in zip(records, prompts):
        assert rec["success"] == ("FAIL" not in prompt), rec
        if not rec["success"]:
            assert rec["error"].startswith("HTTP 500")
            continue
        assert rec["usage_from_server"]
        assert rec["output_tokens"] == 5  # usage.completion_tokens
        assert rec["prompt_tokens"] == len(prompt.split()) + STUB_PROMPT_TOKENS_EXTRA  # usage, not tokenizer
        assert len(rec["itl_s"]) == 4  # one token per chunk: n - 1 gaps
        assert rec["ttft_s"] <= rec["e2el_s"]
        assert rec["generated_text"] == " word" * 5
    assert m["usage_from_server"] is True
    assert m["total_output_tokens"] == sum(r["output_tokens"] for r in records if r["success"]) == 20
    assert m["total_input_tokens"] == sum(r["prompt_tokens"] for r in records if r["success"])
    assert m["request_throughput"] == pytest.approx(4 / m["duration_s"])
    assert m["output_throughput"] == pytest.approx(20 / m["duration_s"])
    assert 1 <= m["peak_concurrent_requests"] <= 2
    _assert_percentiles_ordered(m)


def test_serve_chat_without_usage_counts_with_tokenizer(stub_server, tokenizer_path, tmp_path):
    from tideserve.tokenizer.tokenizer import load_tokenizer

    result = _bench(["--base-url", stub_server + "/nousage", "--model", STUB_MODEL, "--tokenizer",
                     tokenizer_path, "--endpoint", "chat", "--dataset", "random", "--input-len", "12",
                     "--num-prompts", "3", "--output-len", "4", "--request-rate", "100", "--warmup", "1"],
                    tmp_path / "out.json")
    [run] = result["runs"]
    m = run["metrics"]
    assert (m["completed"], m["failed"]) == (3, 0)
    assert result["config"]["ignore_eos"] is True  # random prompts ask for exact lengths
    expected = len(load_tokenizer(tokenizer_path).encode(" word" * 4, add_special_tokens=False))
    for rec in run["records"]:
        assert not rec["usage_from_server"]
        assert rec["output_tokens"] == expected
        assert rec["prompt_tokens"] == 12  # the dataset's exact length
    assert m["usage_from_server"] is False
    _assert_percentiles_ordered(m)


def test_sweep_saves_one_run_per_level_and_plot_draws_png(stub_server, tokenizer_path, tmp_path):
    chart = tmp_path / "sweep.png"
    a = _bench(["--base-url", stub_server, "--tokenizer", tokenizer_path, "--input-len", "8",
                "--num-prompts", "4", "--output-len", "3", "--sweep-concurrency", "1,2,4",
                "--label", "engine A", "--plot", str(chart)], tmp_path / "a.json")
    assert [r["max_concurrency"] for r in a["runs"]] == [1, 2, 4]
    assert all(r["metrics"]["completed"] == 4 for r in a["runs"])
    assert chart.read_bytes()[:8] == PNG_MAGIC

    b = dict(a, label="engine B")
    (tmp_path / "b.json").write_text(json.dumps(b))
    out = tmp_path / "compare.png"
    assert main(["bench", "plot", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_plot_rejects_a_file_that_is_not_a_result(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    assert main(["bench", "plot", str(bad), "-o", str(tmp_path / "x.png")]) == 2
    assert "not a tideserve bench result" in capsys.readouterr().err


def test_unreachable_server_is_reported_not_hung(tokenizer_path, tmp_path, capsys):
    from tideserve.bench.launch import free_port

    url = f"http://127.0.0.1:{free_port()}"
    rc = main(["bench", "serve", "--disable-tqdm", "--base-url", url, "--model", "m", "--tokenizer",
               tokenizer_path, "--num-prompts", "1", "--input-len", "4", "--ready-timeout", "1"])
    assert rc == 2
    assert "was not ready" in capsys.readouterr().err
