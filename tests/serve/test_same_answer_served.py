"""The same request gives the same answer through a running ``tideserve serve`` (the embedded model, its
defaults): a chat at temperature 0 sent twice in a row, plain and streamed, comes back with the same text,
although the second request of each pair finds its prompt in the prefix cache and prefills only its tail, and
a streaming client gets what a plain one gets."""

from __future__ import annotations

import os

import pytest
from serve_process import log_tail, start_serve

pytestmark = pytest.mark.slow  # the model end to end for seconds: `make test` runs it, `-m 'not slow'` does not

openai = pytest.importorskip("openai")

CHATS = ["What is the most common color in the world?", "Why is the sky blue?",
         "Give me three tips for learning Python."]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    log = (tmp_path_factory.mktemp("serve") / "serve.log").open("w+")
    proc, url = start_serve(["--max-model-len", "512"], log, dict(os.environ), load_timeout=180)
    try:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120, max_retries=0), log
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def ask(client, model: str, content: str, stream: bool) -> str:
    kwargs = {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0,
              "max_tokens": 48}
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_chat_sent_twice_plain_and_streamed_gets_one_answer(client):
    client, log = client
    model = client.models.list().data[0].id
    for content in CHATS:
        answers = [ask(client, model, content, stream) for stream in (False, False, True, True)]
        assert len(set(answers)) == 1, f"{model}: {content!r} got {answers}\n{log_tail(log)}"
        assert answers[0]
