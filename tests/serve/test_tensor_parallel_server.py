"""``tideserve serve --tensor-parallel-size 2`` driven by the openai SDK: greedy outputs equal one rank's
offline ones; SIGTERM stops the server and every rank. A rank killed under a running server turns
/health to 503 and requests get a clear OpenAI-shaped error (never a hang)."""

from __future__ import annotations

import os
import signal

import httpx
import psutil
import pytest
from serve_process import log_tail, start_serve

from tideserve import SamplingParams

pytestmark = pytest.mark.slow  # starts processes: run by `make test`, skipped by `-m "not slow"`

openai = pytest.importorskip("openai")

LOAD_TIMEOUT = 180.0
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "Name a primary colour."}]


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    log = open(tmp_path_factory.mktemp("tp-serve") / "serve.log", "w+")  # closed below, after the process
    proc, url = start_serve(["--tensor-parallel-size", "2", "--dtype", "float32", "--max-model-len", "256",
                             "--num-blocks", "64", "--max-num-seqs", "4"], log, dict(os.environ), LOAD_TIMEOUT)
    try:
        yield proc, url, log
    finally:
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)] if proc.poll() is None else []
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for rank in ranks:  # only if a test failed before the server stopped them
            if rank.is_running():
                rank.kill()
        log.close()


def test_tp2_server_greedy_equals_offline_tp1(tp_server, make_llm):
    _, url, _ = tp_server
    llm = make_llm(dtype="float32", quantization="none", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=12)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    want_chat = llm.chat(CHAT, params)[0].outputs[0].text
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)
    model = client.models.list().data[0].id
    got = client.completions.create(model=model, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == want_chat
    stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == want[0]


def test_sigterm_stops_the_server_and_every_rank(tp_server):
    proc, _, log = tp_server
    ranks = psutil.Process(proc.pid).children(recursive=True)
    assert len(ranks) == 1, [r.cmdline() for r in ranks]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, log_tail(log)
    gone, alive = psutil.wait_procs(ranks, timeout=15)
    assert not alive, f"ranks outlived the server: {[r.pid for r in alive]}"


def test_killed_rank_turns_health_503(tiny_tp_engine, server_thread, wait_until):
    from tideserve.serve.config import ServerConfig
    from tideserve.serve.openai.server import build_app

    engine, rank_pid = tiny_tp_engine
    with server_thread(build_app(ServerConfig(), engine=engine)) as s, httpx.Client(base_url=s.url, timeout=30) as http:
        body = {"model": engine.model_name, "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
        assert http.post("/v1/completions", json=body).status_code == 200
        assert http.get("/health").status_code == 200
        os.kill(rank_pid, signal.SIGKILL)
        wait_until(lambda: http.get("/health").status_code == 503, timeout=15, what="/health to turn 503")
        health = http.get("/health").json()["error"]["message"]
        assert f"tensor-parallel rank 1 (pid {rank_pid}) was killed by SIGKILL" in health
        refused = http.post("/v1/completions", json=body)
        assert refused.status_code == 503 and "rank 1" in refused.json()["error"]["message"]


@pytest.fixture
def tiny_tp_engine(tmp_path, smollm2_gguf_path):
    """An AsyncEngine with tensor_parallel_size=2 over a tiny random Llama saved in ``tmp_path``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tideserve.engine.async_engine import AsyncEngine
    from tideserve.engine.llm_engine import EngineArgs
    from tideserve.model.loader import load_model
    from tideserve.tokenizer.tokenizer import load_tokenizer

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    engine = AsyncEngine.from_loaded(EngineArgs(tensor_parallel_size=2, max_model_len=128),
                                     load_model(str(tmp_path), dtype="float32"),
                                     load_tokenizer(str(smollm2_gguf_path)))
    (rank,) = {p.pid for p in psutil.Process().children(recursive=True)} - before
    yield engine, rank
    engine.shutdown(timeout=5)
    assert not psutil.pid_exists(rank) or psutil.Process(rank).status() == psutil.STATUS_ZOMBIE
