"""The request controls honoured over HTTP, through the official openai SDK where it has the field:
logit_bias, allowed_token_ids, bad_words, best_of (and its usage), prompt truncation, request ids, token
ids and prompt logprobs in responses, cache_salt, chat templates (per request and --chat-template, on
chat and /tokenize), continue_final_message and echo, and priority scheduling end to end."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tideserve.serve.config import ServerConfig
from tideserve.serve.openai.server import build_app

pytestmark = pytest.mark.slow  # the model end to end for seconds: `make test` runs it, `-m 'not slow'` does not

openai = pytest.importorskip("openai")

TIMEOUT = 60.0
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def token(shared_engine, text: str) -> int:
    ids = shared_engine.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, ids
    return ids[0]


def test_logit_bias_through_the_sdk(client, model, shared_engine):
    forced = token(shared_engine, " banana")
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0,
                                    logit_bias={str(forced): 100})
    assert out.choices[0].text == " banana" * 3
    base = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0)
    first = shared_engine.tokenizer.encode(base.choices[0].message.content, add_special_tokens=False)[0]
    banned = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0,
                                            logit_bias={str(first): -100})
    assert shared_engine.tokenizer.encode(banned.choices[0].message.content, add_special_tokens=False)[0] != first


def test_allowed_token_ids_and_bad_words(client, model, shared_engine):
    allowed = shared_engine.tokenizer.encode(" yes no maybe", add_special_tokens=False)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0,
                                    extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    assert set(out.choices[0].model_extra["token_ids"]) <= set(allowed)
    base = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    assert "Paris" in base.choices[0].text
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                    extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in out.choices[0].text


def test_best_of_returns_n_and_bills_every_sample(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3,
                                    n=2, best_of=4, logprobs=0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 4 * 6
    scores = [sum(c.logprobs.token_logprobs) for c in out.choices]
    assert scores[0] >= scores[1] - 1e-4
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=1.0,
                                          extra_body={"best_of": 3, "ignore_eos": True})
    assert len(chat.choices) == 1 and chat.usage.completion_tokens == 3 * 4


def test_truncate_prompt_tokens_keeps_the_tail(client, model, shared_engine):
    limit = shared_engine.max_model_len
    long_prompt = "word " * (limit + 50)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=model, prompt=long_prompt, max_tokens=2)
    out = client.completions.create(model=model, prompt=long_prompt, max_tokens=2, echo=True,
                                    extra_body={"truncate_prompt_tokens": 100})
    assert out.usage.prompt_tokens == 100
    ids = shared_engine.tokenizer.encode(long_prompt)
    assert out.choices[0].text.startswith(shared_engine.tokenizer.decode(ids[-100:], skip_special_tokens=False))
    head = client.completions.create(model=model, prompt=long_prompt, max_tokens=1, extra_body={
        "truncate_prompt_tokens": 10, "truncation_side": "right", "return_token_ids": True})
    assert head.choices[0].model_extra["prompt_token_ids"] == ids[:10]
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": long_prompt}],
                                          max_tokens=2, extra_body={"truncate_prompt_tokens": 64})
    assert chat.usage.prompt_tokens == 64


def test_request_id_in_the_body_names_the_request(http, model):
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "request_id": "body-id-7"})
    assert r.status_code == 200 and r.json()["id"] == "cmpl-body-id-7"
    assert r.headers["x-request-id"] == "body-id-7"
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "request_id": "body-id-8"},
                  headers={"X-Request-Id": "header-id"})
    assert r.json()["id"] == "cmpl-header-id"  # the header wins, as in vLLM
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "request_id": "c-1"})
    assert r.json()["id"] == "chatcmpl-c-1"


def test_return_token_ids_and_tokens_as_ids(http, shared_engine):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1, "return_token_ids": True,
            "return_tokens_as_token_ids": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["prompt_token_ids"] == shared_engine.tokenizer.encode(PROMPT)
    assert shared_engine.tokenizer.decode(choice["token_ids"]) == choice["text"]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    streamed, first_prompt_ids = [], None
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                streamed += c.get("token_ids", [])
                first_prompt_ids = first_prompt_ids or c.get("prompt_token_ids")
    assert streamed == choice["token_ids"] and first_prompt_ids == choice["prompt_token_ids"]
    chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3, "temperature": 0,
                                                    "return_token_ids": True, "logprobs": True,
                                                    "return_tokens_as_token_ids": True}).json()
    assert chat["prompt_token_ids"] == shared_engine.tokenizer.encode_chat(MESSAGES)
    assert [e["token"] for e in chat["choices"][0]["logprobs"]["content"]] == \
        [f"token_id:{t}" for t in chat["choices"][0]["token_ids"]]


def test_prompt_logprobs_are_returned_without_echo(http, shared_engine):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    ids = shared_engine.tokenizer.encode(PROMPT)
    assert len(plp) == len(ids) and plp[0] is None
    for token_id, entry in zip(ids[1:], plp[1:]):
        assert str(token_id) in entry and entry[str(token_id)]["logprob"] <= 0
        assert entry[str(token_id)]["decoded_token"] == shared_engine.tokenizer.decode([token_id])
    chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1,
                                                    "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None


def test_cache_salt_isolates_prefix_cache_entries(http, shared_engine):
    prompt = "Salted prefix: " + " ".join(f"item{i}" for i in range(60))
    stats = shared_engine.engine.kv_manager.prefix_stats

    def hits_of(**extra) -> int:
        before = stats.hits
        assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, **extra}).status_code == 200
        return stats.hits - before

    hits_of(cache_salt="tenant-a")
    assert hits_of(cache_salt="tenant-b") == 0  # another tenant cannot hit (or time) tenant a's blocks
    assert hits_of() == 0  # nor can an unsalted request
    assert hits_of(cache_salt="tenant-a") > 0  # the same tenant does


def test_per_request_chat_template_on_chat_and_tokenize(client, http, model):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{{ suffix }}"
    kwargs = {"suffix": "Answer:"}
    tok = http.post("/tokenize", json={"messages": MESSAGES, "chat_template": template,
                                       "chat_template_kwargs": kwargs, "return_token_strs": True}).json()
    default = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert tok["count"] != default["count"] and "".join(tok["token_strs"]).endswith("Answer:")
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                         extra_body={"chat_template": template, "chat_template_kwargs": kwargs})
    assert out.usage.prompt_tokens == tok["count"]
    err = http.post("/tokenize", json={"messages": MESSAGES, "chat_template": "{{ messages[0].content | nope }}"})
    assert err.status_code == 400 and err.json()["error"]["param"] in ("chat_template", "messages")


def test_server_chat_template_override(shared_engine, server_thread, tmp_path):
    path = tmp_path / "plain.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}\n{% endfor %}")
    with server_thread(build_app(ServerConfig(chat_template=str(path)), engine=shared_engine)) as s, \
            httpx.Client(base_url=s.url, timeout=TIMEOUT) as http:
        tok = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
        assert tok["tokens"] == shared_engine.tokenizer.encode(MESSAGES[0]["content"] + "\n",
                                                               add_special_tokens=False)
        chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()
        assert chat["usage"]["prompt_tokens"] == tok["count"]
        own = http.post("/tokenize", json={"messages": MESSAGES, "chat_template": "{{ 'x' }}"}).json()
        assert own["count"] == 1  # the request's template wins over the server's
    with pytest.raises(ValueError, match="looks like a file path"):
        ServerConfig(chat_template=str(tmp_path / "nope.jinja"))
    with pytest.raises(ValueError, match="syntax error"):
        ServerConfig(chat_template="{% for %}")


def test_continue_final_message_and_echo(http):
    prefix = "The capital of France is"
    messages = [{"role": "user", "content": "Complete the sentence."}, {"role": "assistant", "content": prefix}]
    body = {"messages": messages, "max_tokens": 3, "temperature": 0, "add_generation_prompt": False,
            "continue_final_message": True}
    tokens = http.post("/tokenize", json={k: body[k] for k in ("messages", "add_generation_prompt",
                                                               "continue_final_message")}).json()["tokens"]
    r = http.post("/v1/chat/completions", json={**body, "echo": True}).json()
    assert r["usage"]["prompt_tokens"] == len(tokens)
    content = r["choices"][0]["message"]["content"]
    assert content.startswith(prefix) and len(content) > len(prefix)


# ---------------------------------------------------------------------- priority, end to end
@pytest.fixture(scope="module")
def priority_server(make_engine, server_thread):
    engine = make_engine(scheduling_policy="priority", max_num_seqs=1, num_blocks=64)
    with server_thread(build_app(ServerConfig(), engine=engine)) as s:
        yield s, engine


def test_a_high_priority_request_overtakes_a_queue_of_low_priority_ones(priority_server, wait_until):
    server, engine = priority_server
    finished: list[str] = []
    unfinished_at_submit: list[str] = []

    async def run() -> None:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0,
                                      timeout=TIMEOUT) as c:
            async def one(name: str, priority: int, max_tokens: int) -> None:
                await c.completions.create(model=server.state.model_name, prompt=f"Story {name}:",
                                           max_tokens=max_tokens, temperature=0,
                                           extra_body={"priority": priority, "ignore_eos": True})
                finished.append(name)

            low = [asyncio.ensure_future(one(f"low{i}", 5, 16)) for i in range(4)]
            # One low-priority request runs (max_num_seqs=1), the others wait behind it.
            await asyncio.to_thread(wait_until, lambda: engine.queue_depth() >= 2, 30, "queued requests")
            unfinished_at_submit.extend(f"low{i}" for i in range(4) if f"low{i}" not in finished)
            await one("high", 0, 4)
            await asyncio.gather(*low)

    asyncio.run(asyncio.wait_for(run(), 180))
    assert len(unfinished_at_submit) >= 3, unfinished_at_submit  # two or more waiting, one running
    # The high-priority request finished before every low-priority one that was still queued or running
    # when it arrived: it jumped the queue and took the running one's seat.
    after_high = finished[finished.index("high") + 1:]
    assert set(unfinished_at_submit) <= set(after_high), finished
    assert engine.stats().num_preemptions >= 1


def test_priority_is_refused_under_fcfs_and_accepted_as_zero(http):
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "priority": -1})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "Got priority -1 but Priority scheduling is not enabled.", "type": "BadRequestError",
        "param": "priority", "code": 400}
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "priority": 0}).status_code == 200
