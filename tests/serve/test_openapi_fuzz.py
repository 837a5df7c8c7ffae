"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis): whatever a client
sends, valid or not, the server never answers 5xx and every error is OpenAI-shaped.

The app runs in-process on a real engine with a short context and n capped at 2, so the requests the
fuzzer gets through to generation stay cheap; the example budget keeps the whole run bounded.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings

from tideserve.serve.config import ServerConfig
from tideserve.serve.openai.server import build_app

pytestmark = pytest.mark.slow  # the model end to end for seconds: `make test` runs it, `-m 'not slow'` does not

schemathesis = pytest.importorskip("schemathesis")

# Examples per operation and mode: about 340 requests in all (a parameterless GET needs one). Valid
# generation requests run the model (up to a context's worth of tokens, one request at a time), so they
# get fewer.
MAX_EXAMPLES = 50
MAX_GENERATION_EXAMPLES = 15
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings")


@pytest.fixture(scope="module")
def fuzz_app(make_engine):
    engine = make_engine(max_model_len=64, num_blocks=64, max_num_seqs=8, max_logprobs=5)
    return build_app(ServerConfig(max_n=2, max_body_bytes=64 * 1024), engine=engine)


@pytest.fixture(scope="module")
def api_schema(fuzz_app):
    return schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)


def assert_openai_error(status: int, payload: object, where: str) -> None:
    assert isinstance(payload, dict) and set(payload) == {"error"}, (where, payload)
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}, (where, err)
    assert isinstance(err["message"], str) and err["message"] and err["code"] == status, (where, err)


def check_response(case, seen: dict) -> None:
    response = case.call()
    key = (case.path, response.status_code)
    seen[key] = seen.get(key, 0) + 1
    where = f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}"
    assert response.status_code < 500, where
    if response.status_code >= 400:
        assert_openai_error(response.status_code, response.json(), where)
    elif response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    assert event["error"]["code"] < 500, where
                    assert_openai_error(event["error"]["code"], event, where)


def test_the_schema_describes_every_body(fuzz_app):
    from starlette.testclient import TestClient

    doc = TestClient(fuzz_app).get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/tokenize",
                 "/detokenize"):
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        body = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
        assert body["properties"]["model"]["anyOf"][0] == {"enum": fuzz_app.state.tideserve.served_names}
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["messages"]
    assert chat["items"]["properties"]["role"]["enum"] == ["system", "user", "assistant", "tool"]


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_server_errors_and_every_error_is_openai_shaped(api_schema, mode):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 10  # every route is in the schema
    if mode == "negative":  # only a body can be invalid (a path parameter is always a string)
        operations = [op for op in operations if op.method.upper() == "POST"]
    seen: dict[tuple[str, int], int] = {}
    for operation in operations:
        strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))
        generation = mode == "positive" and operation.path in GENERATION_PATHS
        run = settings(max_examples=MAX_GENERATION_EXAMPLES if generation else MAX_EXAMPLES, deadline=None,
                       derandomize=True, database=None, suppress_health_check=list(HealthCheck))(
            given(strategy)(lambda case: check_response(case, seen)))
        run()
    assert sum(seen.values()) >= (150 if mode == "positive" else 120), seen
    if mode == "positive":  # the fuzzer got through validation to the model, not only to 400s
        assert all(seen.get((path, 200)) for path in GENERATION_PATHS), seen
