"""Every command line in the seeds' articles (three vLLM articles, listed below), with ``vllm``'s entry points
mapped to tideserve's and the model replaced by the embedded one, through the real parser and the
engine-argument validation; seed 000's main ``vllm serve`` line runs end to end.

The seeds' command lines, as written (000: MRV2 article; 001: PagedAttention guide; 004: migration):
  000  vllm serve –enable-mrv2                                  (an en dash where -- belongs)
  000  vllm serve meta-llama/Llama-3-16B-Instruct --tensor-parallel-size 1 --max-model-len 4096 --port 8000
  000  vllm bench --model meta-llama/Llama-3-16B-Instruct --num-prompts 100 --concurrency 50 --output-len 256
  000  vllm serve --help | grep -i "max_model_len"
  000  vllm --version
  000  docker ... vllm/vllm-openai:0.28.0 --model meta-llama/Llama-3-8B-Instruct --gpu-memory-utilization 0.9
         --max-model-len 4096 --max-num-seqs 256
  000  docker ... vllm/vllm-openai:0.29.0 --model meta-llama/Llama-3-8B-Instruct --max-model-len 4096
         --max-num-seqs 256 --log-level info                    (the comment adds --enforce-eager for debugging)
  000  Kubernetes args: --model meta-llama/Llama-3-8B-Instruct --max-model-len 4096 --max-num-seqs 256
  001  python -m vllm.entrypoints.api_server --model meta-llama/Llama-2-70b-chat-hf --tensor-parallel-size 8
         --block-size 32 --swap-space 16G --max-num-seqs 256 --quantization awq
  001  python -m vllm.entrypoints.api_server --max-num-batched-tokens 10240 --max-paddings 128
  001  CUDA_VISIBLE_DEVICES=0 python -m vllm.entrypoints.api_server --model model1 --gpu-memory-utilization 0.4
  001  flags it recommends: --enable-dynamic-batching, --use-contiguous-batching, --use-v2-block-manager,
         --block-size 64, --preemption-mode recompute
  004  python -m vllm.entrypoints.openai.api_server --model Qwen/Qwen-7B-Chat --tensor-parallel-size 2
         --max-num-sqs 256 --host 0.0.0.0 --port 8000           (max-num-sqs: a typo in the article)
The vllm-openai image's entry point is the OpenAI server, so the docker and Kubernetes arguments follow
``tideserve serve``. The seeds' Python calls are in tests/engine/test_vllm_api_compat.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tideserve import __version__
from tideserve.cli import main, parse_command_line
from tideserve.cli_engine_args import engine_kwargs
from tideserve.engine.llm_engine import EngineArgs

M = "{MODEL}"  # replaced by the embedded model's path
AWQ_MESSAGE = "quantization='awq' is not supported: tideserve cannot read awq checkpoints"

# (seed, argv after `tideserve`, the warnings' and the errors' expected substrings)
SEEDS = [
    ("000", ["serve", "\u2013enable-mrv2"],
     ["starts with a typographic dash", "--enable-mrv2 has no effect in tideserve: there is one model runner"], []),
    ("000", ["serve", M, "--tensor-parallel-size", "1", "--max-model-len", "4096", "--port", "8000"], [], []),
    ("000", ["bench", "--model", M, "--num-prompts", "100", "--concurrency", "50", "--output-len", "256"],
     [], ["tideserve bench needs a subcommand before its flags: one of serve, offline, plot"]),
    ("000", ["bench", "serve", "--model", M, "--num-prompts", "100", "--concurrency", "50", "--output-len", "256"],
     [], ["unrecognized flag --concurrency: tideserve bench serve has no such flag; did you mean "
          "--max-concurrency"]),
    ("000", ["serve", "--model", M, "--gpu-memory-utilization", "0.9", "--max-model-len", "4096",
             "--max-num-seqs", "256"], [], []),
    ("000", ["serve", "--model", M, "--max-model-len", "4096", "--max-num-seqs", "256", "--log-level", "info"],
     [], []),
    ("000", ["serve", "--model", M, "--max-model-len", "4096", "--max-num-seqs", "256", "--log-level", "info",
             "--enforce-eager"], [], []),
    ("000", ["serve", "--model", M, "--max-model-len", "4096", "--max-num-seqs", "256"], [], []),
    ("001", ["serve", "--model", M, "--tensor-parallel-size", "8", "--block-size", "32", "--swap-space", "16G",
             "--max-num-seqs", "256", "--quantization", "awq"], [], [AWQ_MESSAGE]),  # -tp 8 itself parses
    ("001", ["serve", "--model", M, "--tensor-parallel-size", "1", "--block-size", "32", "--swap-space", "16G",
             "--max-num-seqs", "256", "--quantization", "awq"],
     [], [AWQ_MESSAGE]),
    ("001", ["serve", "--max-num-batched-tokens", "10240", "--max-paddings", "128"],
     ["--max-paddings has no effect in tideserve: batches are flat"], []),
    ("001", ["serve", "--model", M, "--gpu-memory-utilization", "0.4"], [], []),
    ("001", ["serve", "--model", M, "--enable-dynamic-batching", "--use-contiguous-batching",
             "--use-v2-block-manager", "--block-size", "64", "--preemption-mode", "recompute"],
     ["--enable-dynamic-batching has no effect", "--use-contiguous-batching has no effect",
      "--use-v2-block-manager has no effect"], []),
    ("004", ["serve", "--model", M, "--tensor-parallel-size", "2", "--max-num-sqs", "256", "--host", "0.0.0.0",
             "--port", "8000"],
     [], ["unrecognized flag --max-num-sqs: tideserve serve has no such flag; did you mean --max-num-seqs?"]),
]


@pytest.mark.parametrize(("seed", "argv", "warnings", "errors"), SEEDS,
                         ids=[f"{s[0]}-{i}" for i, s in enumerate(SEEDS)])
def test_seed_command_line(smollm2_gguf_path, seed, argv, warnings, errors):
    argv = [str(smollm2_gguf_path) if a == M else a for a in argv]
    cl = parse_command_line(argv)
    for expected in warnings:
        assert any(expected in w for w in cl.warnings), (expected, cl.warnings)
    assert len(cl.warnings) == len(warnings), cl.warnings
    for expected in errors:
        assert any(expected in e for e in cl.errors), (expected, cl.errors)
    if errors:
        return
    assert cl.errors == []
    if getattr(cl.ns, "_has_engine_args", False):
        model, cache, sched = EngineArgs(**engine_kwargs(cl.ns)).configs()
        if str(smollm2_gguf_path) in argv:
            assert model.model == str(smollm2_gguf_path)
        if "--max-model-len" in argv:
            assert model.max_model_len == int(argv[argv.index("--max-model-len") + 1])
        if "--swap-space" in argv:
            assert cache.swap_space == 16.0


def test_seed_help_and_version(capsys):
    with pytest.raises(SystemExit) as done:  # vllm serve --help | grep -i "max_model_len"
        main(["serve", "--help"])
    assert done.value.code == 0 and "max_model_len" in capsys.readouterr().out.lower()
    with pytest.raises(SystemExit) as done:  # vllm --version
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == __version__


def test_seed_errors_reach_the_user_all_at_once(capsys):
    rc = main(["serve", "--model", "Qwen/Qwen-7B-Chat", "--tensor-parallel-size", "2", "--max-num-sqs", "256",
               "--host", "0.0.0.0", "--port", "8000"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "tideserve serve: error: unrecognized flag --max-num-sqs" in err and "did you mean --max-num-seqs?" in err
    assert "tensor_parallel_size" not in err  # -tp 2 is a real setting now


@pytest.mark.slow  # starts a process
def test_seed_serve_command_runs_end_to_end(smollm2_gguf_path, tmp_path):
    """Seed 000: vllm serve MODEL --tensor-parallel-size 1 --max-model-len 4096 --port 8000, as
    ``python -m tideserve`` on a free port: it loads, answers /health and lists the model at 4096."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "tideserve", "serve", str(smollm2_gguf_path), "--tensor-parallel-size", "1",
           "--max-model-len", "4096", "--port", str(port), "--trust-remote-code"]
    with open(tmp_path / "serve.log", "w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, f"the server exited early:\n{log_text(log)}"
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, f"not healthy after 120 s:\n{log_text(log)}"
                time.sleep(0.25)
            cards = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]
            assert [c["max_model_len"] for c in cards] == [4096]
        finally:
            proc.terminate()
            proc.wait(30)
        assert "--trust-remote-code has no effect in tideserve" in log_text(log)


def log_text(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-4000:]
