"""What a request asks its output to match: vLLM's ``StructuredOutputsParams``, validated at construction.

Exactly one constraint per request: a JSON schema (``json``), any JSON object (``json_object``), a regular
expression (``regex``), one of a list of strings (``choice``) or a grammar (``grammar``: Lark, or GBNF/EBNF
as llama.cpp writes it). The names are vLLM's, so ``SamplingParams(structured_outputs=
StructuredOutputsParams(json=schema))`` reads the same in both engines.

One deliberate difference: ``disable_any_whitespace`` defaults to True here (vLLM: False). With free
whitespace allowed between JSON tokens, small models often loop on newlines or spaces until max_tokens;
compact JSON (``", "`` and ``": "`` separators, no other whitespace) always parses and costs fewer tokens.
Set it to False to let the model place whitespace where it likes.

Plain Python, beside sampling_params.py, which holds it: the parameter types do not depend on the grammar
engine (tideserve/structured_output/), which compiles and enforces what this describes.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema, as a dict or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or GBNF/EBNF (llama.cpp's notation)
    json_object: bool | None = None  # any JSON object (OpenAI's response_format json_object)
    disable_any_whitespace: bool = True  # compact JSON; see the module docstring
    disable_additional_properties: bool = False  # objects get only the properties their schema lists

    def __post_init__(self) -> None:
        if self.json_object is False:
            self.json_object = None
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            listed = ", ".join(given) if given else "none"
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(CONSTRAINTS)}; "
                             f"got {listed}.")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = _json.loads(self.json)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}.") from None
            else:
                parsed = self.json
            if not isinstance(parsed, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object), got "
                                 f"{type(parsed).__name__}.")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be true, got {self.json_object!r}.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}.")
        if self.choice is not None:
            if (isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, (list, tuple))
                    or not self.choice or not all(isinstance(c, str) for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings, got "
                                 f"{self.choice!r}.")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``CONSTRAINTS``."""
        return next(name for name in CONSTRAINTS if getattr(self, name) is not None)

    @property
    def spec(self) -> str:
        """The constraint as text (a schema is re-serialized with sorted keys): the grammar cache's key."""
        kind = self.kind
        if kind == "json":
            schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
            return _json.dumps(schema, sort_keys=True, separators=(",", ":"))
        if kind == "json_object":
            return "{}"
        if kind == "choice":
            return _json.dumps(self.choice)
        return getattr(self, kind)

    def cache_key(self) -> tuple[Any, ...]:
        return (self.kind, self.spec, self.disable_any_whitespace, self.disable_additional_properties)


@dataclass(frozen=True)
class ReasoningMarkers:
    """A reasoning model's thinking-section markers as token ids: the grammar of a request that carries
    them constrains only the answer, which starts after ``end_token_ids`` (vLLM: the structured-output
    manager asks the reasoning parser whether the reasoning has ended).

    ``start_token_ids`` empty: the output is thinking until the end marker (the prompt may have opened the
    section; deepseek_r1). Given: thinking is optional and, when there is any, opens the output (qwen3);
    an output that starts with anything else is all answer. Each marker is matched as the tokenizer
    spells it: one id where the tokenizer has the marker as a token (Qwen3, DeepSeek-R1).
    """

    end_token_ids: tuple[int, ...]
    start_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "end_token_ids", tuple(self.end_token_ids))
        object.__setattr__(self, "start_token_ids", tuple(self.start_token_ids))
        if not self.end_token_ids:
            raise ValueError("reasoning_markers.end_token_ids must not be empty.")

