"""Sampling parameters of one request, validated at construction.

Every value a user can get wrong raises ``ValueError`` naming the parameter, the value and the limit, so
the offline API and the HTTP server report the same precise message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tideserve.pooling_params import PoolingParams
from tideserve.structured_outputs_params import ReasoningMarkers, StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]  # vLLM's import path for both

_GREEDY_EPS = 1e-5
# OpenAI's range for logit_bias values: -100 bans a token in practice, 100 all but forces it.
LOGIT_BIAS_LIMIT = 100.0


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: as many as the context allows
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per generated token (0 = sampled token only)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Samples generated per prompt, of which the n with the highest cumulative logprob are returned
    # (vLLM V0's and OpenAI's best_of); None: n.
    best_of: int | None = None
    # Logits processing (tideserve/model/layers/logit_bias.py): a bias added to a token's logit before
    # sampling (OpenAI's logit_bias; keys are token ids, given as ints or, as OpenAI sends them, strings),
    # the only tokens that may be sampled, and words that must not appear in the output.
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Constrained decoding (JSON schema, JSON object, regex, choice, grammar); a dict is converted.
    structured_outputs: StructuredOutputsParams | None = None
    # A reasoning model's thinking markers (set by a server with --reasoning-parser): the grammar of
    # structured_outputs then applies only after the thinking section.
    reasoning_markers: ReasoningMarkers | None = None
    extra_stop_token_ids: list[int] = field(default_factory=list, repr=False)
    # bad_words as token id sequences, resolved with the model's tokenizer when the engine accepts the
    # request (set by the engine, not by users).
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # An embedding request's pooling, resolved (set by the engine, not by users): the prompt is prefilled,
    # its hidden states pooled, and no token is generated (max_tokens 0).
    pooling: PoolingParams | None = field(default=None, repr=False)
    # What the sampler derives from the fields above once per request (e.g. the logit_bias tensors);
    # never copied by dataclasses.replace, so a changed copy derives its own.
    derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = _token_id_keys(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                    StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams (or a dict of its fields), "
                             f"got {type(self.structured_outputs).__name__}.")
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, value: object, limit: str) -> ValueError:
            return ValueError(f"{name} must be {limit}, got {value!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", self.temperature, "a finite number >= 0")
        if not _is_finite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "an integer >= 0 (0 or -1 disables it)")
        if not _is_finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if not _is_finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty, "a finite number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_finite(value) or not -2 <= value <= 2:
                raise bad(name, value, "in [-2, 2]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "an integer")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 0):
            raise bad("max_tokens", self.max_tokens, "an integer >= 0")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", s, "a list of non-empty strings")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise bad("stop_token_ids", t, "a list of integers >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise bad(name, value, "an integer >= 0")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise bad("best_of", self.best_of, f"an integer >= n ({self.n})")
        for token_id, bias in (self.logit_bias or {}).items():
            if token_id < 0:
                raise ValueError(f"logit_bias[{str(token_id)!r}] is not a token id: token ids are >= 0.")
            if not _is_finite(bias) or abs(bias) > LOGIT_BIAS_LIMIT:
                raise bad(f"logit_bias[{str(token_id)!r}]", bias,
                          f"in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids", [], "a non-empty list of token ids (an empty one allows nothing)")
            for t in self.allowed_token_ids:
                if not _is_int(t) or t < 0:
                    raise bad("allowed_token_ids", t, "a list of integers >= 0")
        for word in self.bad_words or ():
            if not isinstance(word, str) or not word.strip():
                raise bad("bad_words", word, "a list of non-empty strings")

    def check_token_ids(self, vocab_size: int) -> None:
        """Token ids the request names must exist in the model's vocabulary (the engine calls this)."""
        for token_id in self.logit_bias or {}:
            if token_id >= vocab_size:
                raise ValueError(f"logit_bias[{str(token_id)!r}] is not a token id: it must be in [0, "
                                 f"{vocab_size}).")
        for token_id in self.allowed_token_ids or ():
            if token_id >= vocab_size:
                raise ValueError(f"allowed_token_ids has {token_id}, which is not a token id: ids must be "
                                 f"in [0, {vocab_size}).")
        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                raise ValueError(f"stop_token_ids has {token_id}, which is not a token id: ids must be in "
                                 f"[0, {vocab_size}).")

    @property
    def num_samples(self) -> int:
        """Samples the engine generates: best_of when set, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def needs_every_prompt_position(self) -> bool:
        """Prompt logprobs and MEAN/CLS pooling read every prompt position, so such requests skip the
        prefix cache (a hit leaves the cached positions uncomputed)."""
        return self.prompt_logprobs is not None or (self.pooling is not None
                                                    and self.pooling.needs_every_prompt_position)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def all_stop_token_ids(self) -> set[int]:
        return set(self.stop_token_ids) | set(self.extra_stop_token_ids)


def _token_id_keys(bias: dict | None) -> dict[int, float] | None:
    """logit_bias with int keys: OpenAI sends token ids as JSON object keys, i.e. strings."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a mapping of token ids to biases, got {type(bias).__name__}.")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if _is_int(key):
            token_id = key
        elif isinstance(key, str) and key.strip().lstrip("-").isdecimal():
            token_id = int(key)
        else:
            raise ValueError(f"logit_bias[{key!r}] must be keyed by a token id (an integer), got {key!r}.")
        out[token_id] = value
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")
