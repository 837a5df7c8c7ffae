"""The real SmolLM2 tokenizer, loaded from the embedded GGUF: round trips, special tokens, chat template."""

from __future__ import annotations

from pathlib import Path

import pytest

from tideserve.model.loader.gguf_index import GGUFStringArray, read_gguf_index
from tideserve.tokenizer.tokenizer import Tokenizer, load_tokenizer, normalize_messages

TEXTS = [
    "Hello, world!",
    "你好，请介绍一下你自己",
    "emoji 😀👍🏽🇫🇷 and ZWJ 👨‍👩‍👧",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "mixed: café, naïve, 日本語, العربية, Ελληνικά",
]


def test_gguf_metadata_reader(gguf_path: Path) -> None:
    meta = read_gguf_index(str(gguf_path)).metadata
    assert meta["general.architecture"] == "llama"
    assert meta["tokenizer.ggml.eos_token_id"] == 2
    assert "{% for message in messages %}" in meta["tokenizer.chat_template"]
    tokens = meta["tokenizer.ggml.tokens"]  # left in the file
    assert isinstance(tokens, GGUFStringArray) and len(tokens) == 49152


def test_special_tokens_from_gguf(tokenizer: Tokenizer, gguf_path: Path) -> None:
    meta = read_gguf_index(str(gguf_path)).metadata
    assert tokenizer.eos_token_id == meta["tokenizer.ggml.eos_token_id"] == 2
    assert tokenizer.bos_token_id == meta["tokenizer.ggml.bos_token_id"]
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert tokenizer.chat_template == meta["tokenizer.chat_template"]
    assert tokenizer.vocab_size == 49152
    assert {0, 1, 2} <= set(tokenizer.all_special_ids)
    assert tokenizer.stop_token_ids[0] == tokenizer.eos_token_id


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_special_tokens_skipped_or_kept(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # special tokens stay whole
    assert tokenizer.decode(ids) == "user\nhi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    # GGUF control tokens beyond bos/eos/unk also count as special.
    repo = tokenizer.encode("<repo_name>")
    assert len(repo) == 1 and repo[0] in tokenizer.all_special_ids


def test_chat_template_renders_chinese(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "你好，请介绍一下你自己"}]
    text = tokenizer.apply_chat_template(messages)
    assert text.endswith("<|im_start|>user\n你好，请介绍一下你自己<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")  # the template's default system prompt
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert without == text[: -len("<|im_start|>assistant\n")]


def test_encode_chat_has_single_bos(tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    ids = tokenizer.encode_chat(messages)
    # <|im_start|> (the BOS here) once per message plus the generation prompt: nothing doubled.
    assert ids.count(tokenizer.bos_token_id) == 3
    assert tokenizer.decode(ids, skip_special_tokens=False) == tokenizer.apply_chat_template(messages)
    assert ids[:2] == tokenizer.encode("<|im_start|>system", add_special_tokens=False)


def test_encode_chat_adds_missing_bos_once(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """For a tokenizer that prepends BOS, a template without BOS gets one and one with BOS keeps one."""
    monkeypatch.setattr(tokenizer, "_adds_bos", True)
    bos = tokenizer.bos_token_id
    messages = [{"role": "user", "content": "hi"}]
    plain = tokenizer.encode_chat(messages, chat_template="{{ messages[0]['content'] }}")
    assert plain[0] == bos and plain.count(bos) == 1
    with_bos = tokenizer.encode_chat(messages, chat_template="<|im_start|>{{ messages[0]['content'] }}")
    assert with_bos == plain


def test_content_parts_are_joined(tokenizer: Tokenizer) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    as_parts = tokenizer.apply_chat_template([{"role": "user", "content": parts}])
    as_text = tokenizer.apply_chat_template([{"role": "user", "content": "first\nsecond"}])
    assert as_parts == as_text


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role must be one of"),
        ([{"role": "user"}], r"messages\[0\]\.content must be a string"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be a string"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], r"content\[0\].*'image_url'"),
        ([{"role": "user", "content": "ok"}, {"role": "user", "content": [{"type": "text"}]}],
         r"messages\[1\]"),
    ],
)
def test_malformed_messages(tokenizer: Tokenizer, messages: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tokenizer.apply_chat_template(messages)  # type: ignore[arg-type]


def test_tool_call_message_without_content() -> None:
    msgs = normalize_messages([{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}])
    assert msgs[0]["content"] == "" and msgs[0]["tool_calls"] == [{"id": "1"}]


def test_missing_chat_template_is_a_value_error(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokenizer.hf, "chat_template", None)
    with pytest.raises(ValueError, match="has no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_error_is_a_value_error(tokenizer: Tokenizer) -> None:
    template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="roles must alternate"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template)


def test_load_from_hf_directory(tokenizer: Tokenizer, tmp_path: Path) -> None:
    tokenizer.hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    again = load_tokenizer(str(tmp_path))
    for text in TEXTS:
        assert again.encode(text) == tokenizer.encode(text)
    assert again.eos_token_id == tokenizer.eos_token_id
    assert again.stop_token_ids == [2, 0]
    messages = [{"role": "user", "content": "你好"}]
    assert again.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing"))
    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"nope")
    with pytest.raises(ValueError, match="not a GGUF"):
        load_tokenizer(str(not_gguf))
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_add_special_tokens_on_chat_prompts(tokenizer: Tokenizer) -> None:
    """Unset: exactly one BOS; true/false (vLLM's field): the tokenizer's special tokens added or not."""
    import copy

    from tokenizers.processors import TemplateProcessing

    hf = copy.deepcopy(tokenizer.hf)  # a tokenizer that prepends BOS (id 1) to plain text
    hf._tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    bos = Tokenizer(hf)
    messages = [{"role": "user", "content": "hi"}]
    template = "{{ messages[0]['content'] }}"
    once = bos.encode_chat(messages, chat_template=template)
    assert once[0] == 1 and once[1] != 1
    assert bos.encode_chat(messages, chat_template=template, add_special_tokens=False) == once[1:]
    assert bos.encode_chat(messages, chat_template="<|im_start|>" + template, add_special_tokens=True)[:2] == [1, 1]


def test_bad_words_token_ids_cover_both_spellings(tokenizer: Tokenizer) -> None:
    ids = tokenizer.bad_words_token_ids(["Paris", "hello world"])
    texts = [tokenizer.decode(s) for s in ids]
    assert texts == ["Paris", " Paris", "hello world", " hello world"]
