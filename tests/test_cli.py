"""The command line through its public entry point, in a subprocess as a user would run it."""

import subprocess
import sys

import pytest


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tideserve.cli", "--log-level", "WARNING", *args],
                          input=stdin, capture_output=True, text=True, timeout=300)


def test_generate_greedy_and_chat():
    out = run_cli("generate", "--dtype", "float32", "--prompt", "The capital of France is",
                  "--temperature", "0", "--max-tokens", "4")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    chat = run_cli("chat", "--dtype", "float32", "--temperature", "0", "--max-tokens", "8",
                   stdin="Say hello.\n\n")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.strip()


def test_bad_flag_values_exit_with_a_clear_error():
    out = run_cli("generate", "--max-model-len", "10000000", "--prompt", "x")
    assert out.returncode == 2
    assert "max_model_len=10000000 is larger than the model's trained context" in out.stderr
    out = run_cli("generate", "--kv-cache-memory", "lots", "--prompt", "x")
    assert out.returncode == 2 and "kv_cache_memory must be a size" in out.stderr
    out = run_cli("generate", "--quantization", "int3", "--prompt", "x")
    assert out.returncode == 2 and "invalid choice: 'int3'" in out.stderr
    out = run_cli("generate", "--kv-cache-dtype", "fp8", "--prompt", "x")
    assert out.returncode == 2 and "invalid choice: 'fp8'" in out.stderr


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_generate_with_quantized_weights(method):
    import torch

    from tideserve.model.layers.quantization import unavailable_reason

    if unavailable_reason(method, torch.device("cpu")):
        pytest.skip(unavailable_reason(method, torch.device("cpu")))
    out = run_cli("generate", "--dtype", "float32", "--quantization", method, "--prompt",
                  "The capital of France is", "--temperature", "0", "--max-tokens", "4")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
