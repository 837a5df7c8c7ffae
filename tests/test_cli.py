"""The command line through its public entry point, in a subprocess as a user would run it."""

import subprocess
import sys

import pytest


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tideserve.cli", "--log-level", "WARNING", *args],
                          input=stdin, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # starts a process
def test_generate_greedy_and_chat():
    out = run_cli("generate", "--dtype", "float32", "--prompt", "The capital of France is",
                  "--temperature", "0", "--max-tokens", "4")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    chat = run_cli("chat", "--dtype", "float32", "--temperature", "0", "--max-tokens", "8",
                   stdin="Say hello.\n\n")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.strip()


@pytest.mark.slow  # starts a process
def test_bad_flag_values_exit_with_a_clear_error():
    out = run_cli("generate", "--max-model-len", "10000000", "--prompt", "x")
    assert out.returncode == 2
    assert "max_model_len=10000000 is larger than the model's trained context" in out.stderr
    out = run_cli("generate", "--kv-cache-memory", "lots", "--prompt", "x")
    assert out.returncode == 2 and "kv_cache_memory must be a size" in out.stderr
    out = run_cli("generate", "--quantization", "int3", "--prompt", "x")
    assert out.returncode == 2 and "quantization must be one of auto, none, gguf, int8, int4, got 'int3'" in out.stderr
    out = run_cli("generate", "--kv-cache-dtype", "fp8_e5m2", "--prompt", "x")
    assert out.returncode == 2 and "invalid choice: 'fp8_e5m2'" in out.stderr


@pytest.mark.slow  # starts a process
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_generate_with_quantized_weights(method):
    import torch

    from tideserve.model.layers.quant.methods import unavailable_reason

    if unavailable_reason(method, torch.device("cpu")):
        pytest.skip(unavailable_reason(method, torch.device("cpu")))
    out = run_cli("generate", "--dtype", "float32", "--quantization", method, "--prompt",
                  "The capital of France is", "--temperature", "0", "--max-tokens", "4")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


# ---------------------------------------------------------------------- vLLM's command lines (parsing only)
def parsed(*argv: str):
    from tideserve.cli import parse_command_line

    return parse_command_line(list(argv))


def engine_configs(cl):
    from tideserve.cli_engine_args import engine_kwargs
    from tideserve.engine.llm_engine import EngineArgs

    assert cl.errors == [], cl.errors
    return EngineArgs(**engine_kwargs(cl.ns)).configs()


@pytest.mark.slow  # starts a process
def test_version_and_python_dash_m():
    for args in (["--version"], ["serve", "--version"], ["bench", "serve", "--version"]):
        out = subprocess.run([sys.executable, "-m", "tideserve", *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == tideserve_version(), (args, out.stderr)


def tideserve_version() -> str:
    from tideserve import __version__

    return __version__


def test_model_positional_or_flag():
    assert parsed("serve", "m.gguf").ns.model == "m.gguf"
    assert parsed("serve", "--port", "9000", "m.gguf").ns.model == "m.gguf"
    assert parsed("serve", "m.gguf", "--model", "m.gguf").errors == []
    assert parsed("serve", "a.gguf", "--model", "b.gguf").errors == [
        "the model is given twice, as MODEL 'a.gguf' and as --model 'b.gguf'; give it once."]
    assert parsed("serve", "a.gguf", "b.gguf").errors[0].startswith("unexpected argument 'b.gguf'")


def test_global_options_before_or_after_the_subcommand():
    assert parsed("serve").ns.log_level == "INFO"
    assert parsed("--log-level", "debug", "serve").ns.log_level == "DEBUG"
    assert parsed("serve", "--log-level", "info").ns.log_level == "INFO"
    assert parsed("--log-level", "error", "serve", "--port", "1").ns.log_level == "ERROR"
    assert parsed("bench", "serve", "--log-level", "warning").ns.log_level == "WARNING"


def test_sizes_take_units():
    _, cache, _ = engine_configs(parsed("serve", "--swap-space", "16G", "--kv-cache-memory", "4GiB"))
    assert cache.swap_space == 16.0 and cache.kv_cache_memory == 4 * 2**30
    _, cache, _ = engine_configs(parsed("serve", "--swap-space", "512M", "--kv-cache-memory-bytes", "512M"))
    assert cache.swap_space == 0.5 and cache.kv_cache_memory == 512 * 2**20
    _, cache, _ = engine_configs(parsed("serve", "--swap-space", "4", "--kv-cache-memory", "1000000000"))
    assert cache.swap_space == 4.0 and cache.kv_cache_memory == 10**9  # bare numbers: GiB and bytes, as vLLM
    assert parsed("serve", "--swap-space", "16Q").errors == [
        "swap_space must be a size such as 4GiB, 512MiB, 16G or a byte count, got '16Q'."]
    assert parsed("serve", "--max-body-size", "1MiB").ns.max_body_size == 2**20


def test_vllm_engine_flags_that_work():
    model, cache, sched = engine_configs(parsed("serve", "-tp", "1", "--enforce-eager", "--dtype", "half",
                                                "--num-gpu-blocks-override", "64", "--enable-chunked-prefill"))
    assert model.enforce_eager and model.dtype == "float16" and cache.num_blocks == 64
    assert sched.enable_chunked_prefill
    cl = parsed("serve", "--disable-log-stats", "--engine-stall-timeout", "5", "--uvicorn-log-level", "info")
    from tideserve.cli import server_config

    config = server_config(cl.ns)
    assert cl.ns.disable_log_stats and config.engine_stall_timeout == 5.0 and config.uvicorn_log_level == "info"


def test_multi_device_flags_explain_what_to_do():
    for flag, name in (("--pipeline-parallel-size", "pipeline_parallel_size"), ("-dp", "data_parallel_size")):
        (error,) = parsed("serve", flag, "4").errors
        assert error.startswith(f"{name}=4 (") and "is not implemented in tideserve yet" in error
        assert "one tideserve server per device" in error and "--tensor-parallel-size N" in error
    cl = parsed("serve", "-tp", "2")  # tensor parallelism exists
    assert cl.errors == [] and cl.ns.tensor_parallel_size == 2


def test_vllm_flags_without_meaning_warn_or_refuse():
    cl = parsed("serve", "m.gguf", "--trust-remote-code", "--disable-log-requests", "--tokenizer", "m.gguf",
                "--tokenizer-mode", "auto")
    assert cl.errors == []
    assert [w.split(" has no effect")[0] for w in cl.warnings] == [
        "--trust-remote-code", "--tokenizer-mode", "--tokenizer", "--disable-log-requests"]
    assert "--trust-remote-code has no effect in tideserve: its model architectures are built in" in cl.warnings[0]
    cl = parsed("serve", "m.gguf", "--tokenizer", "other/tok", "--tokenizer-mode", "slow", "--ssl-certfile", "c.pem",
                "--revision", "main")
    assert cl.errors == [
        "--tokenizer-mode slow is not supported by tideserve: the model's fast tokenizer is always used.",
        "--tokenizer other/tok is not supported by tideserve: the tokenizer always comes with the model (its "
        "GGUF metadata or its directory's tokenizer files).",
        "--revision main is not supported by tideserve: a hub id is fetched at its default revision; download "
        "the revision you want and pass its local directory as the model.",
        "--ssl-certfile c.pem is not supported by tideserve: tideserve serves plain HTTP; terminate TLS in a "
        "reverse proxy (nginx, envoy, a cloud load balancer) in front of it."]


def test_cpu_offload_is_refused_on_a_gpu_before_anything_loads(capsys):
    """vLLM's --cpu-offload-gb could decide whether a model fits a GPU, and tideserve offloads nothing: the
    engine refuses to start on CUDA, with the reason and what to do instead (no GPU is needed to see it: the
    check comes before the weights load)."""
    from tideserve.cli import main

    cl = parsed("serve", "--device", "cuda", "--cpu-offload-gb", "4")
    assert cl.errors == [] and cl.warnings == [] and engine_configs(cl)[0].cpu_offload_gb == 4.0
    # Loading onto cuda would fail here (no GPU) with another error: this one comes first.
    assert main(["generate", "--device", "cuda", "--cpu-offload-gb", "4", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "error: cpu_offload_gb=4 is not supported on cuda: tideserve keeps every weight in device memory" in err
    assert "--quantization int4" in err and "--tensor-parallel-size N" in err
    (error,) = parsed("serve", "--cpu-offload-gb", "-1").errors
    assert "cpu_offload_gb must be a number of GiB >= 0, got -1.0" in error


def test_cpu_offload_only_warns_on_the_cpu(make_llm, caplog):
    """On the CPU the weights are host memory already: the engine starts and says the flag changes nothing."""
    caplog.set_level("WARNING", logger="tideserve.engine.builder")
    llm = make_llm(device="cpu", dtype="float32", max_model_len=256, cpu_offload_gb=4)
    assert any(r.getMessage() == "cpu_offload_gb=4 has no effect on the cpu: the weights are host memory already."
               for r in caplog.records)
    from tideserve import SamplingParams

    assert llm.generate(["Hello"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_unknown_flags_fail_with_the_closest_ones(capsys):
    from tideserve.cli import main

    assert main(["serve", "--max-num-sqs", "256", "--gpu-memory-utilisation=0.5", "--frobnicate"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "tideserve serve: error: unrecognized flag --max-num-sqs: tideserve serve has no such flag; did you mean "
        "--max-num-seqs? (tideserve serve --help lists them all)",
        "tideserve serve: error: unrecognized flag --gpu-memory-utilisation: tideserve serve has no such flag; "
        "did you mean --gpu-memory-utilization? (tideserve serve --help lists them all)",
        "tideserve serve: error: unrecognized flag --frobnicate: tideserve serve has no such flag. "
        "(tideserve serve --help lists them all)"]
    assert main(["generate", "--prompt", "x", "--max-tokns", "3"]) == 2
    assert "did you mean --max-tokens?" in capsys.readouterr().err


@pytest.mark.slow  # starts a process (that stops at argument parsing, before loading a model)
def test_an_unknown_reasoning_parser_is_refused_at_start_naming_the_known_ones():
    out = run_cli("serve", "--reasoning-parser", "deepseek")
    assert out.returncode == 2
    assert "--reasoning-parser: invalid choice: 'deepseek' (choose from 'deepseek_r1', 'qwen3')" in out.stderr


def test_server_config_refuses_an_unknown_reasoning_parser():
    from tideserve.serve.config import ServerConfig

    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3, got 'r1'"):
        ServerConfig(reasoning_parser="r1")
    assert ServerConfig(reasoning_parser="qwen3").reasoning_parser == "qwen3"
