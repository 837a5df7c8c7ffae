"""/v1/embeddings through the openai SDK's ``client.embeddings``: one unit vector per input, in order, the
same whether it comes as float lists or as the base64 the SDK asks for by default, the same for text and
its token ids, a conversation in ``messages`` the same as its rendered tokens, and every input the server
cannot embed gets a 400 that names it. One server for the module."""

from __future__ import annotations

import base64

import numpy as np
import pytest

openai = pytest.importorskip("openai")

TEXTS = ["The sky is blue.", "Paris is the capital of France.", "Embeddings map text to vectors."]


def embed(client, model, inputs, **kwargs) -> list[np.ndarray]:
    reply = client.embeddings.create(model=model, input=inputs, **kwargs)
    assert [d.index for d in reply.data] == list(range(len(reply.data)))
    return [np.asarray(d.embedding, dtype=np.float64) for d in reply.data]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def token_ids(http, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


def test_the_sdk_default_base64_carries_the_float_vector(client, model, http):
    """The SDK sends encoding_format=base64 unless told otherwise, and decodes little-endian float32."""
    decoded = embed(client, model, TEXTS[0])[0]
    floats = embed(client, model, TEXTS[0], encoding_format="float")[0]
    assert decoded.shape == (576,) and abs(np.linalg.norm(decoded) - 1) < 1e-5
    np.testing.assert_array_equal(decoded, floats.astype(np.float32))
    raw = http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    assert np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4").tolist() == floats.tolist()


def test_a_batch_keeps_its_order_and_counts_its_tokens(client, model, http):
    reply = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    assert reply.object == "list" and reply.model == model and len(reply.data) == 3
    counts = [len(token_ids(http, t)) for t in TEXTS]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(counts)
    for text, item in zip(TEXTS, reply.data):
        alone = embed(client, model, text, encoding_format="float")[0]
        assert cosine(np.asarray(item.embedding), alone) > 0.999
    assert cosine(np.asarray(reply.data[0].embedding), np.asarray(reply.data[1].embedding)) < 0.999


def test_token_ids_embed_as_their_text(client, model, http):
    ids = [token_ids(http, t) for t in TEXTS[:2]]
    from_text = embed(client, model, TEXTS[:2], encoding_format="float")
    for one, text_vector in zip([ids[0]], from_text):  # one list of ids is one input
        assert cosine(embed(client, model, one, encoding_format="float")[0], text_vector) > 0.9999
    for id_vector, text_vector in zip(embed(client, model, ids, encoding_format="float"), from_text):
        assert cosine(id_vector, text_vector) > 0.9999


def test_normalize_false_keeps_the_length_and_the_direction(client, model):
    unit = embed(client, model, TEXTS[1], encoding_format="float")[0]
    raw = embed(client, model, TEXTS[1], encoding_format="float", extra_body={"normalize": False})[0]
    assert np.linalg.norm(raw) > 2 and cosine(raw, unit) > 0.9999


def test_truncation_keeps_the_last_tokens(client, model, http):
    long_text = " ".join(f"item{i}" for i in range(400))
    ids = token_ids(http, long_text)
    assert len(ids) > 512
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=model, input=long_text)
    assert err.value.body["param"] == "input"
    assert err.value.body["message"] == (
        f"This model's maximum context length is 512 tokens. However, you requested {len(ids)} tokens in the "
        "input for embedding generation. Please reduce the length of the input.")
    cut = embed(client, model, long_text, encoding_format="float", extra_body={"truncate_prompt_tokens": 100})[0]
    assert cosine(cut, embed(client, model, ids[-100:], encoding_format="float")[0]) > 0.9999
    full = embed(client, model, ids[-512:], encoding_format="float")[0]  # an input may fill the context
    assert full.shape == (576,)


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"input": ""}, "input", "input must not be empty."),
    ({"input": []}, "input", "input must not be empty: give a text, a list of texts"),
    ({"input": ["a", ""]}, "input", "input[1]: input must not be empty."),
    ({"input": [[1, 2], [99999]]}, "input", "input[1]: input token id 99999 is out of range"),
    ({"input": ["a"] * 2049}, "input", "input has 2049 entries; at most 2048"),
    ({"input": "a", "dimensions": 64}, "dimensions", "dimensions=64 is not supported: this model's embeddings "
                                                     "have 576 dimensions"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", "encoding_format: Input should be"),
    ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "truncate_prompt_tokens must be"),
    ({"input": "a", "messages": [{"role": "user", "content": "a"}]}, "input", "Give exactly one of input and messages"),
    ({}, "input", "Give exactly one of input and messages"),
    ({"messages": [{"content": "a"}]}, "messages", "messages[0]"),
    ({"messages": [{"role": "user", "content": "word " * 3000}]}, "messages",
     "This model's maximum context length is"),
    ({"messages": [{"role": "assistant", "content": "a"}], "continue_final_message": True,
      "add_generation_prompt": True}, "continue_final_message", "Cannot set both `continue_final_message`"),
])
def test_bad_inputs_get_a_400_naming_the_field(http, body, param, message):
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(message), err
    assert http.get("/load").json().get("server_load", 0) == 0  # nothing was left running


CONVERSATION = [{"role": "system", "content": "You sort support tickets."},
                {"role": "user", "content": "My invoice shows the wrong address."}]


def embed_messages(http, **body) -> tuple[np.ndarray, int]:
    r = http.post("/v1/embeddings", json={"messages": CONVERSATION, "encoding_format": "float", **body})
    assert r.status_code == 200, r.text
    reply = r.json()
    assert len(reply["data"]) == 1 and reply["usage"]["prompt_tokens"] == reply["usage"]["total_tokens"]
    return np.asarray(reply["data"][0]["embedding"]), reply["usage"]["prompt_tokens"]


def test_messages_embed_as_their_rendered_conversation(client, model, http):
    """vLLM's chat form: the chat template renders the conversation (no assistant header by default), and
    the vector is the one its tokens give as an input."""
    rendered = http.post("/tokenize", json={"messages": CONVERSATION, "add_generation_prompt": False}).json()
    vector, count = embed_messages(http)
    assert count == rendered["count"]
    as_input = embed(client, model, rendered["tokens"], encoding_format="float")[0]
    np.testing.assert_allclose(vector, as_input, atol=1e-5)
    plain = embed(client, model, CONVERSATION[1]["content"], encoding_format="float")[0]
    assert cosine(vector, plain) < 0.999  # the template's turns are part of what is embedded

    prompted, prompted_count = embed_messages(http, add_generation_prompt=True)
    with_header = http.post("/tokenize", json={"messages": CONVERSATION}).json()
    assert prompted_count == with_header["count"] > count
    np.testing.assert_allclose(prompted, embed(client, model, with_header["tokens"], encoding_format="float")[0],
                               atol=1e-5)


def test_messages_take_the_request_template_and_truncation(http):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    vector, count = embed_messages(http, chat_template=template)
    tokens = http.post("/tokenize", json={"messages": CONVERSATION, "chat_template": template,
                                          "add_generation_prompt": False}).json()["tokens"]
    assert count == len(tokens)
    _, cut = embed_messages(http, chat_template=template, truncate_prompt_tokens=5)
    assert cut == 5


def test_dimensions_equal_to_the_hidden_size_is_accepted(client, model):
    assert embed(client, model, "a", dimensions=576)[0].shape == (576,)


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="a")


@pytest.fixture(scope="module")
def headless_server(tmp_path_factory, smollm2_gguf_path, make_engine, server_thread):
    """A tiny random ``LlamaModel`` checkpoint (an embedding model's layout: no LM head) with SmolLM2's
    tokenizer, served."""
    import torch
    from transformers import AutoModel, LlamaConfig

    from tideserve.serve.config import ServerConfig
    from tideserve.serve.openai.server import build_app
    from tideserve.tokenizer.tokenizer import load_tokenizer

    directory = tmp_path_factory.mktemp("headless")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=512)
    AutoModel.from_config(config, dtype=torch.float32).save_pretrained(directory)
    load_tokenizer(str(smollm2_gguf_path)).hf.save_pretrained(directory)
    engine = make_engine(model=str(directory))
    with server_thread(build_app(ServerConfig(), engine=engine)) as s:
        yield s


def test_an_embedding_model_serves_embeddings_and_refuses_generation(headless_server):
    import httpx

    with httpx.Client(base_url=headless_server.url, timeout=60) as http:
        r = http.post("/v1/embeddings", json={"input": TEXTS})
        assert r.status_code == 200, r.text
        assert [len(d["embedding"]) for d in r.json()["data"]] == [64, 64, 64]
        for path, body in [("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                           ("/v1/responses", {"input": "Hi"})]:
            r = http.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            assert r.json()["error"]["message"].startswith(
                "The model does not support generation: headless"), r.json()
            assert "is an embedding model (a LlamaModel checkpoint, without a language-model head). Use " \
                   "/v1/embeddings" in r.json()["error"]["message"]
