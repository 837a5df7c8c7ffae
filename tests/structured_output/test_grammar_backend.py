"""The llguidance backend on the embedded model's real tokenizer: what each constraint allows token by
token, where EOS becomes legal, errors that name the problem, the compile cache and its time bound."""

from __future__ import annotations

import threading

import pytest
import torch

from tideserve.structured_output.backend import bitmask_width
from tideserve.structured_outputs_params import StructuredOutputsParams

VOCAB = 49152


def allowed(matcher) -> set[int]:
    bitmask = torch.zeros(1, bitmask_width(VOCAB), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    words = bitmask[0].tolist()
    return {32 * w + b for w, word in enumerate(words) if word for b in range(32) if (word >> b) & 1}


def walk(compiler, tokenizer, params: StructuredOutputsParams, text: str) -> list[set[int]]:
    """Feed ``text``'s tokens through a fresh matcher; returns the allowed set before each token and at
    the end. Fails if the grammar refuses a token."""
    matcher = compiler.compile(params).matcher()
    sets = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        sets.append(allowed(matcher))
        assert token in sets[-1], f"{tokenizer.decode([token])!r} not allowed in {text!r}"
        assert matcher.accept_token(token), matcher.error()
    sets.append(allowed(matcher))
    return sets


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags"],
          "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}}


def test_json_schema_allows_eos_only_when_complete(compiler, smollm2_tokenizer):
    eos = smollm2_tokenizer.eos_token_id
    text = '{"name": "Ann", "tags": ["a", "b"]}'
    sets = walk(compiler, smollm2_tokenizer, StructuredOutputsParams(json=SCHEMA), text)
    assert all(eos not in s for s in sets[:-1])
    assert sets[-1] == {eos}  # complete: nothing but the end can follow


def test_schema_refuses_what_it_does_not_match(compiler, smollm2_tokenizer):
    matcher = compiler.compile(StructuredOutputsParams(json=SCHEMA)).matcher()
    tokens = smollm2_tokenizer.encode('{"name": "ann"', add_special_tokens=False)  # pattern needs a capital
    assert not all(matcher.accept_token(t) for t in tokens)
    assert matcher.error()


def test_compact_json_by_default_free_whitespace_on_request(compiler, smollm2_tokenizer):
    newline = smollm2_tokenizer.encode("\n", add_special_tokens=False)[0]
    compact = compiler.compile(StructuredOutputsParams(json_object=True)).matcher()
    assert compact.accept_token(smollm2_tokenizer.encode("{", add_special_tokens=False)[0])
    assert newline not in allowed(compact)
    flexible = compiler.compile(StructuredOutputsParams(json_object=True, disable_any_whitespace=False)).matcher()
    assert flexible.accept_token(smollm2_tokenizer.encode("{", add_special_tokens=False)[0])
    assert newline in allowed(flexible)


def test_disable_additional_properties_closes_objects(compiler, smollm2_tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    ids = smollm2_tokenizer.encode('{"a": 1, "b": 2}', add_special_tokens=False)
    open_matcher = compiler.compile(StructuredOutputsParams(json=schema)).matcher()
    assert all(open_matcher.accept_token(t) for t in ids)  # JSON schema's default: extra keys allowed
    closed = compiler.compile(StructuredOutputsParams(json=schema, disable_additional_properties=True)).matcher()
    assert not all(closed.accept_token(t) for t in ids)


@pytest.mark.parametrize("params, text", [
    (StructuredOutputsParams(regex=r"\d{3}-\d{4}"), "555-0199"),
    (StructuredOutputsParams(choice=["yes", "no", "maybe"]), "maybe"),
    (StructuredOutputsParams(grammar='root ::= "[" num ("," num)* "]"\nnum ::= [0-9]+'), "[1,22,333]"),  # GBNF
    (StructuredOutputsParams(grammar='start: "x"+ "!"'), "xxx!"),  # Lark
])
def test_regex_choice_and_grammars(compiler, smollm2_tokenizer, params, text):
    sets = walk(compiler, smollm2_tokenizer, params, text)
    assert smollm2_tokenizer.eos_token_id in sets[-1]


@pytest.mark.parametrize("params, match", [
    (StructuredOutputsParams(json={"type": "foo"}), r"structured_outputs.json is invalid: Invalid type: foo"),
    (StructuredOutputsParams(json={"properties": {"a": {"$ref": "#/$defs/missing"}}}),
     r"structured_outputs.json is invalid: .*missing"),
    (StructuredOutputsParams(json={"type": "string", "pattern": "[a-"}),
     r"structured_outputs.json is invalid: .*regex"),
    (StructuredOutputsParams(regex="[a-"), r"structured_outputs.regex is invalid: .*unclosed character class"),
    (StructuredOutputsParams(grammar='start: "a" | "b'), r"structured_outputs.grammar is invalid"),
    (StructuredOutputsParams(grammar="root ::= ("), r"structured_outputs.grammar is invalid"),
])
def test_invalid_constraints_are_value_errors(compiler, params, match):
    before = compiler.num_compiled
    with pytest.raises(ValueError, match=match):
        compiler.compile(params)
    assert compiler.num_compiled == before  # nothing cached


def test_compiled_grammars_are_cached_lru(smollm2_tokenizer):
    from tideserve.structured_output.backend import GrammarCompiler

    compiler = GrammarCompiler(smollm2_tokenizer.hf, VOCAB, [2], cache_size=2)
    a, b, c = (StructuredOutputsParams(choice=[x]) for x in "abc")
    first = compiler.compile(a)
    assert compiler.compile(StructuredOutputsParams(choice=["a"])) is first
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recent
    compiler.compile(c)  # evicts b
    assert compiler.num_compiled == 3
    compiler.compile(a)
    assert compiler.num_compiled == 3
    compiler.compile(b)
    assert compiler.num_compiled == 4
    compiler.shutdown()


def test_a_compile_that_takes_too_long_is_refused(smollm2_tokenizer, monkeypatch):
    from tideserve.structured_output.backend import GrammarCompiler

    compiler = GrammarCompiler(smollm2_tokenizer.hf, VOCAB, [2])
    release = threading.Event()
    real = compiler._compile

    def slow(params):
        release.wait(10)
        return real(params)

    monkeypatch.setattr(compiler, "_compile", slow)
    with pytest.raises(ValueError, match=r"did not compile within 0.05 s"):
        compiler.compile(StructuredOutputsParams(regex="a+"), timeout_s=0.05)
    release.set()
    compiler.shutdown()
