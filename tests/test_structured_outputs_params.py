"""StructuredOutputsParams: exactly one constraint, each checked, errors that name the field."""

from __future__ import annotations

import pytest

from tideserve import SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize("kwargs, match", [
    ({}, r"exactly one of json, json_object, regex, choice, grammar; got none"),
    ({"json": {"type": "object"}, "regex": "a+"}, r"exactly one .* got json, regex"),
    ({"json": "{not json"}, r"structured_outputs.json is not valid JSON"),
    ({"json": "[1, 2]"}, r"structured_outputs.json must be a JSON schema \(an object\), got list"),
    ({"choice": []}, r"structured_outputs.choice must be a non-empty list of strings"),
    ({"choice": "yes"}, r"structured_outputs.choice must be a non-empty list of strings"),
    ({"choice": ["a", 1]}, r"structured_outputs.choice must be a non-empty list of strings"),
    ({"regex": ""}, r"structured_outputs.regex must be a non-empty string"),
    ({"grammar": 3}, r"structured_outputs.grammar must be a non-empty string"),
    ({"json_object": "yes"}, r"structured_outputs.json_object must be true"),
])
def test_invalid_params_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kwargs)


def test_cache_key_ignores_key_order_and_formatting():
    a = StructuredOutputsParams(json={"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"properties": {"a": {"type": "integer"}},  "type": "object", "required": ["a"]}')
    assert a.cache_key() == b.cache_key()
    assert a.cache_key() != StructuredOutputsParams(json=a.json, disable_any_whitespace=False).cache_key()
    assert StructuredOutputsParams(choice=["x", "y"]).spec == '["x", "y"]'


def test_sampling_params_take_a_dict_or_params_and_refuse_anything_else():
    params = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="[0-9]+")
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="[0-9]+")
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={})
