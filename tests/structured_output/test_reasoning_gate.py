"""The reasoning gate on the embedded model's real tokenizer: a grammar stays out of the thinking section
(no mask, no advance) and applies from the token after the end marker; with optional thinking the first
token decides, and a multi-token start marker, once begun, is forced to completion."""

from __future__ import annotations

import json

import pytest
import torch

from tideserve.structured_output.backend import bitmask_width
from tideserve.structured_output.reasoning_gate import ReasoningGate, _allow, gated
from tideserve.structured_outputs_params import ReasoningMarkers, StructuredOutputsParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok"],
          "properties": {"ok": {"type": "boolean"}}}
ANSWER = json.dumps({"ok": True})
VOCAB = 49152


def allowed(matcher) -> set[int]:
    bitmask = torch.zeros(1, bitmask_width(VOCAB), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    words = bitmask[0].tolist()
    return {32 * w + b for w, word in enumerate(words) if word for b in range(32) if (word >> b) & 1}


@pytest.fixture(scope="module")
def ids(smollm2_tokenizer):
    def encode(text: str) -> list[int]:
        return smollm2_tokenizer.encode(text, add_special_tokens=False)
    return encode


@pytest.fixture(scope="module")
def grammar(compiler):
    return compiler.compile(StructuredOutputsParams(json=SCHEMA))


def feed(gate, tokens: list[int]) -> None:
    for token in tokens:
        assert gate.accept_token(token), gate.error()


def test_thinking_is_free_and_the_grammar_starts_after_the_end_marker(grammar, ids):
    gate = ReasoningGate(grammar.matcher(), ReasoningMarkers(tuple(ids("</think>"))))
    first_json_set = allowed(grammar.matcher())
    assert not gate.active  # no mask while thinking
    feed(gate, ids("Not JSON at all: {{ <b>"))  # the grammar would refuse all of this
    assert not gate.active and not gate.is_accepting()
    feed(gate, ids("\n</think>"))
    assert gate.active and gate.handle is not None
    assert allowed(gate) == first_json_set  # the grammar has not moved during the thinking
    feed(gate, ids(ANSWER))
    assert gate.is_accepting()


def test_without_markers_the_matcher_is_used_as_is(grammar):
    matcher = grammar.matcher()
    assert gated(matcher, None) is matcher and matcher.active


def test_optional_thinking_first_token_answers_at_once(grammar, ids):
    start = tuple(ids("<think>"))
    gate = ReasoningGate(grammar.matcher(), ReasoningMarkers(tuple(ids("</think>")), start))
    assert gate.active and gate.handle is None  # undecided: the grammar's tokens plus the marker's first
    assert allowed(gate) == allowed(grammar.matcher()) | {start[0]}
    feed(gate, ids(ANSWER))  # "{" is not the marker: no thinking, the grammar applied from the start
    assert gate.is_accepting()


def test_optional_thinking_opened_is_forced_whole_then_free(grammar, ids):
    start, end = tuple(ids("<think>")), tuple(ids("</think>"))
    assert len(start) > 1  # SmolLM2 has no <think> token: the text spelling is several tokens
    gate = ReasoningGate(grammar.matcher(), ReasoningMarkers(end, start))
    feed(gate, [start[0]])
    for token in start[1:]:
        assert allowed(gate) == {token}  # the rest of the marker is forced
        feed(gate, [token])
    assert not gate.active
    feed(gate, ids("anything goes</think>"))
    feed(gate, ids(ANSWER))
    assert gate.is_accepting()


def test_a_batch_mixes_gated_and_plain_rows(smollm2_tokenizer, grammar, ids):
    from tideserve.structured_output.manager import StructuredOutputManager

    manager = StructuredOutputManager(smollm2_tokenizer.hf, VOCAB, smollm2_tokenizer.stop_token_ids)
    start = tuple(ids("<think>"))
    rows = [(0, grammar.matcher()), (1, ReasoningGate(grammar.matcher(), ReasoningMarkers((7,), start))),
            (3, grammar.matcher())]
    mask = manager.compute(rows, torch.device("cpu")).result()
    assert mask.rows == [0, 1, 3]
    for i, (_, matcher) in enumerate(rows):
        expected = torch.zeros(1, bitmask_width(VOCAB), dtype=torch.int32)
        matcher.fill_bitmask(expected, 0)
        assert torch.equal(mask.bitmask[i], expected[0]), i
    manager.shutdown()


def test_allow_sets_the_sign_bit_of_an_int32_word():
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    _allow(bitmask, 0, 31)
    _allow(bitmask, 0, 32)
    assert bitmask.tolist() == [[-(2**31), 1]]
