"""The OpenAI-compatible server through the official ``openai`` SDK (sync, async, streaming) and plain
HTTP: chat and completions, n, stop, seeds, logprobs, echo with prompt logprobs, usage, 32 concurrent
streams, disconnects, /metrics, request ids and logs. One server for the whole module."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tideserve.serve.config import ServerConfig
from tideserve.serve.openai.server import build_app

pytestmark = pytest.mark.slow  # the model end to end for seconds: `make test` runs it, `-m 'not slow'` does not

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "Name three colors."}]
PROMPT = "The capital of France is"
TIMEOUT = 60.0


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0, timeout=TIMEOUT)


def count_tokens(http: httpx.Client, **body) -> int:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def metrics(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    r = http.get("/metrics")
    assert r.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def metric(values: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in values.items() if n == name and all((k, lv) in ls for k, lv in labels.items()))


# ---------------------------------------------------------------------- discovery endpoints
def test_models_health_version(client, http, model, shared_engine):
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert models[0].model_extra["max_model_len"] == shared_engine.max_model_len
    assert client.models.retrieve(model).id == model
    health = http.get("/health")
    assert health.status_code == 200 and health.content == b""
    assert http.get("/version").json()["version"]


def test_tokenize_and_detokenize(http, shared_engine):
    r = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert r["tokens"] == shared_engine.tokenizer.encode(PROMPT)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == shared_engine.max_model_len
    assert len(r["token_strs"]) == r["count"]
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == shared_engine.tokenizer.encode_chat(MESSAGES)
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": PROMPT}


TOKENIZER_INFO_KEYS = {"tokenizer_class", "bos_token", "eos_token", "pad_token", "unk_token", "add_bos_token",
                       "chat_template", "model_max_length"}


def test_tokenizer_info_lets_a_client_tokenize_remotely(http, shared_engine):
    """What lm-evaluation-harness's remote tokenizer does: read /tokenizer_info (it must carry eos_token), then
    encode each text through /tokenize without special tokens; EOS's id is the first id of its text."""
    info = http.get("/tokenizer_info").json()
    tokenizer = shared_engine.tokenizer
    assert set(info) == TOKENIZER_INFO_KEYS  # no load arguments: they hold the server's file paths
    assert (info["eos_token"], info["bos_token"]) == (tokenizer.hf.eos_token, tokenizer.hf.bos_token)
    assert info["chat_template"] == tokenizer.chat_template and info["chat_template"]
    assert info["model_max_length"] == shared_engine.max_model_len
    assert info["add_bos_token"] is tokenizer.adds_bos
    eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos == [tokenizer.eos_token_id]


def test_tokenizer_info_follows_the_server_flags(shared_engine, server_thread):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with server_thread(build_app(ServerConfig(chat_template=template), engine=shared_engine)) as s:
        assert httpx.get(s.url + "/tokenizer_info", timeout=TIMEOUT).json()["chat_template"] == template
    with server_thread(build_app(ServerConfig(enable_tokenizer_info_endpoint=False), engine=shared_engine)) as s:
        r = httpx.get(s.url + "/tokenizer_info", timeout=TIMEOUT)
        assert r.status_code == 404 and r.json()["error"]["code"] == 404


# ---------------------------------------------------------------------- chat and completions (sync SDK)
def test_chat_completion(client, http, model):
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.model == model
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 8
    assert resp.usage.prompt_tokens == count_tokens(http, messages=MESSAGES)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8


def test_completion_n2_with_seed_and_usage(client, http, model):
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=2, seed=11, temperature=1.0,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.completion_tokens == 12
    assert resp.usage.prompt_tokens == count_tokens(http, prompt=PROMPT)


def test_seed_reproducibility(client, model):
    def sample(seed: int) -> list[str]:
        resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=1.0,
                                              n=2, seed=seed, extra_body={"ignore_eos": True})
        return [c.message.content for c in resp.choices]

    first = sample(1234)
    assert sample(1234) == first
    assert first[0] != first[1]  # each sample has its own generator (seed + index)


def test_stop_string(client, model):
    base = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[4:7]
    assert stop.strip(), base
    stopped = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                        stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text and base.startswith(stopped.text)
    assert stopped.model_extra["stop_reason"] == stop


def test_logprobs_completion_and_chat(client, model):
    comp = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                     extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == comp.choices[0].text
    assert lp.text_offset[0] == 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(value, abs=1e-4)  # greedy: the best is the chosen one
        assert token in top
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes).decode() == entry.token


def test_batch_and_token_id_prompts(client, http, model):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=model, prompt=[ids, [ids[0]]], max_tokens=3, n=2, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == by_text.choices[0].text[: len(batch.choices[0].text)]
    assert batch.usage.prompt_tokens == len(ids) + 1 and batch.usage.completion_tokens == 12
    texts = client.completions.create(model=model, prompt=["Hello", "Goodbye"], max_tokens=2, temperature=0)
    assert len(texts.choices) == 2


def test_echo_with_prompt_logprobs(client, http, model):
    """How lm-evaluation-harness scores: echo + logprobs returns the prompt tokens' logprobs."""
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    one = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1,
                                    temperature=0).choices[0]
    lp = one.logprobs
    assert one.text.startswith(PROMPT) and len(lp.tokens) == len(ids) + 1
    assert "".join(lp.tokens) == one.text and lp.text_offset[len(ids)] == len(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing to condition on
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
    # max_tokens=0: the prompt alone, scored the same way.
    echo = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                     temperature=0)
    assert echo.choices[0].text == PROMPT
    assert echo.usage.completion_tokens == 0 and echo.usage.prompt_tokens == len(ids)
    scores = echo.choices[0].logprobs.token_logprobs
    assert len(scores) == len(ids) and scores[0] is None
    assert scores[1:] == pytest.approx(lp.token_logprobs[1:len(ids)], abs=1e-4)
    streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                         temperature=0, stream=True)
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.text for c in chunks) == PROMPT and chunks[-1].finish_reason == "length"
    assert [v for c in chunks for v in c.logprobs.token_logprobs] == pytest.approx(scores, abs=1e-4)


# ---------------------------------------------------------------------- streaming
def test_streaming_chat_with_usage_matches_non_streaming(client, http, model):
    params = {"model": model, "messages": MESSAGES, "max_tokens": 10, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    full = client.chat.completions.create(**params).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **params))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == count_tokens(http, messages=MESSAGES)


def test_sse_wire_format(http, model):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 3, "stream": True, "temperature": 0}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


def test_async_client_streaming_completion(server, model):
    async def run() -> tuple[str, str, int]:
        async with async_client(server) as c:
            full = await c.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True})
            stream = await c.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})
            parts, usage = [], None
            async for chunk in stream:
                parts.extend(ch.text for ch in chunk.choices)
                usage = chunk.usage or usage
            return full.choices[0].text, "".join(parts), usage.completion_tokens

    full, streamed, completion_tokens = asyncio.run(asyncio.wait_for(run(), TIMEOUT))
    assert streamed == full and completion_tokens == 8


def test_32_concurrent_streams(server, http, model, shared_engine):
    """32 seeded streams at once all finish with exact usage, and each equals its non-streamed twin."""
    prompts = [f"Write a short sentence about the number {i}." for i in range(32)]

    async def one(c: openai.AsyncOpenAI, i: int, stream: bool) -> tuple[str, int, int]:
        kwargs = {"model": model, "prompt": prompts[i], "max_tokens": 8, "temperature": 0.8, "seed": 100 + i,
                  "extra_body": {"ignore_eos": True}}
        if not stream:
            resp = await c.completions.create(**kwargs)
            return resp.choices[0].text, resp.usage.prompt_tokens, resp.usage.completion_tokens
        parts, usage = [], None
        async for chunk in await c.completions.create(stream=True, stream_options={"include_usage": True},
                                                      **kwargs):
            parts.extend(ch.text for ch in chunk.choices)
            usage = chunk.usage or usage
        return "".join(parts), usage.prompt_tokens, usage.completion_tokens

    async def run(stream: bool):
        async with async_client(server) as c:
            return await asyncio.gather(*(one(c, i, stream) for i in range(32)))

    streamed = asyncio.run(asyncio.wait_for(run(True), 120))
    plain = asyncio.run(asyncio.wait_for(run(False), 120))
    for i, ((s_text, s_prompt, s_out), (p_text, p_prompt, p_out)) in enumerate(zip(streamed, plain)):
        assert s_out == p_out == 8
        assert s_prompt == p_prompt == count_tokens(http, prompt=prompts[i])
        assert s_text == p_text, i
    assert shared_engine.num_active() == 0


# ---------------------------------------------------------------------- disconnects, metrics, ids, logs
def test_disconnect_mid_stream_frees_blocks(http, model, shared_engine, wait_until):
    kv = shared_engine.engine.kv_manager
    total = kv.num_free_blocks
    before = metrics(http)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen >= 3:
                break
        assert kv.num_free_blocks < total  # the request holds blocks while it runs
    # Leaving the block closed the connection: the server aborts, and every block comes back.
    wait_until(lambda: kv.num_free_blocks == total and shared_engine.num_active() == 0, 15, "blocks freed")
    after = metrics(http)
    assert metric(after, "vllm:request_success_total", finished_reason="abort") == \
        metric(before, "vllm:request_success_total", finished_reason="abort") + 1
    assert metric(after, "vllm:generation_tokens_total") < metric(before, "vllm:generation_tokens_total") + 400


def test_disconnect_while_waiting_for_a_non_streaming_response(server, model, shared_engine, wait_until):
    kv = shared_engine.engine.kv_manager
    total = kv.num_free_blocks
    body = {"model": model, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=1.0)) as impatient, \
            pytest.raises(httpx.ReadTimeout):
        impatient.post("/v1/completions", json=body)  # gives up (closes the connection) after 1 s
    wait_until(lambda: kv.num_free_blocks == total and shared_engine.num_active() == 0, 15, "blocks freed")


def test_served_model_names(shared_engine, server_thread):
    config = ServerConfig(served_model_name="my-model,alias")
    with server_thread(build_app(config, engine=shared_engine)) as s, \
            openai.OpenAI(base_url=s.url + "/v1", api_key="EMPTY", max_retries=0, timeout=TIMEOUT) as c:
        assert [m.id for m in c.models.list().data] == ["my-model", "alias"]
        resp = c.completions.create(model="alias", prompt="Hi", max_tokens=1)
        assert resp.model == "my-model"
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model=shared_engine.model_name, prompt="Hi", max_tokens=1)


def test_metrics_parse_and_move(client, http, model):
    before = metrics(http)
    client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})
    after = metrics(http)
    names = {n for n, _ in after}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                 "vllm:fragmentation_ratio", "vllm:kv_cache_block_size", "vllm:kv_cache_pool_bytes",
                 "vllm:kv_cache_budget_bytes", "vllm:memory_utilization", "http_requests_total"):
        assert name in names, name
    assert all(dict(labels).get("model_name") == model for n, labels in after if n.startswith("vllm:"))

    def moved(name: str, **labels) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert moved("vllm:generation_tokens_total") == 4
    assert moved("vllm:prompt_tokens_total") == count_tokens(http, prompt=PROMPT)
    assert moved("vllm:request_success_total", finished_reason="length") == 1
    assert moved("vllm:time_to_first_token_seconds_count") == 1
    assert 1 <= moved("vllm:inter_token_latency_seconds_count") <= 3  # outputs may arrive coalesced
    assert moved("vllm:e2e_request_latency_seconds_count") == 1
    assert moved("http_requests_total", handler="/v1/completions", status="2xx") == 1
    assert metric(after, "vllm:num_requests_running") == 0


def test_request_id_header(http, model):
    r = http.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1},
                  headers={"X-Request-Id": "my-trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-trace-42"
    assert r.json()["id"] == "cmpl-my-trace-42"
    generated = http.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1})
    assert len(generated.headers["x-request-id"]) >= 16
    assert http.get("/health").headers["x-request-id"]


def test_access_log_and_ignored_fields(http, model, caplog, wait_until):
    secret = "my secret prompt text"

    def access_lines() -> list[str]:
        return [rec.getMessage() for rec in caplog.records if rec.name == "tideserve.serve.access"]

    with caplog.at_level(logging.INFO):
        for _ in range(2):
            r = http.post("/v1/completions", json={"model": model, "prompt": secret, "max_tokens": 2,
                                                   "not_a_field": 1, "ignore_eos": True},
                          headers={"X-Request-Id": "log-check"})
            assert r.status_code == 200
        wait_until(lambda: len(access_lines()) == 2, 5, "two access log lines")  # logged after the response
    access = access_lines()
    assert "request_id=log-check" in access[0] and "status=200" in access[0]
    assert "prompt_tokens=" in access[0] and "output_tokens=2" in access[0] and "latency_ms=" in access[0]
    assert not any(secret in rec.getMessage() for rec in caplog.records)
    ignored = [rec for rec in caplog.records if "ignored" in rec.getMessage()]
    assert len(ignored) == 1 and "not_a_field" in ignored[0].getMessage()
