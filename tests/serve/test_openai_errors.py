"""Every error the server returns: status, OpenAI shape ``{"error": {message, type, param, code}}`` and
message. Several small apps (auth + rate limit, body limit, tiny queue, dead engine) share the module's
engines, which share the session's loaded model."""

from __future__ import annotations

import logging
import threading

import httpx
import pytest
from starlette.testclient import TestClient

from tideserve.serve.config import ServerConfig, api_keys_from
from tideserve.serve.openai.server import build_app

openai = pytest.importorskip("openai")

TIMEOUT = 60.0
MESSAGES = [{"role": "user", "content": "Hi"}]


def assert_error(r: httpx.Response, status: int, err_type: str, contains: str = "", param: str | None = "") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert err["code"] == status and err["type"] == err_type, err
    assert contains in err["message"], err
    if param != "":
        assert err["param"] == param, err
    return err


@pytest.fixture(scope="module")
def server(shared_engine, server_thread):
    with server_thread(build_app(ServerConfig(max_body_bytes=64 * 1024), engine=shared_engine)) as s:
        yield s


# ---------------------------------------------------------------------- 400: context length
def test_prompt_longer_than_context(http, model, shared_engine):
    limit = shared_engine.max_model_len
    long_prompt = "hello " * (limit + 10)
    n = len(shared_engine.tokenizer.encode(long_prompt))
    err = assert_error(http.post("/v1/completions", json={"model": model, "prompt": long_prompt}),
                       400, "BadRequestError", f"maximum context length is {limit} tokens", "prompt")
    assert f"{n} in the prompt" in err["message"] and "16 in the completion" in err["message"]
    chat = [{"role": "user", "content": long_prompt}]
    err = assert_error(http.post("/v1/chat/completions", json={"model": model, "messages": chat}),
                       400, "BadRequestError", f"maximum context length is {limit} tokens", "messages")
    assert "tokens" in err["message"]


def test_max_tokens_beyond_context(http, model, shared_engine):
    limit = shared_engine.max_model_len
    err = assert_error(http.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": limit}),
                       400, "BadRequestError", f"maximum context length is {limit} tokens", "max_tokens")
    assert f"{limit} in the completion" in err["message"]
    assert_error(http.post("/v1/chat/completions",
                           json={"model": model, "messages": MESSAGES, "max_completion_tokens": 10**6}),
                 400, "BadRequestError", "maximum context length", "max_completion_tokens")


# ---------------------------------------------------------------------- 400: invalid parameters and bodies
@pytest.mark.parametrize(("extra", "param", "contains"), [
    ({"temperature": -1}, "temperature", "temperature must be a finite number >= 0, got -1"),
    ({"top_p": 0}, "top_p", "top_p must be in (0, 1]"),
    ({"n": 0}, "n", "n must be an integer >= 1"),
    ({"n": 1000}, "n", "n must be <= 128"),
    ({"top_k": -5}, "top_k", "top_k must be an integer >= 0"),
    ({"presence_penalty": 3}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "min_tokens must be <= max_tokens"),
    ({"temperature": "hot"}, "temperature", "temperature"),
    ({"max_tokens": -1}, "max_tokens", "max_tokens must be an integer >= 0"),
    ({"stop": [""]}, "stop", "stop must be a list of non-empty strings"),
    ({"seed": 2**70}, "seed", "seed"),
    ({"logprobs": 21}, "logprobs", "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
    ({"suffix": "x"}, "suffix", "suffix is not supported"),
    ({"logit_bias": {"5": 150}}, "logit_bias", "logit_bias['5'] must be in [-100, 100], got 150"),
    ({"logit_bias": {"10000000": 1}}, "logit_bias", "logit_bias['10000000'] is not a token id"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "must be keyed by a token id"),
    ({"allowed_token_ids": [10**8]}, "allowed_token_ids", "is not a token id"),
    ({"stop_token_ids": [10**8], "min_tokens": 2}, "stop_token_ids", "is not a token id"),
    ({"bad_words": [""]}, "bad_words", "bad_words must be a list of non-empty strings"),
    ({"n": 3, "best_of": 2}, "best_of", "best_of must be an integer >= n (3), got 2"),
    ({"best_of": 1000}, "best_of", "best_of must be <= 128"),
    ({"best_of": 3, "stream": True}, "best_of", "best_of is not supported with stream"),
    ({"priority": 1}, "priority", "Got priority 1 but Priority scheduling is not enabled."),
    ({"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens",
     "truncate_prompt_tokens value (1000000) is greater than max_model_len (512)"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "truncate_prompt_tokens must be -1"),
    ({"truncation_side": "middle"}, "truncation_side", "truncation_side"),
    ({"request_id": "has spaces"}, "request_id", "request_id must be 1-128 characters"),
    ({"use_beam_search": True}, "use_beam_search", "use_beam_search is not supported: beam search"),
    ({"logits_processors": ["my.module:Proc"]}, "logits_processors", "logits_processors is not supported"),
    ({"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params", "kv_transfer_params is not"),
    ({"prompt_embeds": "AAAA"}, "prompt_embeds", "prompt_embeds is not supported"),
    ({"cache_salt": ""}, "cache_salt", "cache_salt must be a non-empty string"),
    ({"prompt": ""}, "prompt", "prompt must not be empty"),
    ({"prompt": []}, "prompt", "prompt must not be empty"),
    ({"prompt": [10**9]}, "prompt", "out of range"),
    ({"prompt": [1.5]}, "prompt", "expected one of"),
    ({"prompt": None}, "prompt", "prompt"),
])
def test_invalid_completion_parameters(http, model, extra, param, contains):
    body = {"model": model, "prompt": "Hi", "max_tokens": 4, **extra}
    assert_error(http.post("/v1/completions", json=body), 400, "BadRequestError", contains, param)


@pytest.mark.parametrize(("extra", "param", "contains"), [
    ({"messages": None}, "messages", "messages"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "messages[0].role must be one of"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "messages[0].content"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs requires logprobs to be true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "greater than max allowed: 20"),
    ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1]"),
    ({"modalities": ["text", "audio"]}, "modalities", "modalities is not supported: only text output"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "audio is not supported"),
    ({"include_reasoning": False}, "include_reasoning", "include_reasoning false needs a reasoning parser"),
    ({"functions": [{"name": "f"}]}, "functions", "functions is not supported: deprecated"),
    ({"web_search_options": {}}, "web_search_options", "web_search_options is not supported"),
    ({"verbosity": "low"}, "verbosity", "verbosity is not supported"),
    ({"thinking_token_budget": 10}, "thinking_token_budget", "thinking_token_budget is not supported"),
    ({"reasoning_effort": "high"}, "reasoning_effort", "reasoning_effort is not supported: the chat template"),
    ({"documents": [{"title": "t", "text": "x"}]}, "documents", "documents is not supported"),
    ({"continue_final_message": True}, "continue_final_message", "Cannot set both `continue_final_message`"),
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message",
     "needs the last message to be the assistant's"),
    ({"chat_template": "{% for m in messages %}{{ m.content }"}, "chat_template", "Jinja syntax error at line 1"),
    ({"chat_template": "{{ raise_exception('no system message') }}"}, "messages", "no system message"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "may not set 'tokenize'"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "chat_template_kwargs"),
    ({"prompt_logprobs": 50}, "prompt_logprobs", "greater than max allowed: 20"),
])
def test_invalid_chat_parameters(http, model, extra, param, contains):
    body = {"model": model, "messages": MESSAGES, "max_tokens": 4, **extra}
    assert_error(http.post("/v1/chat/completions", json=body), 400, "BadRequestError", contains, param)


def test_malformed_bodies(http):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        assert_error(http.post(path, content=b'{"prompt": "Hi",', headers={"content-type": "application/json"}),
                     400, "BadRequestError", "not valid JSON", None)
        assert_error(http.post(path, json=["not", "an", "object"]), 400, "BadRequestError", "JSON object", None)
        assert_error(http.post(path, content=b""), 400, "BadRequestError", "not valid JSON", None)
    assert_error(http.post("/detokenize", json={"tokens": [-1]}), 400, "BadRequestError", "out of range", "tokens")
    assert_error(http.post("/tokenize", json={}), 400, "BadRequestError", "exactly one of prompt and messages")


def test_json_without_content_type_is_accepted(http, model):
    r = http.post("/v1/completions", content=b'{"prompt": "Hi", "max_tokens": 1}',
                  headers={"content-type": "application/x-www-form-urlencoded"})  # what curl -d sends
    assert r.status_code == 200, r.text


def test_duplicate_request_id_is_refused(http, model, shared_engine, wait_until):
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 300, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": "same-id"}) as first:
        lines = first.iter_lines()  # keep a reference: a dropped iterator closes the connection (abort)
        line = next(lines)
        assert '"finish_reason":null' in line, line  # still running
        second = http.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1},
                           headers={"X-Request-Id": "same-id"})
        assert_error(second, 400, "BadRequestError", "request_id 'same-id' is already in use")
    wait_until(lambda: shared_engine.num_active() == 0, 10, "the first request to be aborted")


# ---------------------------------------------------------------------- 404, 405, 413
def test_unknown_model_route_and_method(http, model):
    assert_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "Hi"}),
                 404, "NotFoundError", "The model `gpt-9` does not exist", "model")
    assert_error(http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": MESSAGES}),
                 404, "NotFoundError", "gpt-9", "model")
    assert_error(http.get("/v1/models/gpt-9"), 404, "NotFoundError", "gpt-9")
    assert_error(http.get("/v1/nothing-here"), 404, "NotFoundError", "/v1/nothing-here")
    assert_error(http.get("/v1/completions"), 405, "MethodNotAllowedError", "GET")


def test_oversized_body(http, model):
    big = {"model": model, "prompt": "x" * (70 * 1024)}
    assert_error(http.post("/v1/completions", json=big), 413, "RequestTooLargeError", "65536 bytes")

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(80):
            yield b" " * 1024

    assert_error(http.post("/v1/completions", content=chunks()), 413, "RequestTooLargeError", "limit")


def test_openai_sdk_raises_typed_errors(server, model):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0, timeout=TIMEOUT) as c:
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model=model, prompt="Hi", max_tokens=10**6)
        assert "maximum context length is" in info.value.message
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="nope", messages=MESSAGES)


# ---------------------------------------------------------------------- 401 and 429 (rate limit)
def test_api_key_and_rate_limit(shared_engine, server_thread, model):
    config = ServerConfig(api_keys=("sk-one", "sk-two"), rate_limit=3)
    with server_thread(build_app(config, engine=shared_engine)) as s, \
            httpx.Client(base_url=s.url, timeout=TIMEOUT) as http:
        assert_error(http.get("/v1/models"), 401, "AuthenticationError", "Unauthorized")
        assert_error(http.get("/v1/models", headers={"Authorization": "Bearer sk-wrong"}),
                     401, "AuthenticationError", "Unauthorized")
        assert_error(http.post("/tokenize", json={"prompt": "a"}, headers={"Authorization": "Basic sk-one"}),
                     401, "AuthenticationError")
        for path in ("/health", "/metrics", "/version"):
            assert http.get(path).status_code == 200, path
        with openai.OpenAI(base_url=s.url + "/v1", api_key="sk-nope", max_retries=0) as bad, \
                pytest.raises(openai.AuthenticationError):
            bad.models.list()
        two = {"Authorization": "Bearer sk-two"}
        for _ in range(3):
            assert http.get("/v1/models", headers=two).status_code == 200
        limited = http.get("/v1/models", headers=two)
        assert_error(limited, 429, "RateLimitError", "at most 3 requests per minute")
        assert 1 <= int(limited.headers["retry-after"]) <= 60
        # Keys are limited separately; the SDK with a good key works.
        with openai.OpenAI(base_url=s.url + "/v1", api_key="sk-one", max_retries=0, timeout=TIMEOUT) as good:
            assert good.models.list().data[0].id == model


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("TIDESERVE_API_KEY", "sk-env")
    assert api_keys_from(None) == ("sk-env",)
    assert api_keys_from(["sk-cli"]) == ("sk-cli",)
    monkeypatch.delenv("TIDESERVE_API_KEY")
    assert api_keys_from(None) == ()


# ---------------------------------------------------------------------- 429 (queue) and 503 (dead engine)
@pytest.fixture(scope="module")
def tiny_engine(make_engine):
    """One request at a time and a waiting queue of one: the third concurrent request is refused."""
    return make_engine(max_queue=1, max_num_seqs=1, num_blocks=64)


def test_queue_full_gets_429(tiny_engine, server_thread, wait_until):
    with server_thread(build_app(ServerConfig(), engine=tiny_engine)) as s, \
            httpx.Client(base_url=s.url, timeout=TIMEOUT) as http:
        running = {"prompt": "Once upon a time", "max_tokens": 300, "stream": True, "ignore_eos": True}
        waiting_result: dict = {}

        def send_waiting() -> None:
            with httpx.Client(base_url=s.url, timeout=TIMEOUT) as other:
                waiting_result["r"] = other.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})

        with http.stream("POST", "/v1/completions", json=running) as first:
            lines = first.iter_lines()
            next(lines)  # running: it holds the only slot
            waiter = threading.Thread(target=send_waiting, daemon=True)
            waiter.start()
            wait_until(lambda: tiny_engine.queue_depth() == 1, 10, "one waiting request")
            refused = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert_error(refused, 429, "RateLimitError", "waiting queue is full")
            assert refused.headers["retry-after"] == "1"
        waiter.join(TIMEOUT)  # the first stream was closed (aborted), so the waiting one runs
        assert waiting_result["r"].status_code == 200


def test_dead_engine_fails_requests_and_health(make_engine, server_thread, wait_until):
    engine = make_engine(max_num_seqs=2, num_blocks=64)
    with server_thread(build_app(ServerConfig(), engine=engine)) as s, \
            httpx.Client(base_url=s.url, timeout=TIMEOUT) as http:
        body = {"prompt": "Once upon a time", "max_tokens": 300, "stream": True, "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            next(lines)

            def broken_step():
                raise RuntimeError("simulated device failure")

            engine.engine.step = broken_step
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert "simulated device failure" in rest[-2] and '"code":503' in rest[-2]
        wait_until(lambda: not engine.is_healthy, 5, "the engine to be marked dead")
        assert_error(http.get("/health"), 503, "ServiceUnavailableError", "engine is not running")
        assert_error(http.post("/v1/completions", json={"prompt": "Hi"}), 503, "ServiceUnavailableError",
                     "simulated device failure")
        assert http.get("/metrics").status_code == 200


def test_health_is_503_while_loading_then_200(make_engine, wait_until):
    release = threading.Event()

    def load():
        assert release.wait(30)
        return make_engine(num_blocks=32, max_num_seqs=1)

    app = build_app(ServerConfig(), engine_factory=load)
    with TestClient(app) as c:  # runs the lifespan, which starts loading in the background
        assert_error(c.get("/health"), 503, "ServiceUnavailableError", "still loading")
        assert_error(c.post("/v1/completions", json={"prompt": "x"}), 503, "ServiceUnavailableError",
                     "still loading")
        release.set()
        wait_until(lambda: c.get("/health").status_code == 200, 30, "the model to load")
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] > 0


def test_failed_load_is_reported():
    def load():
        raise ValueError("model file is corrupt")

    with TestClient(build_app(ServerConfig(), engine_factory=load)) as c:
        for _ in range(500):
            if c.app.state.tideserve.load_error:
                break
            threading.Event().wait(0.01)
        assert_error(c.get("/health"), 503, "ServiceUnavailableError", "failed to load: model file is corrupt")


def test_log_prompts_option(shared_engine, server_thread, caplog, wait_until):
    with server_thread(build_app(ServerConfig(log_prompts=True), engine=shared_engine)) as s, \
            httpx.Client(base_url=s.url, timeout=TIMEOUT) as http, caplog.at_level(logging.INFO):
        r = http.post("/v1/completions", json={"prompt": "a very visible prompt", "max_tokens": 1})
        assert r.status_code == 200
        wait_until(lambda: any("a very visible prompt" in r.getMessage() for r in caplog.records), 5, "prompt log")
