"""Structured output over HTTP, through the official ``openai`` SDK: ``response_format`` (json_object,
json_schema) on chat and on completions, vLLM's ``structured_outputs`` (json, regex, choice, grammar) and
the older ``guided_*`` fields; streaming and not, n > 1, greedy and seeded sampling, several schemas.

Almost every request runs in one concurrent batch (``batch`` below) next to unconstrained requests, which
must come back exactly as they do alone at temperature 0; the tests then check each output parses and
validates. Invalid schemas, regexes and grammars are 400s naming the field, and the server serves on.
The schemas are closed and bounded (``additionalProperties: false``, short strings, small arrays), so
every path through them ends well inside ``max_tokens``: "finished and valid" can be asserted, not hoped.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # the model end to end for seconds: `make test` runs it, `-m 'not slow'` does not

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

TIMEOUT = 120.0
MAX_TOKENS = 96
PERSON = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "role": {"enum": ["admin", "user", "guest"]}},
}
ORDER = {
    "type": "object", "additionalProperties": False, "required": ["id", "items", "paid"],
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]$"},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
        "paid": {"type": "boolean"},
    },
}
POINTS = {"type": "array", "minItems": 1, "maxItems": 3,
          "items": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9},
                    "minItems": 2, "maxItems": 2}}
SCHEMAS = {"person": PERSON, "order": ORDER, "points": POINTS}
ASK = {"person": "Describe a user account as JSON.", "order": "Write a shop order as JSON.",
       "points": "List some 2D points as JSON."}
PHONE = r"[0-9]{3}-[0-9]{4}"
COLORS = ["red", "green", "blue"]
GBNF = 'root ::= [1-9] " + " [1-9] " = " [0-9] [0-9]?'  # llama.cpp's notation
LARK = 'start: NUM " apples"\nNUM: /[1-9][0-9]?/'
GBNF_RE, LARK_RE = r"[1-9] \+ [1-9] = [0-9][0-9]?", r"[1-9][0-9]? apples"
PLAIN_CHAT = "Name three colors."
PLAIN_PROMPT = "The capital of France is"


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def json_schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def _requests(model: str) -> dict[str, tuple[str, dict]]:
    """name -> (endpoint, create() kwargs) for every request of the shared batch."""
    base = {"model": model, "max_tokens": MAX_TOKENS}
    greedy = {**base, "temperature": 0}
    reqs: dict[str, tuple[str, dict]] = {}
    for name in SCHEMAS:  # response_format json_schema, chat: greedy, sampled n=2, streamed
        reqs[f"chat-{name}"] = ("chat", {**greedy, "messages": chat(ASK[name]),
                                         "response_format": json_schema_format(name)})
        reqs[f"chat-{name}-sampled"] = ("chat", {**base, "messages": chat(ASK[name]), "n": 2, "temperature": 1.0,
                                                 "seed": 7, "response_format": json_schema_format(name)})
    reqs["chat-person-stream"] = ("chat", {**reqs["chat-person"][1], "stream": True})
    reqs["chat-order-sampled-stream"] = ("chat", {**reqs["chat-order-sampled"][1], "stream": True})
    for name in ("person", "points"):  # response_format on completions (vLLM accepts it there too)
        reqs[f"cmpl-{name}"] = ("cmpl", {**greedy, "prompt": ASK[name] + "\n",
                                         "extra_body": {"response_format": json_schema_format(name)}})
    reqs["cmpl-person-stream"] = ("cmpl", {**reqs["cmpl-person"][1], "stream": True})
    reqs["cmpl-order-sampled-stream"] = ("cmpl", {
        **base, "prompt": ASK["order"] + "\n", "n": 3, "temperature": 0.9, "seed": 3, "stream": True,
        "extra_body": {"response_format": json_schema_format("order")}})
    # json_object: any JSON object (prompts for which the small model closes its object)
    reqs["chat-json-object"] = ("chat", {**greedy, "messages": chat("Return a JSON object with keys name and age "
                                                                    "for Bob, 30."),
                                         "response_format": {"type": "json_object"}})
    reqs["cmpl-json-object-stream"] = ("cmpl", {**greedy, "prompt": "A JSON object with a name:", "stream": True,
                                                "extra_body": {"response_format": {"type": "json_object"}}})
    # vLLM's structured_outputs and the older guided_* fields
    so = {"json": {"json": ORDER}, "regex": {"regex": PHONE}, "choice": {"choice": COLORS},
          "grammar": {"grammar": GBNF}}
    reqs["so-json"] = ("cmpl", {**greedy, "prompt": ASK["order"] + "\n",
                                "extra_body": {"structured_outputs": so["json"]}})
    reqs["so-regex"] = ("chat", {**greedy, "messages": chat("A phone number?"),
                                 "extra_body": {"structured_outputs": so["regex"]}})
    reqs["so-choice"] = ("cmpl", {**base, "prompt": "My favourite color is", "n": 4, "temperature": 1.0, "seed": 1,
                                  "extra_body": {"structured_outputs": so["choice"]}})
    reqs["so-grammar"] = ("chat", {**greedy, "messages": chat("Write a small sum."),
                                   "extra_body": {"structured_outputs": so["grammar"]}})
    reqs["so-grammar-lark-stream"] = ("cmpl", {**greedy, "prompt": "How many apples?", "stream": True,
                                               "extra_body": {"structured_outputs": {"grammar": LARK}}})
    reqs["guided-json"] = ("chat", {**greedy, "messages": chat(ASK["person"]),
                                    "extra_body": {"guided_json": json.dumps(PERSON)}})  # a schema as JSON text
    reqs["guided-regex"] = ("cmpl", {**greedy, "prompt": "Call me at", "extra_body": {"guided_regex": PHONE}})
    reqs["guided-choice-stream"] = ("chat", {**greedy, "messages": chat("Pick a color."), "stream": True,
                                             "extra_body": {"guided_choice": COLORS}})
    reqs["guided-grammar"] = ("cmpl", {**greedy, "prompt": "Math:", "extra_body": {"guided_grammar": GBNF}})
    # unconstrained neighbours
    plain = {"max_tokens": 24, "temperature": 0, "extra_body": {"ignore_eos": True}}
    reqs["plain-chat"] = ("chat", {"model": model, "messages": chat(PLAIN_CHAT), **plain})
    reqs["plain-cmpl"] = ("cmpl", {"model": model, "prompt": PLAIN_PROMPT, **plain})
    return reqs


async def _run(c: openai.AsyncOpenAI, endpoint: str, kwargs: dict) -> dict[str, Any]:
    """{"texts": [per choice], "finish": [per choice]}; streams are reassembled chunk by chunk."""
    n = kwargs.get("n", 1)
    create = c.chat.completions.create if endpoint == "chat" else c.completions.create
    if not kwargs.get("stream"):
        resp = await create(**kwargs)
        choices = sorted(resp.choices, key=lambda ch: ch.index)
        texts = [ch.message.content if endpoint == "chat" else ch.text for ch in choices]
        return {"texts": texts, "finish": [ch.finish_reason for ch in choices]}
    texts, finish = [""] * n, [None] * n
    async for chunk in await create(**kwargs):
        for ch in chunk.choices:
            piece = ch.delta.content if endpoint == "chat" else ch.text
            texts[ch.index] += piece or ""
            finish[ch.index] = ch.finish_reason or finish[ch.index]
    return {"texts": texts, "finish": finish}


@pytest.fixture(scope="module")
def batch(server, model):
    """Every request of ``_requests`` at once (one engine batch), plus the unconstrained ones alone first."""
    reqs = _requests(model)

    async def go(names):
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0,
                                      timeout=TIMEOUT) as c:
            results = await asyncio.gather(*(_run(c, *reqs[name]) for name in names))
        return dict(zip(names, results))

    alone = {}
    for name in ("plain-chat", "plain-cmpl"):
        alone.update(asyncio.run(asyncio.wait_for(go([name]), TIMEOUT)))
    together = asyncio.run(asyncio.wait_for(go(list(reqs)), 2 * TIMEOUT))
    return together, alone


def _valid_json(result: dict, schema: dict | None) -> list[Any]:
    values = []
    for text, finish in zip(result["texts"], result["finish"]):
        assert finish == "stop", (finish, text)
        value = json.loads(text)
        if schema is None:
            assert isinstance(value, dict), text  # json_object
        else:
            jsonschema.validate(value, schema)
        values.append(value)
    return values


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_response_format_json_schema_on_chat_validates(batch, name):
    together, _ = batch
    _valid_json(together[f"chat-{name}"], SCHEMAS[name])
    sampled = together[f"chat-{name}-sampled"]
    assert len(sampled["texts"]) == 2
    _valid_json(sampled, SCHEMAS[name])


def test_response_format_on_completions_and_streams_validate(batch):
    together, _ = batch
    for name in ("person", "points"):
        _valid_json(together[f"cmpl-{name}"], SCHEMAS[name])
    _valid_json(together["cmpl-person-stream"], PERSON)
    _valid_json(together["chat-person-stream"], PERSON)
    # a greedy stream carries exactly the non-streamed text
    assert together["chat-person-stream"]["texts"] == together["chat-person"]["texts"]
    assert together["cmpl-person-stream"]["texts"] == together["cmpl-person"]["texts"]
    assert len(_valid_json(together["cmpl-order-sampled-stream"], ORDER)) == 3
    # the same seeded n=2 request, streamed or not, gives the same samples
    assert together["chat-order-sampled-stream"]["texts"] == together["chat-order-sampled"]["texts"]


def test_json_object_gives_a_json_object(batch):
    together, _ = batch
    _valid_json(together["chat-json-object"], None)
    _valid_json(together["cmpl-json-object-stream"], None)


def test_structured_outputs_and_guided_fields(batch):
    together, _ = batch
    _valid_json(together["so-json"], ORDER)
    _valid_json(together["guided-json"], PERSON)
    for name, pattern in (("so-regex", PHONE), ("guided-regex", PHONE), ("so-grammar", GBNF_RE),
                          ("guided-grammar", GBNF_RE), ("so-grammar-lark-stream", LARK_RE)):
        (text,), (finish,) = together[name]["texts"], together[name]["finish"]
        assert finish == "stop" and re.fullmatch(pattern, text), (name, finish, text)
    choices = together["so-choice"]
    assert len(choices["texts"]) == 4 and set(choices["finish"]) == {"stop"}
    assert set(choices["texts"]) <= set(COLORS), choices
    (text,), (finish,) = together["guided-choice-stream"]["texts"], together["guided-choice-stream"]["finish"]
    assert finish == "stop" and text in COLORS


def test_unconstrained_neighbours_are_unchanged(batch):
    together, alone = batch
    for name in ("plain-chat", "plain-cmpl"):
        assert together[name]["texts"] == alone[name]["texts"]
        assert together[name]["finish"] == ["length"]
        assert not together[name]["texts"][0].lstrip().startswith("{")  # no grammar leaked into them


BAD_REQUESTS = [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format.json_schema.schema", "nonsense"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema", "json_schema.schema"),
    ("cmpl", {"extra_body": {"guided_regex": "[a-"}}, "guided_regex", "regex"),
    ("cmpl", {"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs", "regex"),
    ("chat", {"extra_body": {"guided_grammar": "root ::= ( "}}, "guided_grammar", "grammar"),
    ("cmpl", {"extra_body": {"structured_outputs": {"grammar": "start: undefined_rule"}}}, "structured_outputs",
     "undefined_rule"),
    ("chat", {"extra_body": {"guided_json": "{not json"}}, "guided_json", "not valid JSON"),
    ("cmpl", {"extra_body": {"guided_choice": []}}, "guided_choice", "non-empty list"),
    ("chat", {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs",
     "regex, choice"),
    ("cmpl", {"extra_body": {"guided_json": PERSON, "guided_regex": PHONE}}, "guided_regex",
     "guided_json and guided_regex"),
    ("chat", {"extra_body": {"structured_outputs": {"regex": "a", "typo": 1}}}, "structured_outputs.typo",
     "typo"),
    ("chat", {"response_format": {"type": "structural_tag"}}, "response_format", "structural_tag"),
]


@pytest.mark.parametrize(("endpoint", "extra", "param", "words"), BAD_REQUESTS,
                         ids=[b[2] + "-" + b[3].replace(" ", "_") for b in BAD_REQUESTS])
def test_invalid_constraints_are_400s_naming_the_problem(client, model, endpoint, extra, param, words):
    kwargs = {"model": model, "max_tokens": 8, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            client.chat.completions.create(messages=chat("Hi"), **kwargs)
        else:
            client.completions.create(prompt="Hi", **kwargs)
    error = info.value.body
    assert info.value.status_code == 400 and error["type"] == "BadRequestError"
    assert error["param"] == param, error
    assert words in error["message"], error


def test_the_server_serves_after_bad_constraints(client, model):
    for extra in ({"guided_regex": "[a-"}, {"guided_grammar": "root ::= ( "}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model, prompt="Hi", max_tokens=4, extra_body=extra)
    out = client.completions.create(model=model, prompt="Call me at", max_tokens=16, temperature=0,
                                    extra_body={"guided_regex": PHONE})
    assert re.fullmatch(PHONE, out.choices[0].text) and out.choices[0].finish_reason == "stop"
    plain = client.completions.create(model=model, prompt=PLAIN_PROMPT, max_tokens=4, temperature=0)
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 4


def test_response_format_closes_objects_its_schema_leaves_open(client, model):
    """A pydantic model's schema, as clients (instructor's JSON_SCHEMA mode) send it: no additionalProperties.
    The output gets exactly its properties, as with OpenAI's structured outputs and vLLM's default backend;
    left open, SmolLM2 kept adding properties until max_tokens cut it off. structured_outputs.json still
    follows the schema's own default (open)."""
    schema = {"type": "object", "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}}
    reply = client.chat.completions.create(
        model=model, messages=chat("Describe a person as JSON."), temperature=0, max_tokens=MAX_TOKENS,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert reply.choices[0].finish_reason == "stop"
    assert set(json.loads(reply.choices[0].message.content)) == {"name", "age"}


def test_only_response_format_closes_open_objects():
    from tideserve.serve.openai.protocol import ChatCompletionRequest
    from tideserve.serve.openai.serving import structured_outputs_from

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    messages = chat("x")
    by_format, _ = structured_outputs_from(ChatCompletionRequest(messages=messages, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}))
    by_vllm, _ = structured_outputs_from(ChatCompletionRequest(messages=messages, structured_outputs={"json": schema}))
    by_guided, _ = structured_outputs_from(ChatCompletionRequest(messages=messages, guided_json=schema))
    assert by_format.disable_additional_properties
    assert not by_vllm.disable_additional_properties and not by_guided.disable_additional_properties
