"""An fp8 KV cache (``--kv-cache-dtype fp8``) behind the OpenAI server: the openai SDK's completions and
streams work, the cache really is float8 read by the native decode kernel, and once the requests end the
pool holds no block (/metrics says so while the server idles)."""

from __future__ import annotations

import httpx
import pytest
import torch

from tideserve.serve.config import ServerConfig
from tideserve.serve.openai.server import build_app

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def fp8_server(make_engine, server_thread):
    engine = make_engine(kv_cache_dtype="fp8")
    with server_thread(build_app(ServerConfig(), engine=engine)) as s:
        yield s, engine


def used_blocks(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "vllm:kv_cache_used_blocks":
                return sample.value
    raise AssertionError("vllm:kv_cache_used_blocks not in /metrics")


@pytest.mark.slow
def test_fp8_cache_serves_the_openai_sdk_and_idles_empty(fp8_server, wait_until):
    server, engine = fp8_server
    inner = engine.engine
    assert inner.kv_dtype == torch.float8_e4m3fn
    assert inner.executor.driver_worker.kv_storage.caches[0][0].dtype == torch.float8_e4m3fn
    native_calls = []
    backend = inner.executor.driver_worker.runner.attn_backend
    if backend.name == "cpu-native":  # the kernel, not torch's fallback, reads the cache
        decode = backend._paged_decode
        backend._paged_decode = lambda *a: native_calls.append(1) or decode(*a)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, max_tokens=24, temperature=0,
                                          messages=[{"role": "user", "content": "Name three colours."}])
    assert chat.choices[0].message.content and chat.usage.completion_tokens > 1
    stream = client.completions.create(model=model, prompt="The capital of France is", max_tokens=12,
                                       temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    plain = client.completions.create(model=model, prompt="The capital of France is", max_tokens=12,
                                      temperature=0)
    assert streamed == plain.choices[0].text and streamed  # greedy: the stream and the plain call agree
    if backend.name == "cpu-native":
        assert native_calls
    wait_until(lambda: used_blocks(server.url) == 0, 15, "the idle pool to hold no block")
