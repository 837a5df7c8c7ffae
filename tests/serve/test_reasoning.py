"""Reasoning output served with the embedded SmolLM2, driven by the openai SDK.

SmolLM2 has never seen a ``<think>`` section, but it copies patterns well: each test's request-level
chat template shows it a few earlier assistant turns that think first (``<think>`` ... ``</think>``) and
then answer in JSON, and greedy decoding repeats the pattern for the new question. So the split, the
stream, and the grammar's place (after the thinking only) are all checked on real generations.
"""

from __future__ import annotations

import json

import pytest

from tideserve.serve.openai.reasoning import ReasoningDeltaStream, split_reasoning
from tideserve.serve.openai.reasoning_parsers import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from tideserve.serve.openai.tool_calls import ToolDeltaStream, ToolPlan, message_with_calls
from tideserve.serve.openai.tool_parsers import HermesToolParser

pytestmark = pytest.mark.slow  # the model end to end for seconds: `make test` runs it, `-m 'not slow'` does not

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

TIMEOUT = 120
THOUGHT = "The user wants a JSON answer."
ANSWER = '{"answer": "yes"}'
# deepseek_r1 style: the generation prompt opens <think>, the model writes thinking, </think>, answer.
R1_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
               "{% if m.role == 'assistant' %}<think>\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
R1_SHOT = f"{THOUGHT}\n</think>\n{ANSWER}"
# qwen3 style: the model opens <think> itself, unless enable_thinking is false (then the earlier turns show
# no thinking either, so the model answers at once).
QWEN3_TEMPLATE = ("{% set thinking = enable_thinking is not defined or enable_thinking %}"
                  "{% for m in messages %}<|im_start|>{{ m.role }}\n"
                  "{% if m.role == 'assistant' and thinking %}<think>\n" + THOUGHT + "\n</think>\n{% endif %}"
                  "{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# A field the examples never show: only the grammar can make the model write it.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "sure"],
          "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}}}


def conversation(shot: str) -> list[dict]:
    messages = []
    for question in ("Is the sky blue?", "Is water wet?", "Is fire hot?"):
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": shot}]
    return messages + [{"role": "user", "content": "Is snow cold?"}]


@pytest.fixture(scope="module")
def servers(shared_engine, server_thread):
    from tideserve.serve.config import ServerConfig
    from tideserve.serve.openai.server import build_app

    with (server_thread(build_app(ServerConfig(reasoning_parser="deepseek_r1"), engine=shared_engine)) as r1,
          server_thread(build_app(ServerConfig(reasoning_parser="qwen3"), engine=shared_engine)) as qwen3):
        yield {"deepseek_r1": r1, "qwen3": qwen3}


@pytest.fixture(scope="module")
def clients(servers):
    made = {name: openai.OpenAI(base_url=s.url + "/v1", api_key="EMPTY", max_retries=0, timeout=TIMEOUT)
            for name, s in servers.items()}
    yield made
    for c in made.values():
        c.close()


def ask(client, template: str, shot: str, stream: bool = False, **extra):
    body = {"chat_template": template, **extra.pop("body", {})}
    kwargs = {"model": client.models.list().data[0].id, "messages": conversation(shot), "max_tokens": 40,
              "temperature": 0, "extra_body": body, **extra}
    if not stream:
        return client.chat.completions.create(**kwargs)
    reasoning, content, also = "", "", ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            also += getattr(delta, "reasoning", None) or ""
            content += delta.content or ""
    assert also == reasoning  # vLLM's newer field name carries the same text
    return reasoning, content


def test_deepseek_r1_splits_thinking_from_the_answer_streamed_or_not(clients):
    client = clients["deepseek_r1"]
    message = ask(client, R1_TEMPLATE, R1_SHOT).choices[0].message
    assert message.reasoning_content == THOUGHT + "\n"  # no <think> in the output: the prompt opened it
    assert message.model_extra["reasoning"] == message.reasoning_content
    assert "</think>" not in message.content and json.loads(message.content)["answer"] in ("yes", "no")
    assert ask(client, R1_TEMPLATE, R1_SHOT, stream=True) == (message.reasoning_content, message.content)


def test_deepseek_r1_cut_off_while_thinking_is_all_reasoning(clients):
    message = ask(clients["deepseek_r1"], R1_TEMPLATE, R1_SHOT, max_tokens=4).choices[0].message
    assert message.reasoning_content and message.content is None


def test_include_reasoning_false_leaves_it_out(clients):
    message = ask(clients["deepseek_r1"], R1_TEMPLATE, R1_SHOT, body={"include_reasoning": False}).choices[0].message
    assert "reasoning_content" not in message.model_extra and "reasoning" not in message.model_extra
    assert THOUGHT not in message.content and json.loads(message.content)


def test_structured_output_constrains_the_answer_not_the_thinking(clients):
    client = clients["deepseek_r1"]
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
    choice = ask(client, R1_TEMPLATE, R1_SHOT, response_format=fmt).choices[0]
    assert choice.finish_reason == "stop"
    # The thinking is free text (a grammar from the first token would have allowed only JSON) ...
    assert choice.message.reasoning_content == THOUGHT + "\n"
    # ... and the answer follows the schema, with the field the examples never showed.
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    streamed = ask(client, R1_TEMPLATE, R1_SHOT, stream=True, response_format=fmt)
    assert streamed == (choice.message.reasoning_content, choice.message.content)


def test_qwen3_thinking_opens_the_output_and_enable_thinking_reaches_the_template(clients):
    client = clients["qwen3"]
    thinking = ask(client, QWEN3_TEMPLATE, ANSWER).choices[0].message
    assert thinking.reasoning_content == f"\n{THOUGHT}\n"
    assert json.loads(thinking.content)
    assert ask(client, QWEN3_TEMPLATE, ANSWER, stream=True) == (thinking.reasoning_content, thinking.content)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    plain = ask(client, QWEN3_TEMPLATE, ANSWER, body=off).choices[0].message
    assert plain.reasoning_content is None and json.loads(plain.content)


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_qwen3_structured_output_with_and_without_thinking(clients, enable_thinking):
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
    body = {"chat_template_kwargs": {"enable_thinking": enable_thinking}}
    message = ask(clients["qwen3"], QWEN3_TEMPLATE, ANSWER, response_format=fmt, body=body).choices[0].message
    assert message.reasoning_content == (f"\n{THOUGHT}\n" if enable_thinking else None)
    jsonschema.validate(json.loads(message.content), SCHEMA)


# ---------------------------------------------------------------- tool calls read the content only
CALL = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
TEXT = f'<think>maybe <tool_call>{{"name": "g", "arguments": {{}}}}</tool_call> no</think>{CALL}'


def test_tool_calls_are_parsed_from_the_content_only():
    plan = ToolPlan([], "auto", HermesToolParser(), None, True, False)
    reasoning, content = split_reasoning(Qwen3ReasoningParser(), TEXT)
    message, finish = message_with_calls(plan, content, "stop")
    assert finish == "tool_calls" and [c["function"]["name"] for c in message["tool_calls"]] == ["f"]
    assert "tool_call" in reasoning
    stream = ReasoningDeltaStream(DeepSeekR1ReasoningParser(), ToolDeltaStream(plan), include=True)
    deltas = [stream.delta(TEXT[:n], finished=n == len(TEXT)) for n in range(1, len(TEXT) + 1)]
    names = [c["function"]["name"] for d in deltas for c in d.get("tool_calls", []) if "name" in c["function"]]
    assert names == ["f"] and "".join(d.get("reasoning_content", "") for d in deltas) == reasoning


# ---------------------------------------------------------------- the Responses API: a reasoning item
def test_responses_api_returns_the_thinking_as_a_reasoning_item(shared_engine, server_thread):
    from tideserve.serve.config import ServerConfig
    from tideserve.serve.openai.server import build_app

    config = ServerConfig(reasoning_parser="deepseek_r1", chat_template=R1_TEMPLATE)  # Responses has no template field
    with server_thread(build_app(config, engine=shared_engine)) as s, \
            openai.OpenAI(base_url=s.url + "/v1", api_key="EMPTY", max_retries=0, timeout=TIMEOUT) as client:
        kwargs = {"model": s.state.model_name, "input": conversation(R1_SHOT), "max_output_tokens": 40,
                  "temperature": 0}
        reply = client.responses.create(**kwargs)
        kinds = [item.type for item in reply.output]
        assert kinds == ["reasoning", "message"]
        assert reply.output[0].content[0].text == THOUGHT + "\n"
        assert json.loads(reply.output_text) and THOUGHT not in reply.output_text
        events = list(client.responses.create(stream=True, **kwargs))
        deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert deltas == THOUGHT + "\n"
        final = events[-1].response
        assert [item.type for item in final.output] == kinds and final.output_text == reply.output_text
