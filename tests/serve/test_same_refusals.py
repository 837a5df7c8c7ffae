"""The offline ``LLM`` and the server check a request in one place (the engine's input processor), so
they refuse the same bad request with the same message: context length, output length, samples and
logprobs caps, token ids out of the vocabulary, priority and salt."""

from __future__ import annotations

import pytest

from tideserve import LLM, SamplingParams
from tideserve.serve.config import ServerConfig
from tideserve.serve.openai.server import build_app

MAX_MODEL_LEN = 512  # the shared engine's (tests/serve/conftest.py)

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
SETTINGS = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "num_blocks": 256, "max_num_seqs": 32}

# (the completion request's extra fields, the offline call's SamplingParams and keywords)
CASES = [
    pytest.param({"prompt": list(range(1, MAX_MODEL_LEN + 4))}, {}, {}, id="prompt-beyond-context"),
    pytest.param({"max_tokens": MAX_MODEL_LEN}, {"max_tokens": MAX_MODEL_LEN}, {}, id="output-beyond-context"),
    pytest.param({"n": 500}, {"n": 500}, {}, id="too-many-samples"),
    pytest.param({"best_of": 500}, {"best_of": 500}, {}, id="best-of-too-many"),
    pytest.param({"logprobs": 21}, {"logprobs": 21}, {}, id="logprobs-over-cap"),
    pytest.param({"prompt_logprobs": 30}, {"prompt_logprobs": 30}, {}, id="prompt-logprobs-over-cap"),
    pytest.param({"prompt": [5, 10**8]}, {}, {"prompt": [5, 10**8]}, id="prompt-token-out-of-vocabulary"),
    pytest.param({"logit_bias": {"10000000": 1}}, {"logit_bias": {10**7: 1}}, {}, id="logit-bias-token"),
    pytest.param({"priority": 3}, {}, {"priority": [3]}, id="priority-without-policy"),
]


@pytest.fixture(scope="module")
def server(shared_engine, server_thread):
    with server_thread(build_app(ServerConfig(), engine=shared_engine)) as s:
        yield s


@pytest.fixture(scope="module")
def offline(shared_model) -> LLM:
    return LLM.from_loaded(*shared_model(**SETTINGS), **SETTINGS)


@pytest.mark.parametrize(("body", "params", "call"), CASES)
def test_offline_and_served_refusals_say_the_same(http, model, offline, body, params, call):
    fields = {"prompt": PROMPT, "max_tokens": 4, **body}
    served = http.post("/v1/completions", json={"model": model, **fields})
    assert served.status_code == 400, served.text
    error = served.json()["error"]
    prompt = call.get("prompt", fields["prompt"])
    sampling = SamplingParams(**{"max_tokens": 4, **params})
    with pytest.raises(ValueError) as refused:
        offline.generate([prompt], sampling, priority=call.get("priority"))
    assert str(refused.value) == error["message"]
    assert getattr(refused.value, "param", error["param"]) == error["param"]
