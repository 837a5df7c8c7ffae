"""Speculative decoding through a running ``tideserve serve --speculative-config`` (the embedded model), as an
openai SDK user meets it: a chat that edits a file comes back, plain and streamed, with the text the engine
gives without proposals; a completion with a stop string and logprobs too; and /metrics carries vLLM's
spec_decode counters with accepted proposals."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from serve_process import log_tail, serving_openai

from tideserve import SamplingParams

pytestmark = pytest.mark.slow  # a server end to end for seconds: `make test` runs it, `-m 'not slow'` does not

openai = pytest.importorskip("openai")

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
EDIT = ("Change the default port from 8080 to 9090 and print the whole file.\n\n```\nimport argparse\n\n\n"
        "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(description=\"A small server.\")\n"
        "    parser.add_argument(\"--host\", default=\"127.0.0.1\", help=\"address to bind\")\n"
        "    parser.add_argument(\"--port\", type=int, default=8080, help=\"port to listen on\")\n"
        "    parser.add_argument(\"--root\", default=\".\", help=\"directory to serve\")\n"
        "    return parser.parse_args(argv)\n```")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serving_openai(["--max-model-len", "1024", "--speculative-config", json.dumps(SPEC)],
                        tmp_path_factory.mktemp("serve")) as running:
        yield running


def test_answers_equal_the_engines_without_proposals_and_metrics_count_them(served, make_llm):
    client, url, log = served
    model = client.models.list().data[0].id
    plain = make_llm(max_model_len=1024)
    messages = [{"role": "user", "content": EDIT}]
    want = plain.chat(messages, SamplingParams(temperature=0.0, max_tokens=150))[0].outputs[0].text
    kwargs = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 150}
    got = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kwargs)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert got == streamed == want, log_tail(log)

    prompt = EDIT + "\n\nThe file after the change:\n```\n"
    want = plain.generate(prompt, SamplingParams(temperature=0.0, max_tokens=120, stop=["--root"], logprobs=1))
    want = want[0].outputs[0]
    got = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=120, stop=["--root"],
                                    logprobs=1).choices[0]
    assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
    assert len(got.logprobs.tokens) == len(want.token_ids)

    text = httpx.get(url + "/metrics").text
    counts = {name: float(re.search(rf"^vllm:{name}_total{{[^}}]*}} (\S+)$", text, re.M).group(1))
              for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")}
    assert 0 < counts["spec_decode_num_accepted_tokens"] <= counts["spec_decode_num_draft_tokens"]
    assert counts["spec_decode_num_drafts"] > 0
    assert re.search(r'^vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="[^"]*",position="0"} ',
                     text, re.M)
    log.flush()
    assert "Speculative decoding: ngram, 4 proposed tokens per step" in open(log.name).read()
