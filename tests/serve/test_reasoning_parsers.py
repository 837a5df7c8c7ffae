"""The reasoning parsers on text alone: the split of whole outputs, and streaming that, however the output
is cut into deltas, adds up to exactly the non-streamed split."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tideserve.serve.openai.reasoning_parsers import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningStreamer,
)


def split(parser, text: str) -> tuple[str, str]:
    s = parser.parse(text, final=True)
    return s.reasoning, s.content


@pytest.mark.parametrize("text, expected", [
    ("<think>plan it</think>the answer", ("plan it", "the answer")),
    ("plan it</think>the answer", ("plan it", "the answer")),  # the template opened <think> in the prompt
    ("<think>\nplan</think>\n\n{\"a\": 1}", ("\nplan", "\n\n{\"a\": 1}")),
    ("still thinking when cut off", ("still thinking when cut off", "")),
    ("<think>cut off", ("cut off", "")),
    ("a</think>b</think>c", ("a", "b</think>c")),  # only the first </think> closes the section
    ("</think>answer", ("", "answer")),
    ("", ("", "")),
])
def test_deepseek_r1_split(text, expected):
    assert split(DeepSeekR1ReasoningParser(), text) == expected


@pytest.mark.parametrize("text, expected", [
    ("<think>plan it</think>the answer", ("plan it", "the answer")),
    ("the answer, no thinking", ("", "the answer, no thinking")),
    ("plan</think>answer", ("", "plan</think>answer")),  # a section must open the output
    ("<think>cut off", ("cut off", "")),  # a cut-off section stays reasoning (see qwen3.py)
    ("<thin", ("", "<thin")),
    ("x<think>a</think>b", ("", "x<think>a</think>b")),
    ("", ("", "")),
])
def test_qwen3_split(text, expected):
    assert split(Qwen3ReasoningParser(), text) == expected


def test_registry_names_are_vllms():
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]


def test_a_marker_split_across_deltas_is_not_leaked():
    streamer = ReasoningStreamer(DeepSeekR1ReasoningParser())
    sent = [streamer.update("<think>abc</th"), streamer.update("<think>abc</think>{\"x\""),
            streamer.update("<think>abc</think>{\"x\": 1}", final=True)]
    assert sent == [("abc", ""), ("", "{\"x\""), ("", ": 1}")]


def test_end_marker_and_answer_in_one_delta():
    streamer = ReasoningStreamer(Qwen3ReasoningParser())
    assert streamer.update("<think>ab") == ("ab", "")
    assert streamer.update("<think>abc</think>done") == ("c", "done")


# Text made of marker pieces and plain characters, so splits land inside markers often.
_PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "<th", "ink>", "a", " ", "\n", "{}"])
_TEXT = st.lists(_PIECES, max_size=12).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=_TEXT, cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8),
       name=st.sampled_from(sorted(REASONING_PARSERS)))
def test_streamed_deltas_add_up_to_the_whole_split(text, cuts, name):
    parser = REASONING_PARSERS[name]()
    ends = sorted({min(c, len(text)) for c in cuts}) + [len(text)]
    streamer = ReasoningStreamer(parser)
    reasoning, content = "", ""
    for i, end in enumerate(ends):
        r, c = streamer.update(text[:end], final=i == len(ends) - 1)
        reasoning, content = reasoning + r, content + c
    assert (reasoning, content) == split(parser, text)
