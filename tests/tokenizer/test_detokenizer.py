"""Incremental detokenization: streamed text equals one-shot decoding; stop strings never leak."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tideserve.tokenizer.detokenizer import IncrementalDetokenizer
from tideserve.tokenizer.tokenizer import Tokenizer

TEXTS = [
    "你好，请介绍一下你自己。我是一个语言模型！",
    "Emoji: 😀👍🏽🇫🇷 👨‍👩‍👧 done",
    "Mixed 中文 and English, café ☕ — 日本語テキスト 🍣, العربية",
    "plain ascii with  double  spaces\nand lines",
]
PROMPT = "<|im_start|>user\nsay something<|im_end|>\n<|im_start|>assistant\n"
SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def stream(tok: Any, prompt_ids: list[int], ids: list[int], chunks: list[int] | None = None,
           **kwargs: Any) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed ids (one at a time, or in the given chunk sizes); return the detokenizer, every .text seen
    after each append, and the stop string hit; checks that .text only ever grows."""
    detok = IncrementalDetokenizer(tok, prompt_ids, **kwargs)
    seen: list[str] = []
    stop = None
    sizes = iter(chunks or [])
    pos = 0
    while pos < len(ids):
        size = max(1, next(sizes, 1))
        stop = detok.append(ids[pos:pos + size])
        pos += size
        seen.append(detok.text)
        if len(seen) > 1:
            assert seen[-1].startswith(seen[-2])
        if stop is not None:
            break
    if stop is None:
        detok.finish()
    assert detok.text.startswith(seen[-1] if seen else "")
    return detok, seen, stop


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_equals_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, _, stop = stream(tokenizer, tokenizer.encode(PROMPT), ids)
    assert stop is None
    assert detok.text == tokenizer.decode(ids) == text


def test_deltas_concatenate_to_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXTS[2])
    detok = IncrementalDetokenizer(tokenizer, [], stop=["never appears"])
    deltas = []
    for token_id in ids:
        detok.append([token_id])
        deltas.append(detok.take_delta())
        assert "\ufffd" not in deltas[-1]  # never a half character
    detok.finish()
    deltas.append(detok.take_delta())
    assert "".join(deltas) == tokenizer.decode(ids)


def test_incomplete_character_is_held_then_flushed(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("好")
    assert len(ids) > 1  # byte pieces
    detok = IncrementalDetokenizer(tokenizer, [])
    detok.append(ids[:-1])
    assert detok.text == ""  # nothing shown while the character is incomplete
    detok.finish()
    assert detok.text == tokenizer.decode(ids[:-1]) == "\ufffd"  # flushed like decode does


def test_prompt_ending_inside_a_character(tokenizer: Tokenizer) -> None:
    """Output bytes must not merge with a prompt's incomplete trailing character."""
    char = tokenizer.encode("你", add_special_tokens=False)
    prompt = tokenizer.encode("hello ", add_special_tokens=False) + char[:-1]
    ids = char[-1:] + tokenizer.encode(" ok", add_special_tokens=False)
    detok, _, _ = stream(tokenizer, prompt, ids)
    assert detok.text == tokenizer.decode(ids) == "\ufffd ok"


def test_special_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hi<|im_end|>", add_special_tokens=False)
    skipped, _, _ = stream(tokenizer, [], ids)
    kept, _, _ = stream(tokenizer, [], ids, skip_special_tokens=False)
    assert skipped.text == "hi"
    assert kept.text == "hi<|im_end|>"


def test_window_stays_small(tokenizer: Tokenizer) -> None:
    """Each step decodes a few tokens, never the whole output (O(1) per token)."""
    lengths: list[int] = []

    class CountingHF:
        def decode(self, ids: list[int], **kwargs: Any) -> str:
            lengths.append(len(ids))
            return tokenizer.hf.decode(ids, **kwargs)

    ids = tokenizer.encode(" ".join(TEXTS) * 10)
    assert len(ids) > 500
    detok, _, _ = stream(SimpleNamespace(hf=CountingHF()), tokenizer.encode(PROMPT), ids)
    assert detok.text == tokenizer.decode(ids)
    assert max(lengths) <= 16
    assert len(lengths) <= 2 * len(ids) + 2

    lengths.clear()  # a long run of skipped special tokens does not grow the window either
    ids = tokenizer.encode("a") + [tokenizer.eos_token_id] * 300 + tokenizer.encode("b")
    detok, _, _ = stream(SimpleNamespace(hf=CountingHF(), all_special_ids=tokenizer.all_special_ids), [], ids)
    assert detok.text == "ab" and max(lengths) <= 4


@st.composite
def token_ids(draw: st.DrawFn, tokenizer: Tokenizer) -> list[int]:
    """Ids that stress decoding: byte pieces of multi-byte characters, special tokens, anything."""
    pieces = draw(st.lists(st.one_of(
        st.text(alphabet=st.characters(codec="utf-8"), max_size=6).map(
            lambda s: tokenizer.encode(s, add_special_tokens=False)),
        st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=4),
        st.lists(st.sampled_from(tokenizer.all_special_ids), max_size=2),
    ), max_size=12))
    ids = [i for piece in pieces for i in piece]
    # Also cut inside a multi-byte character, leaving orphan byte pieces.
    if ids and draw(st.booleans()):
        del ids[draw(st.integers(0, len(ids) - 1))]
    return ids


@SETTINGS
@given(data=st.data())
def test_property_random_ids(tokenizer: Tokenizer, data: st.DataObject) -> None:
    ids = data.draw(token_ids(tokenizer))
    prompt = data.draw(st.sampled_from(
        [[], tokenizer.encode(PROMPT), tokenizer.encode("前文"), tokenizer.encode("前文")[:-1]]))
    skip = data.draw(st.booleans())
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=len(ids)))
    detok, _, stop = stream(tokenizer, prompt, ids, chunks, skip_special_tokens=skip)
    assert stop is None
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip)


# ---------------------------------------------------------------------- stop strings
@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("Hello world, this is a test.", "lo wo"),  # spans "Hello" | " world"
        ("你好，请介绍一下你自己", "介绍"),  # spans byte pieces of two characters
        ("Smile 😀 then stop", "😀"),
        ("abc STOP def", "STOP"),
    ],
)
@pytest.mark.parametrize("include", [False, True])
def test_stop_string(tokenizer: Tokenizer, text: str, stop: str, include: bool) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, seen, hit = stream(tokenizer, [], ids, stop=[stop], include_stop_str_in_output=include)
    assert hit == stop and detok.finished and detok.stop_string == stop
    index = text.find(stop)
    expected = text[: index + len(stop)] if include else text[:index]
    assert detok.text == expected
    for shown in seen[:-1]:  # before the hit: never any part that could be the stop string
        assert stop not in shown and expected.startswith(shown)
    if not include:
        assert all(stop not in shown for shown in seen)


def test_stop_string_completed_in_one_append(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["three", "two"])
    assert detok.append(ids) == "two"  # the first to complete wins, not the first in the list
    assert detok.text == "one "
    with pytest.raises(RuntimeError):
        detok.append([1])


def test_hold_back_is_released_by_finish(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("the end", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["endless"])
    detok.append(ids)
    assert detok.text == "the end"[: len("the end") - (len("endless") - 1)]
    detok.finish()
    assert detok.text == "the end" and detok.stop_string is None


def test_stop_found_in_flushed_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("x😀", add_special_tokens=False)[:-1]  # ends inside the emoji
    detok = IncrementalDetokenizer(tokenizer, [], stop=["\ufffd"])
    assert detok.append(ids) is None
    detok.finish()
    assert detok.text == "x" and detok.stop_string == "\ufffd"


@SETTINGS
@given(data=st.data())
def test_property_stop_strings(tokenizer: Tokenizer, data: st.DataObject) -> None:
    alphabet = st.sampled_from(list("ab c你好😀\n"))
    text = data.draw(st.text(alphabet=alphabet, min_size=1, max_size=30))
    stops = data.draw(st.lists(st.text(alphabet=alphabet, min_size=1, max_size=4), min_size=1, max_size=3))
    include = data.draw(st.booleans())
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids)
    chunks = data.draw(st.lists(st.integers(1, 3), max_size=len(ids)))
    detok, seen, hit = stream(tokenizer, [], ids, chunks, stop=stops, include_stop_str_in_output=include)

    # The stop string that is complete first (smallest end, then earliest start) wins.
    found = sorted((full.find(s) + len(s), full.find(s), s) for s in stops if s in full)
    if not found:
        assert hit is None and detok.text == full
        return
    end, index, _ = found[0]
    assert hit is not None and (full.find(hit) + len(hit), full.find(hit)) == (end, index)
    assert detok.text == (full[:end] if include else full[:index])
    for shown in seen[:-1]:
        assert detok.text.startswith(shown)
        assert all(s not in shown for s in stops)


def test_decodes_through_the_rust_tokenizer(tokenizer: Tokenizer) -> None:
    """The fast path the property tests above hold to HF's decode: the ``tokenizers`` object itself."""
    from tokenizers import Tokenizer as RustTokenizer

    assert isinstance(IncrementalDetokenizer(tokenizer, [])._backend, RustTokenizer)
