"""Hostile HTTP input never gets a 5xx or a reset connection: deeply nested JSON, non-finite numbers,
bodies over --max-body-size (sent with a length, chunked, or behind "Expect: 100-continue"), and an
engine step that hangs (/health turns 503 while it hangs, and back to 200 after)."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from tideserve.serve.config import ServerConfig
from tideserve.serve.openai.json_body import MAX_JSON_DEPTH
from tideserve.serve.openai.server import build_app

openai = pytest.importorskip("openai")

TIMEOUT = 60.0
POST_PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
BIG = 20 * 2**20  # over the default --max-body-size of 16 MiB


@pytest.fixture(scope="module")
def server(shared_engine, server_thread):
    with server_thread(build_app(ServerConfig(), engine=shared_engine)) as s:  # the default limits
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c


def assert_error(r: httpx.Response, status: int, contains: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == status and contains in body["error"]["message"], body
    return body["error"]


def json_post(http: httpx.Client, path: str, raw: bytes) -> httpx.Response:
    return http.post(path, content=raw, headers={"content-type": "application/json"})


def test_deeply_nested_json_is_a_400(http):
    deep = b"[" * 100_000 + b"]" * 100_000
    deep_object = b'{"a":' * 50_000 + b"1" + b"}" * 50_000
    inside = b'{"prompt": "Hi", "max_tokens": 1, "extra": ' + b"[" * 500 + b"]" * 500 + b"}"
    for path in POST_PATHS:
        for body in (deep, deep_object, inside):
            assert_error(json_post(http, path, body), 400, f"nests deeper than {MAX_JSON_DEPTH} levels")
    ok = b'{"prompt": "Hi", "max_tokens": 1, "extra": ' + b"[" * 100 + b"]" * 100 + b"}"
    assert json_post(http, "/v1/completions", ok).status_code == 200
    assert http.get("/health").status_code == 200


def test_non_finite_numbers_are_a_400(http):
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        assert_error(json_post(http, "/v1/completions", b'{"prompt": "Hi", "temperature": ' + literal + b"}"),
                     400, f"{literal.decode()} is not a JSON value")
    assert_error(json_post(http, "/v1/completions", b'{"prompt": "Hi", "top_p": 1e999}'), 400,
                 "the number 1e999 is out of range")


def test_body_over_the_limit_gets_a_readable_413(http, server):
    prompt = b'{"prompt": "' + b"x" * BIG + b'"}'
    for path in POST_PATHS:
        err = assert_error(json_post(http, path, prompt), 413, "larger than the limit of 16777216 bytes")
        assert err["type"] == "RequestTooLargeError"

    def chunks():  # no Content-Length: the limit is found while reading
        piece = b" " * 2**20
        for _ in range(BIG // len(piece)):
            yield piece

    assert_error(http.post("/v1/completions", content=chunks()), 413, "--max-body-size")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0, timeout=TIMEOUT) as client:
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=server.state.model_name, prompt="x" * BIG, max_tokens=1)
    assert info.value.status_code == 413 and "larger than the limit" in info.value.message
    assert http.get("/health").status_code == 200


def test_expect_100_continue_is_answered_before_the_body(server):
    """curl sends "Expect: 100-continue" for large bodies: the 413 comes without the body being sent."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % BIG)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"RequestTooLargeError"' in reply


def test_a_hung_engine_step_turns_health_503_until_it_returns(make_engine, server_thread, wait_until):
    engine = make_engine(num_blocks=32, max_num_seqs=2)
    release, entered = threading.Event(), threading.Event()
    real_step = engine.engine.step

    def hanging_step():
        entered.set()
        assert release.wait(30), "the test never released the step"
        return real_step()

    config = ServerConfig(engine_stall_timeout=0.5)
    with server_thread(build_app(config, engine=engine)) as s, httpx.Client(base_url=s.url, timeout=TIMEOUT) as http:
        assert http.get("/health").status_code == 200
        engine.engine.step = hanging_step
        result: dict = {}
        worker = threading.Thread(target=lambda: result.setdefault(
            "r", http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})))
        worker.start()
        try:
            assert entered.wait(10), "the engine never started a step"
            wait_until(lambda: http.get("/health").status_code == 503, 10, "/health to report the stall")
            err = assert_error(http.get("/health"), 503, "The engine is stalled: its current step has run for")
            assert "engine_stall_timeout=0.5 s (--engine-stall-timeout)" in err["message"]
            assert_error(http.post("/v1/completions", json={"prompt": "Hi"}), 503, "stalled")
        finally:
            engine.engine.step = real_step
            release.set()
        worker.join(TIMEOUT)
        assert result["r"].status_code == 200  # the request that waited on the hung step completes
        wait_until(lambda: http.get("/health").status_code == 200, 10, "/health to recover")
        assert engine.is_healthy
