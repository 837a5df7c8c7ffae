"""No silent ignores: every request field of /v1/completions, /v1/chat/completions, /v1/responses and
/v1/embeddings is honoured,
refused when set (a 400 naming it), or accepted and ignored because it cannot change the result; the
catalogue (serve/openai/fields.py), the request models and docs/api.md agree; unknown fields are
accepted with one warning per name."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import httpx
import pytest

from tideserve.serve.config import ServerConfig
from tideserve.serve.openai.fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    EMBEDDING_FIELDS,
    RESPONSES_FIELDS,
    EndpointFields,
)
from tideserve.serve.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ResponsesRequest,
)
from tideserve.serve.openai.server import build_app

ENDPOINTS = [("/v1/completions", CompletionRequest, COMPLETION_FIELDS),
             ("/v1/chat/completions", ChatCompletionRequest, CHAT_FIELDS),
             ("/v1/responses", ResponsesRequest, RESPONSES_FIELDS),
             ("/v1/embeddings", EmbeddingRequest, EMBEDDING_FIELDS)]
API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"

# A value that asks for something, per refused field (a new refused field needs one here).
REFUSED_VALUES = {
    "suffix": "tail", "prompt_embeds": "AAAA", "use_beam_search": True, "logits_processors": ["m:P"],
    "logprob_token_ids": [1, 2], "kv_transfer_params": {"do_remote_decode": True},
    "thinking_token_budget": 8, "modalities": ["text", "audio"], "audio": {"voice": "alloy"},
    "verbosity": "high", "web_search_options": {}, "functions": [{"name": "f"}],
    "function_call": "auto", "guided_whitespace_pattern": r"[\n ]*",
    "structural_tag": {"type": "structural_tag", "structures": []},
    "previous_response_id": "resp_1", "conversation": "conv_1", "background": True, "prompt": {"id": "pmpt_1"},
    "include": ["reasoning.encrypted_content"], "reasoning": {"effort": "high"}, "top_logprobs": 2,
    "truncation": "auto", "messages": [{"role": "user", "content": "The sky is blue"}],
}
# A value per ignored field (each must leave the result unchanged).
IGNORED_VALUES = {
    "user": "user-1", "spaces_between_special_tokens": False, "length_penalty": 2.0,
    "vllm_xargs": {"k": 1}, "stream_interval": 4, "session_id": "s-1", "metadata": {"team": "a"},
    "store": True, "service_tier": "flex", "prediction": {"type": "content", "content": "Blue"},
    "prompt_cache_key": "k", "safety_identifier": "u-1", "mm_processor_kwargs": {"num_crops": 4},
    "media_io_kwargs": {"video": {"num_frames": 4}}, "guided_decoding_backend": "xgrammar",
    "stream_options": {"include_obfuscation": False}, "max_tool_calls": 3,
}


@pytest.mark.parametrize(("path", "model", "fields"), ENDPOINTS)
def test_every_declared_field_is_in_exactly_one_class(path, model, fields: EndpointFields):
    classes = fields.classes()
    for name in model.model_fields:
        owners = [kind for kind, table in classes.items() if name in table]
        assert len(owners) == 1, f"{path}: field {name!r} is in {owners or 'no class'}"
    for kind, table in classes.items():
        for name in table:
            assert name in model.model_fields, f"{path}: {kind} field {name!r} is not in {model.__name__}"


def _doc_rows() -> dict[str, dict[str, str]]:
    """docs/api.md's field tables: endpoint ('completions' / 'chat' / 'responses') -> field -> class."""
    rows: dict[str, dict[str, str]] = {"completions": {}, "chat": {}, "responses": {}, "embeddings": {}}
    for line in API_DOC.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^\| `([a-z_]+)` \| ([^|]+?) \| ([^|]+?) \|", line)
        if m:
            for endpoint in (e.strip() for e in m.group(2).split(",")):
                rows[endpoint][m.group(1)] = m.group(3).strip()
    return rows


@pytest.mark.parametrize(("endpoint", "fields"), [("completions", COMPLETION_FIELDS), ("chat", CHAT_FIELDS),
                                                  ("responses", RESPONSES_FIELDS),
                                                  ("embeddings", EMBEDDING_FIELDS)])
def test_docs_list_every_field_with_its_class(endpoint, fields: EndpointFields):
    documented = _doc_rows()[endpoint]
    expected = {name: kind for kind, table in fields.classes().items() for name in table}
    assert documented == expected


@pytest.fixture(scope="module")
def server(shared_engine, server_thread):
    with server_thread(build_app(ServerConfig(), engine=shared_engine)) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _body(path: str, **extra) -> dict:
    if path == "/v1/embeddings":
        return {"input": "The sky is blue", **extra}
    if path == "/v1/responses":
        return {"input": "What color is the sky?", "max_output_tokens": 5, "temperature": 0, **extra}
    base = ({"prompt": "The sky is"} if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": "What color is the sky?"}]})
    return {**base, "max_tokens": 5, "temperature": 0, **extra}


def _reply(path: str, body: dict):
    """What a field may not change: the text (completions), the message (chat), the output items' text, the
    vector (embeddings)."""
    if path == "/v1/embeddings":
        return body["data"][0]["embedding"]
    if path == "/v1/responses":
        return [(item["type"], item.get("content"), item.get("arguments")) for item in body["output"]]
    return body["choices"][0]["text" if path == "/v1/completions" else "message"]


@pytest.mark.parametrize(("path", "model", "fields"), ENDPOINTS)
def test_each_refused_field_gets_a_400_naming_it(http, path, model, fields: EndpointFields):
    assert set(fields.refused) <= set(REFUSED_VALUES), "give the new refused field a value above"
    for name in fields.refused:
        r = http.post(path, json=_body(path, **{name: REFUSED_VALUES[name]}))
        assert r.status_code == 400, (name, r.text)
        err = r.json()["error"]
        assert err["param"] == name and err["message"].startswith(f"{name} is not supported: "), err
        default = model.model_fields[name].default  # the default (asking for nothing) passes
        assert fields.refused[name].accepts(default), name


@pytest.mark.parametrize(("path", "model", "fields"), ENDPOINTS)
def test_ignored_fields_change_nothing_and_are_not_reported(http, path, model, fields, caplog):
    assert set(fields.ignored) <= set(IGNORED_VALUES), "give the new ignored field a value above"
    plain = http.post(path, json=_body(path))
    with caplog.at_level(logging.WARNING):
        r = http.post(path, json=_body(path, **{n: IGNORED_VALUES[n] for n in fields.ignored}))
    assert r.status_code == 200, r.text
    assert _reply(path, r.json()) == _reply(path, plain.json())
    assert not [rec for rec in caplog.records if "ignored" in rec.getMessage()]


def test_unknown_fields_are_accepted_and_reported_once_per_name(http, caplog):
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings"):
                assert http.post(path, json=_body(path, made_up_field_x=1)).status_code == 200
    warnings = [rec.getMessage() for rec in caplog.records if "made_up_field_x" in rec.getMessage()]
    assert len(warnings) == 1 and "present in the request but ignored" in warnings[0]
