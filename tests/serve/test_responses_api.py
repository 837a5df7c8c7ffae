"""/v1/responses through the openai SDK's ``client.responses``: the reply is the chat endpoint's for the same
messages and settings (text, tool calls, JSON output), streamed as the Responses events the SDK parses,
and every request it cannot serve gets a 400 naming the field. One server for the whole module."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.slow  # the model end to end for seconds: `make test` runs it, `-m 'not slow'` does not

openai = pytest.importorskip("openai")

QUESTION = "Name three colors."
WEATHER = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CHAT_WEATHER = [{"type": "function", "function": {k: v for k, v in WEATHER[0].items() if k != "type"}}]


def chat_text(client, model, messages, **kwargs) -> tuple[str, str, object]:
    reply = client.chat.completions.create(model=model, messages=messages, temperature=0, **kwargs)
    return reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage


def test_text_input_is_a_user_message(client, model):
    r = client.responses.create(model=model, input=QUESTION, max_output_tokens=12, temperature=0)
    text, finish, usage = chat_text(client, model, [{"role": "user", "content": QUESTION}], max_completion_tokens=12)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model
    assert r.output_text == text and len(r.output) == 1 and r.output[0].type == "message"
    assert r.status == ("incomplete" if finish == "length" else "completed")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert r.usage.total_tokens == usage.total_tokens


def test_instructions_and_message_items_are_the_chat_messages(client, model):
    r = client.responses.create(
        model=model, instructions="Answer briefly.", temperature=0, max_output_tokens=16,
        input=[{"role": "developer", "content": "Use English."},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
               {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
               {"role": "user", "content": QUESTION}])
    text, _, _ = chat_text(client, model, [{"role": "system", "content": "Answer briefly."},
                                           {"role": "system", "content": "Use English."},
                                           {"role": "user", "content": "Hi!"},
                                           {"role": "assistant", "content": "Hello."},
                                           {"role": "user", "content": QUESTION}], max_completion_tokens=16)
    assert r.output_text == text


def test_an_empty_tools_list_means_no_tools(client, model):
    """The OpenAI Agents SDK sends ``tools: []`` for an agent without tools; OpenAI takes it as none."""
    plain = client.responses.create(model=model, input=QUESTION, max_output_tokens=8, temperature=0)
    r = client.responses.create(model=model, input=QUESTION, max_output_tokens=8, temperature=0, tools=[])
    assert r.output_text == plain.output_text and r.tools == []


def test_max_output_tokens_makes_the_response_incomplete(client, model):
    r = client.responses.create(model=model, input=QUESTION, max_output_tokens=3, extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


@pytest.mark.parametrize("limit", [12, 3])
def test_stream_events_rebuild_the_response(client, model, limit):
    plain = client.responses.create(model=model, input=QUESTION, max_output_tokens=limit, temperature=0)
    events = list(client.responses.create(model=model, input=QUESTION, max_output_tokens=limit, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    item_id = events[2].item.id
    assert all(d.item_id == item_id and d.output_index == 0 for d in deltas)
    assert "".join(d.delta for d in deltas) == plain.output_text == events[-4].text
    final = events[-1]
    assert kinds[-1] == ("response.completed" if plain.status == "completed" else "response.incomplete")
    assert final.response.output_text == plain.output_text and final.response.status == plain.status
    assert final.response.usage.output_tokens == plain.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_function_call_and_its_output_round_trip(client, model):
    first = client.responses.create(model=model, input="What is the weather in Paris?", tools=WEATHER,
                                    tool_choice="required", temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].status == "completed"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    call = calls[0]
    turns = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    second = client.responses.create(model=model, input=turns, tools=WEATHER, tool_choice="none", temperature=0,
                                     max_output_tokens=24)
    text, _, _ = chat_text(client, model, [
        turns[0],
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}],
        tools=CHAT_WEATHER, tool_choice="none", max_completion_tokens=24)
    assert second.output_text == text and text


def test_streamed_function_call(client, model):
    plain = client.responses.create(model=model, input="Weather in Rome?", tools=WEATHER,
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    events = list(client.responses.create(model=model, input="Weather in Rome?", tools=WEATHER,
                                          tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                          stream=True))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [a.item.type for a in added] == ["function_call"]
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert pieces == done.arguments == plain.output[0].arguments
    assert json.loads(done.arguments)["city"]
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].arguments == done.arguments


def test_json_schema_text_format(client, model):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(model=model, input="Describe a person as JSON.", temperature=0, max_output_tokens=80,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    assert r.status == "completed"
    value = json.loads(r.output_text)
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and isinstance(value["age"], int)
    assert r.text.format.type == "json_schema"


def test_logprobs_are_the_chat_endpoints(client, model):
    """include message.output_text.logprobs with top_logprobs: the output_text part carries chat's entries
    for the same request, one per output token; streamed, the deltas carry them in order."""
    asked = {"input": QUESTION, "max_output_tokens": 8, "temperature": 0, "top_logprobs": 2,
             "include": ["message.output_text.logprobs"]}
    r = client.responses.create(model=model, **asked)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                          max_completion_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    entries = r.output[0].content[0].logprobs
    assert len(entries) == r.usage.output_tokens
    assert [(e.token, len(e.top_logprobs)) for e in entries] == [(e.token, 2) for e in chat.choices[0].logprobs.content]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in chat.choices[0].logprobs.content],
                                                         abs=1e-3)
    assert "".join(e.token for e in entries) == r.output_text
    events = list(client.responses.create(model=model, stream=True, **asked))
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert streamed == [lp.token for lp in done.logprobs] == [e.token for e in entries]
    assert client.responses.create(model=model, input=QUESTION, max_output_tokens=4).output[0].content[0].logprobs == []


@pytest.mark.parametrize(("extra", "param", "contains"), [
    ({"include": ["reasoning.encrypted_content"]}, "include", "'reasoning.encrypted_content' is not supported"),
    ({"top_logprobs": 50}, "top_logprobs", "greater than max allowed"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
    ({"temperature": -1}, "temperature", "temperature must be"),
    ({"max_output_tokens": 10**7}, "max_output_tokens", "maximum context length"),
    ({"input": "word " * 20000}, "input", "Please reduce the length of the input"),
    ({"input": []}, "input", "non-empty"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "'reasoning' is not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input",
     "only text content"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "role must be one of"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input", "call_id is required"),
    ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"tools": WEATHER}, "tool_choice", "--enable-auto-tool-choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "schema is required"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "not supported"),
    ({"model": "gpt-5"}, "model", "does not exist"),
])
def test_bad_requests_name_the_field(client, model, extra, param, contains):
    body = {"model": model, "input": "hi", "max_output_tokens": 4, **extra}
    with pytest.raises(openai.APIStatusError) as info:
        client.responses.create(**body)
    error = info.value.body
    assert info.value.status_code in (400, 404) and error["param"] == param and contains in error["message"], error


def test_nothing_is_stored(client, server):
    with pytest.raises(openai.NotFoundError, match="stores no responses"):
        client.responses.retrieve("resp_123")
    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2, "store": True},
                   timeout=60)
    assert r.status_code == 200 and r.json()["store"] is False


def finished(http: httpx.Client, reason: str) -> float:
    """vllm:request_success_total for one finish reason, from /metrics."""
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total{") and f'finished_reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_client_leaving_mid_stream_aborts_its_request(server, shared_engine, wait_until):
    """A Responses stream read for a few events and dropped is aborted (not run to its token limit), and its
    blocks are freed, as a dropped chat stream is."""
    body = {"input": QUESTION, "max_output_tokens": 400, "stream": True, "ignore_eos": True}
    kv = shared_engine.engine.kv_manager
    with httpx.Client(base_url=server.url, timeout=60) as http:
        aborted, cut = finished(http, "abort"), finished(http, "length")
        for events_read in (1, 6):
            with http.stream("POST", "/v1/responses", json=body) as r:
                assert r.status_code == 200
                seen = 0
                for line in r.iter_lines():
                    seen += line.startswith("data: ")
                    if seen >= events_read:
                        break
        wait_until(lambda: shared_engine.num_active() == 0 and kv.num_free_blocks == kv.num_blocks, 60,
                   "the dropped streams' requests to end and their blocks to be freed")
        wait_until(lambda: finished(http, "abort") == aborted + 2, 10, "two aborts in /metrics")
        assert finished(http, "length") == cut  # neither ran to max_output_tokens
