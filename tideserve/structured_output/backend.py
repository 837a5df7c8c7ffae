"""The grammar engine: llguidance compiles a constraint once and gives each request a matcher.

Why llguidance (measured in docs/structured-output.md on the embedded model's 49,152-token vocabulary):
it has no dependencies (xgrammar pulls triton and a TVM runtime), compiles a schema in about 2 ms
against xgrammar's ~90 ms (its lexer is built lazily), and fills a whole batch's masks in about a
millisecond per step on average at batch 32 (xgrammar's median is lower, its mean was higher on the
2-core dev machine); its resource limits bound the work a hostile grammar can cause.

A ``CompiledGrammar`` is immutable and shared through an LRU cache keyed by the constraint's text; a
``GrammarMatcher`` is one request's parser state. A matcher is advanced only after a token is sampled
(``accept_token``), never when the scheduler recomputes a preempted request's tokens, so its state
always matches the request's output tokens.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import json
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from tideserve.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# JSON: compact separators unless the request allows free whitespace (see structured_outputs_params.py).
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_FLEXIBLE = {"whitespace_flexible": True}
# A grammar that does not compile within this time is refused (llguidance's own limits stop the work).
DEFAULT_COMPILE_TIMEOUT_S = 10.0


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask (bit i of word w allows token 32 * w + i)."""
    return (vocab_size + 31) // 32


class GrammarMatcher:
    """One request's position in its grammar (an ``llguidance.LLMatcher``)."""

    def __init__(self, matcher: Any, eos_token_ids: Sequence[int]) -> None:
        self._m = matcher
        self._eos = frozenset(eos_token_ids)

    @property
    def handle(self) -> Any:
        return self._m

    @property
    def active(self) -> bool:
        """Whether the next sample is masked (always; a ``ReasoningGate`` says otherwise while thinking)."""
        return True

    def accept_token(self, token_id: int) -> bool:
        """Advance past a sampled token; False when the grammar refuses it (the matcher is then broken)."""
        if token_id in self._eos and self._m.is_accepting():
            self._m.consume_token(token_id)  # moves it to its stopped state
            return True
        return bool(self._m.consume_token(token_id))

    def is_accepting(self) -> bool:
        return bool(self._m.is_accepting())

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids``, from the first, the grammar would accept in turn (nothing consumed)."""
        return int(self._m.validate_tokens(list(token_ids))) if token_ids else 0

    def fill_bitmask_after(self, token_ids: Sequence[int], bitmask: torch.Tensor, row: int) -> None:
        """``fill_bitmask`` for the position after ``token_ids`` (a valid prefix): consumed, the mask
        written, then rolled back, so the matcher ends where it started."""
        for token_id in token_ids:
            self._m.consume_token(token_id)
        try:
            self.fill_bitmask(bitmask, row)
        finally:
            if token_ids:
                self._m.rollback(len(token_ids))

    def is_terminated(self) -> bool:
        """Nothing but end-of-sequence can follow."""
        return bool(self._m.is_stopped())

    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this matcher's allowed tokens into ``bitmask[row]`` (a CPU int32 tensor)."""
        view = bitmask[row]
        self._m.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())


class MatcherAfter:
    """A row that verifies proposals: ``matcher``'s mask at the position after ``token_ids`` (the proposals
    before the row). It fills its own row (no native handle), after the batched rows, since it moves the
    shared matcher forward and back."""

    handle = None
    active = True

    def __init__(self, matcher: GrammarMatcher, token_ids: Sequence[int]) -> None:
        self.matcher = matcher
        self.token_ids = list(token_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_bitmask_after(self.token_ids, bitmask, row)


class CompiledGrammar:
    """A compiled constraint: new matchers are copies of a pristine one (cheaper than re-compiling)."""

    def __init__(self, kind: str, grammar: str, template: Any, eos_token_ids: Sequence[int]) -> None:
        self.kind = kind
        self.grammar = grammar
        self._template = template
        self._eos = tuple(eos_token_ids)
        self._lock = threading.Lock()

    def matcher(self) -> GrammarMatcher:
        with self._lock:
            return GrammarMatcher(self._template.deep_copy(), self._eos)


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer; thread-safe, cached, bounded in time.

    ``vocab_size`` is the model's (its logits' width), which may exceed the tokenizer's; ids beyond the
    tokenizer are never allowed. ``eos_token_ids`` are the ids that end generation: the grammar allows
    them exactly when the output is complete.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = 256, compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = max(vocab_size, len(hf_tokenizer))
        self.eos_token_ids = list(dict.fromkeys(t for t in eos_token_ids if t is not None))
        self.cache_size = cache_size
        self.compile_timeout_s = compile_timeout_s
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple, CompiledGrammar] = collections.OrderedDict()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.num_compiled = 0  # cache misses, for tests and metrics

    # ---------------------------------------------------------------- tokenizer (built on first use)
    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
            return self._ll_tokenizer

    # ---------------------------------------------------------------- compiling
    def compile(self, params: StructuredOutputsParams, timeout_s: float | None = None) -> CompiledGrammar:
        """The compiled grammar (cached); raises ValueError naming the problem, or when compiling takes
        longer than ``timeout_s`` (default ``compile_timeout_s``)."""
        key = params.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="tideserve-grammar")
            pool = self._pool
        timeout = self.compile_timeout_s if timeout_s is None else timeout_s
        future = pool.submit(self._compile, params)
        try:
            compiled = future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise ValueError(f"structured_outputs: the {params.kind} constraint did not compile within "
                             f"{timeout:g} s; simplify it.") from None
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.num_compiled += 1
        return compiled

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        from llguidance import LLMatcher

        grammar = _to_llguidance(params)
        ll_tokenizer = self._tokenizer()
        template = LLMatcher(ll_tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"structured_outputs.{params.kind} is invalid: {_first_line(template.get_error())}")
        return CompiledGrammar(params.kind, grammar, template, self.eos_token_ids)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _to_llguidance(params: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar (its JSON form); ValueError when it cannot be read."""
    from llguidance import LLMatcher, grammar_from

    kind = params.kind
    options = _COMPACT if params.disable_any_whitespace else _FLEXIBLE
    try:
        if kind in ("json", "json_object"):
            schema: Any = {"type": "object"} if kind == "json_object" else params.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if params.disable_additional_properties:
                schema = _close_objects(copy.deepcopy(schema))
            return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
        if kind == "choice":
            return grammar_from("choice", json.dumps(params.choice))
        if kind == "regex":
            return LLMatcher.grammar_from_regex(params.regex)
        return grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as exc:
        raise ValueError(f"structured_outputs.{kind} is invalid: {_first_line(str(exc))}") from None


def _close_objects(schema: Any) -> Any:
    """additionalProperties: false on every object schema that does not say otherwise."""
    if isinstance(schema, dict):
        if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        for value in schema.values():
            _close_objects(value)
    elif isinstance(schema, list):
        for item in schema:
            _close_objects(item)
    return schema


def _first_line(message: str) -> str:
    """llguidance's errors carry a parser dump after a few lines; keep what a user can act on."""
    lines = []
    for line in message.strip().splitlines():
        if line.startswith("<state>") or line.startswith("<grammar>"):
            break
        if line.strip():
            lines.append(line.strip())
    return " ".join(lines[:5])[:500] if lines else "unknown error"
