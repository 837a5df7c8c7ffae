"""The draft-model method through a running ``tideserve serve --speculative-config '{"model": ...}'`` (the
embedded model as its own draft), as an openai SDK user meets it: a chat comes back, plain and streamed, with
the text the engine gives without proposals, /metrics counts accepted proposals and the start-up log names
the draft; a server given a draft that cannot share the target's pool refuses to start, saying why."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest
from serve_process import free_port, log_tail, serving_openai

from tideserve import SamplingParams
from tideserve.model.loader import default_model_path

pytestmark = pytest.mark.slow  # a server end to end for seconds: `make test` runs it, `-m 'not slow'` does not

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    spec = {"model": default_model_path(), "num_speculative_tokens": 4}
    with serving_openai(["--max-model-len", "1024", "--speculative-config", json.dumps(spec)],
                        tmp_path_factory.mktemp("serve")) as running:
        yield running


def test_answers_equal_the_engines_without_proposals_and_metrics_count_them(served, make_llm):
    client, url, log = served
    model = client.models.list().data[0].id
    plain = make_llm(max_model_len=1024)
    messages = [{"role": "user", "content": "Why is the sky blue? Answer in two sentences."}]
    want = plain.chat(messages, SamplingParams(temperature=0.0, max_tokens=80))[0].outputs[0].text
    kwargs = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 80}
    got = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kwargs)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert got == streamed == want, log_tail(log)

    text = httpx.get(url + "/metrics").text
    counts = {name: float(re.search(rf"^vllm:{name}_total{{[^}}]*}} (\S+)$", text, re.M).group(1))
              for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")}
    assert counts["spec_decode_num_drafts"] > 0
    assert 0.8 * counts["spec_decode_num_draft_tokens"] < counts["spec_decode_num_accepted_tokens"]
    log.flush()
    assert "Speculative decoding: draft_model, 4 proposed tokens per step (greedy tokens of the draft model" in \
        open(log.name).read()


def test_a_draft_with_another_vocabulary_stops_the_server_at_start(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=96, intermediate_size=64, num_hidden_layers=1, num_attention_heads=3,
                         num_key_value_heads=3, head_dim=64, vocab_size=300, max_position_embeddings=2048)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "draft")
    spec = json.dumps({"model": str(tmp_path / "draft"), "num_speculative_tokens": 4})
    done = subprocess.run([sys.executable, "-m", "tideserve.cli", "serve", "--port", str(free_port()),
                           "--max-model-len", "1024", "--speculative-config", spec],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    assert re.search(r"the vocabularies differ \(target 49152 tokens, draft 300\)", done.stdout + done.stderr), \
        (done.stdout + done.stderr)[-3000:]
