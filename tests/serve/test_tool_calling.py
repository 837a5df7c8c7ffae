"""Tool calling over HTTP, through the official ``openai`` SDK (its stream accumulator included).

- ``tool_choice`` "required" and a named function are forced by a grammar: they always come back as
  ``tool_calls`` (ids, ``type: "function"``, arguments that validate against the tool's parameters, with
  no undeclared properties), ``finish_reason: "tool_calls"``, greedy and sampled, n > 1, streamed as
  OpenAI-shaped deltas.
- "auto" is vLLM's: without ``--enable-auto-tool-choice --tool-call-parser`` a 400 with vLLM's wording
  (also when tools come without a tool_choice, which then means "auto"); with them, the model's own call
  format is parsed. The embedded SmolLM2 has no tool format of its own, so those tests pin the output to
  each parser's format (hermes, llama3_json, mistral) with a regex and check what the parser makes of it.
- "none", a multi-turn conversation with the SDK's own assistant message and a ``tool`` message, and
  malformed tools (400s naming the field).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tideserve.serve.config import ServerConfig
from tideserve.serve.openai.server import build_app
from tideserve.serve.openai.tool_calls import AUTO_NEEDS_FLAGS

pytestmark = pytest.mark.slow  # the model end to end for seconds: `make test` runs it, `-m 'not slow'` does not

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

TIMEOUT = 120.0
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 16},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
FLIGHT = {"type": "function", "function": {
    "name": "book_flight", "description": "Book a flight.",
    "parameters": {"type": "object", "required": ["origin", "destination", "passengers"],
                   "properties": {"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                  "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                  "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                                  "cabin": {"enum": ["economy", "business"]}}}}}
CITIES = {"type": "function", "function": {"name": "list_cities", "description": "All known cities."}}
TOOLS = [WEATHER, FLIGHT, CITIES]
PARAMETERS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {}})
              for t in TOOLS}
ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]
# A regex per parser that writes one get_weather call in that parser's format.
_ARGS = r'\{"city": "[A-Z][a-z]{2,8}", "unit": "(celsius|fahrenheit)"\}'
PARSER_FORMATS = {
    "hermes": r'<tool_call>\{"name": "get_weather", "arguments": ' + _ARGS + r"\}</tool_call>",
    "llama3_json": r'\{"name": "get_weather", "parameters": ' + _ARGS + r"\}",
    "mistral": r'\[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": ' + _ARGS + r"\}\]",
}


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def sync_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0, timeout=TIMEOUT)


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def client(server):
    with sync_client(server) as c:
        yield c


def assert_valid_calls(message, allowed: set[str], max_calls: int | None = None) -> list[tuple[str, dict]]:
    """The message's tool_calls are well formed and their arguments validate (closed objects: nothing the
    tool does not declare); returns (name, arguments) pairs."""
    assert message.tool_calls, message
    assert not message.content, message
    if max_calls is not None:
        assert len(message.tool_calls) <= max_calls
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10, call
        assert call.function.name in allowed, call
        arguments = json.loads(call.function.arguments)
        schema = PARAMETERS[call.function.name]
        jsonschema.validate(arguments, schema)
        assert set(arguments) <= set(schema.get("properties", {})), arguments
        calls.append((call.function.name, arguments))
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)
    return calls


# ---------------------------------------------------------------- forced calls: one concurrent batch
FORCED = {
    "required": {"tool_choice": "required", "temperature": 0},
    "required-sampled-n3": {"tool_choice": "required", "temperature": 1.0, "seed": 4, "n": 3},
    "required-single": {"tool_choice": "required", "temperature": 1.0, "seed": 9, "n": 2,
                        "parallel_tool_calls": False},
    "named-weather": {"tool_choice": named("get_weather"), "temperature": 0},
    "named-flight-sampled": {"tool_choice": named("book_flight"), "temperature": 0.8, "seed": 2, "n": 2},
    "named-no-parameters": {"tool_choice": named("list_cities"), "temperature": 0},
}
ALLOWED = {"required": set(PARAMETERS), "required-sampled-n3": set(PARAMETERS),
           "required-single": set(PARAMETERS), "named-weather": {"get_weather"},
           "named-flight-sampled": {"book_flight"}, "named-no-parameters": {"list_cities"}}


async def _forced(c: openai.AsyncOpenAI, model: str, kwargs: dict, mode: str) -> Any:
    args = {"model": model, "messages": ASK, "tools": TOOLS, "max_tokens": 120, **kwargs}
    if mode == "plain":
        return await c.chat.completions.create(**args)
    if mode == "accumulated":  # the SDK's stream helper reassembles the deltas
        async with c.chat.completions.stream(**args) as stream:
            async for _ in stream:
                pass
            return await stream.get_final_completion()
    return [chunk async for chunk in await c.chat.completions.create(stream=True, **args)]  # raw chunks


@pytest.fixture(scope="module")
def forced(server, model):
    """Every FORCED request non-streamed, streamed through the SDK's accumulator, and as raw chunks."""
    modes = ("plain", "accumulated", "chunks")

    async def go():
        async with async_client(server) as c:
            jobs = [_forced(c, model, kwargs, mode) for kwargs in FORCED.values() for mode in modes]
            results = await asyncio.gather(*jobs)
        return {(name, mode): results[i * len(modes) + j]
                for i, name in enumerate(FORCED) for j, mode in enumerate(modes)}

    return asyncio.run(asyncio.wait_for(go(), 2 * TIMEOUT))


@pytest.mark.parametrize("name", list(FORCED))
def test_forced_calls_come_back_as_valid_tool_calls(forced, name):
    n = FORCED[name].get("n", 1)
    single = FORCED[name].get("parallel_tool_calls") is False or name.startswith("named")
    for mode in ("plain", "accumulated"):
        resp = forced[(name, mode)]
        assert len(resp.choices) == n
        for choice in resp.choices:
            assert choice.finish_reason == "tool_calls", (mode, choice)
            calls = assert_valid_calls(choice.message, ALLOWED[name], 1 if single else None)
            if name == "named-no-parameters":
                assert calls == [("list_cities", {})]
    # a stream carries the same calls as the non-streamed response (ids are fresh per response)
    plain, streamed = forced[(name, "plain")], forced[(name, "accumulated")]
    for p, s in zip(sorted(plain.choices, key=lambda c: c.index), sorted(streamed.choices, key=lambda c: c.index)):
        assert [(c.function.name, c.function.arguments) for c in p.message.tool_calls] == \
               [(c.function.name, c.function.arguments) for c in s.message.tool_calls]


@pytest.mark.parametrize("name", ["required-sampled-n3", "named-weather"])
def test_streamed_tool_call_deltas_have_openais_shape(forced, name):
    """Per call: a first delta with index, id, type and name (arguments ""), then argument fragments
    only; the choice's last chunk says finish_reason "tool_calls"; no content deltas."""
    per_choice: dict[int, list] = {}
    finish: dict[int, str] = {}
    for chunk in forced[(name, "chunks")]:
        for choice in chunk.choices:
            assert not choice.delta.content, choice.delta
            per_choice.setdefault(choice.index, []).extend(choice.delta.tool_calls or [])
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert set(finish.values()) == {"tool_calls"} and len(finish) == FORCED[name].get("n", 1)
    for deltas in per_choice.values():
        seen: dict[int, str] = {}
        for d in deltas:
            if d.index not in seen:
                assert d.id and d.type == "function" and d.function.name and d.function.arguments == "", d
                seen[d.index] = ""
            else:
                assert d.id is None and d.function.name is None and d.function.arguments, d
                seen[d.index] += d.function.arguments
        assert seen and all(json.loads(args) is not None for args in seen.values())


# ---------------------------------------------------------------- none and auto
def test_tool_choice_none_answers_in_text(client, model, hermes_server):
    for c in (client, sync_client(hermes_server)):
        resp = c.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none",
                                         max_tokens=12, temperature=0)
        choice = resp.choices[0]
        assert choice.message.content and choice.message.tool_calls is None
        assert choice.finish_reason in ("stop", "length")


def test_auto_without_the_flags_is_vllms_400(client, model):
    for extra in ({"tool_choice": "auto"}, {}):  # tools without tool_choice mean "auto", as in vLLM
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=4, **extra)
        assert info.value.body["message"] == AUTO_NEEDS_FLAGS
        assert info.value.body["param"] == "tool_choice"


def test_auto_with_the_flags_lets_the_model_answer_in_text(hermes_server, model):
    with sync_client(hermes_server) as c:
        resp = c.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=16, temperature=0)
    choice = resp.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize("parser", list(PARSER_FORMATS))
def test_auto_parses_each_parsers_format(parser, shared_engine, server_thread, hermes_server, model):
    """The output pinned to the parser's format (structured_outputs regex) comes back as a tool call,
    streamed and not, with the content empty and finish_reason "tool_calls"."""
    kwargs = {"model": model, "messages": ASK, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 80,
              "temperature": 0, "extra_body": {"structured_outputs": {"regex": PARSER_FORMATS[parser]}}}

    def check(c: openai.OpenAI) -> None:
        resp = c.chat.completions.create(**kwargs)
        with c.chat.completions.stream(**kwargs) as stream:
            for _ in stream:
                pass
            streamed = stream.get_final_completion()
        for r in (resp, streamed):
            assert r.choices[0].finish_reason == "tool_calls"
            assert [name for name, _ in assert_valid_calls(r.choices[0].message, {"get_weather"})] == ["get_weather"]
        assert resp.choices[0].message.tool_calls[0].function.arguments == \
               streamed.choices[0].message.tool_calls[0].function.arguments

    if parser == "hermes":
        with sync_client(hermes_server) as c:
            check(c)
        return
    config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser=parser)
    with server_thread(build_app(config, engine=shared_engine)) as s, sync_client(s) as c:
        check(c)


# ---------------------------------------------------------------- a conversation with tool results
def test_multi_turn_with_tool_messages_round_trips(client, model, server):
    first = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER],
                                           tool_choice=named("get_weather"), max_tokens=60, temperature=0)
    call_message = first.choices[0].message
    call = call_message.tool_calls[0]
    result = json.dumps({"temperature": 21, "sky": "sunny"})
    messages = [*ASK, call_message,  # the SDK's own message object, as agent loops send it back
                {"role": "tool", "tool_call_id": call.id, "content": result}]
    second = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice="none",
                                            max_tokens=24, temperature=0)
    assert second.choices[0].message.content and second.choices[0].message.tool_calls is None
    # The model saw the call and the tool's answer: both are in the rendered prompt.
    wire = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]
    r = httpx.post(server.url + "/tokenize", json={"messages": wire, "tools": [WEATHER]}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    prompt = httpx.post(server.url + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=TIMEOUT).json()
    assert result in prompt["prompt"] and "get_weather" in prompt["prompt"]
    assert json.loads(call.function.arguments)["city"] in prompt["prompt"]
    assert second.usage.prompt_tokens == r.json()["count"]
    # A third turn after the answer (required again) still gives valid calls.
    third = client.chat.completions.create(
        model=model, messages=[*messages, second.choices[0].message, {"role": "user", "content": "And Rome?"}],
        tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0)
    assert third.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(third.choices[0].message, {"get_weather"})


# ---------------------------------------------------------------- malformed tools
BAD_TOOLS = [
    ({"tools": {"type": "function", "function": {"name": "f"}}}, "tools", "valid list"),
    ({"tools": "get_weather"}, "tools", "valid list"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}], "tool_choice": "required"},
     "tools.0.function.name", "required"),
    ({"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "required"}, "tools",
     "non-empty string"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}], "tool_choice": "required"}, "tools.0.type",
     "function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tool_choice": "required"},
     "tools.0.function.parameters", "dictionary"),
    ({"tools": [], "tool_choice": "required"}, "tools", "empty array"),
    ({"tools": [WEATHER], "tool_choice": named("get_time")}, "tool_choice", "does not match"),
    ({"tool_choice": named("get_weather")}, "tool_choice", "`tools` must be set"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "'none', 'auto' or 'required'"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "not both"),
]


@pytest.mark.parametrize(("body", "param", "words"), BAD_TOOLS, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD_TOOLS)])
def test_malformed_tools_are_400s_naming_the_field(server, body, param, words):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body},
                   timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == param, error
    assert words in error["message"], error


def test_the_server_serves_after_bad_tools(client, model):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice=named("nope"))
    resp = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                          max_tokens=60, temperature=0)
    assert resp.choices[0].finish_reason == "tool_calls"
