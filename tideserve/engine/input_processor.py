"""Every check of a request, once: prompt, lengths, sampling parameters, priority, salt, constraint.

Why one place: the server and the offline ``LLM`` must refuse the same bad request with the same words,
and the engine core should trust what reaches it. ``process`` tokenizes a prompt (or takes its token
ids), checks everything a user can get wrong against the model and the engine's limits, compiles a
structured-output constraint, and returns a typed ``EngineRequest`` that ``LLMEngine.add`` queues
without checking again. Every mistake is a ``ValueError`` (``InvalidParameterError`` when it names one
request field) whose message names the parameter, the value and the limit.

Read-only after construction, so any thread may call it (the grammar compiler's cache is thread-safe).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tideserve.config import ModelConfig, SchedulerConfig
from tideserve.errors import InvalidParameterError
from tideserve.model.arch_config import ArchConfig
from tideserve.pooling_params import PoolingParams
from tideserve.sampling_params import SamplingParams
from tideserve.structured_output.manager import StructuredOutputManager
from tideserve.tokenizer.tokenizer import Tokenizer

# The most samples one request may ask for (n, best_of): a guard against a request that never finishes.
MAX_N = 128


@dataclass
class EngineRequest:
    """A request every check has passed: what the engine core queues as it is."""

    request_id: str | None  # None: the engine names it
    prompt: str | None  # the prompt's text, when it came as text
    prompt_token_ids: list[int]
    params: SamplingParams  # an embedding request's in its engine form (max_tokens 0, pooling set)
    max_tokens: int  # resolved: the room left in the context when the request did not say
    priority: int = 0
    cache_salt: str | None = None
    grammar: Any = None  # the compiled structured-output constraint, or None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    extra_stop_token_ids: list[int] = field(default_factory=list)  # the model's other end-of-generation ids

    @property
    def is_embedding(self) -> bool:
        return self.params.pooling is not None


class InputProcessor:
    """Tokenizes and validates requests against one model and one engine's limits."""

    def __init__(self, tokenizer: Tokenizer, arch: ArchConfig, model_name: str, max_model_len: int,
                 model_config: ModelConfig, scheduler_config: SchedulerConfig,
                 structured_output: StructuredOutputManager) -> None:
        self.tokenizer = tokenizer
        self.arch = arch
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.model_config = model_config
        self.scheduler_config = scheduler_config
        self.structured_output = structured_output

    # ----------------------------------------------------------------- the whole request
    def process(self, prompt: str | Sequence[int], params: SamplingParams | PoolingParams | None = None,
                request_id: str | None = None, prompt_token_ids: list[int] | None = None,
                priority: int = 0, cache_salt: str | None = None, *, names: Mapping[str, str] | None = None,
                max_n: int | None = None) -> EngineRequest:
        """A checked request: ``prompt`` is text or token ids (``prompt_token_ids``, when given, are the
        tokens and ``prompt`` only the text they came from); PoolingParams make an embedding request.

        ``names`` maps the engine's parameter names (prompt, max_tokens, logprobs, prompt_logprobs, n,
        best_of, dimensions) to the request's own (an API's "messages", "max_completion_tokens",
        "top_logprobs"), so every message names what the caller sent; ``max_n`` lowers the samples cap.
        """
        names = names or {}
        embedding = isinstance(params, PoolingParams)
        if not embedding and not self.arch.generates:
            raise ValueError(self.embedding_only_message())
        if embedding:
            try:
                params = self.pooling_sampling_params(params)
            except ValueError as exc:
                raise InvalidParameterError(str(exc), names.get("dimensions", "dimensions")) from exc
        else:
            params = params or SamplingParams()
            self.check_caps(params, names, max_n)
        self.check_priority(priority)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidParameterError(f"cache_salt must be a non-empty string, got {cache_salt!r}.",
                                        "cache_salt")
        if prompt_token_ids is not None:
            text = prompt if isinstance(prompt, str) else None
            token_ids = self.check_token_ids(prompt_token_ids)
        else:
            text, token_ids = self.tokenize_prompt(prompt)
        if embedding:
            self.check_embedding_length(len(token_ids), names.get("prompt", "input"))
            max_tokens = 0
        else:
            max_tokens = self.check_lengths(len(token_ids), params, names)
        params.check_token_ids(self.arch.vocab_size)
        bad_words_ids = self.tokenizer.bad_words_token_ids(params.bad_words) if params.bad_words else []
        grammar = None
        if params.structured_outputs is not None:  # compiled (and cached) before anything is added
            grammar = self.structured_output.compile(params.structured_outputs)
        eos = self.tokenizer.eos_token_id
        extra_stop = [] if params.ignore_eos else [t for t in self.arch.eos_token_ids if t != eos]
        return EngineRequest(request_id, text, token_ids, params, max_tokens, priority, cache_salt, grammar,
                             bad_words_ids, extra_stop)

    def check_caps(self, params: SamplingParams, names: Mapping[str, str] | None = None,
                   max_n: int | None = None) -> None:
        """The engine's limits on one request: samples (n, best_of) and logprobs per token."""
        names = names or {}
        cap = MAX_N if max_n is None else min(max_n, MAX_N)
        for name in ("n", "best_of"):
            value = getattr(params, name)
            if value is not None and value > cap:
                field_name = names.get(name, name)
                raise InvalidParameterError(f"{field_name} must be <= {cap}, got {value}.", field_name)
        limit = self.model_config.max_logprobs
        for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise InvalidParameterError(f"Requested {what} logprobs of {value}, which is greater than max "
                                            f"allowed: {limit}", names.get(name, name))

    # ----------------------------------------------------------------- its parts
    def tokenize_prompt(self, prompt: str | Sequence[int],
                        add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty.")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return None, self.check_token_ids(prompt)

    def check_token_ids(self, token_ids: Sequence[int]) -> list[int]:
        """A prompt given as token ids: not empty, and every id a token of the model's vocabulary."""
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("prompt must not be empty (got an empty list of token ids).")
        vocab = self.arch.vocab_size
        for t in token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is out of range: it must be in [0, {vocab}).")
        return token_ids

    def check_lengths(self, num_prompt_tokens: int, params: SamplingParams,
                      names: Mapping[str, str] | None = None) -> int:
        """Returns the resolved max_tokens; raises when the prompt or the output cannot fit (vLLM's wording,
        which clients match on)."""
        names = names or {}
        limit = self.max_model_len
        what, max_tokens_name = names.get("prompt", "prompt"), names.get("max_tokens", "max_tokens")
        requested = params.max_tokens
        if num_prompt_tokens >= limit:
            if requested:
                detail = (f"However, you requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} "
                          f"in the {what}, {requested} in the completion).")
            else:
                detail = (f"However, your {what} has {num_prompt_tokens} tokens, which leaves no room for any "
                          "output token.")
            raise InvalidParameterError(f"This model's maximum context length is {limit} tokens. {detail} "
                                        f"Please reduce the length of the {what}.", what)
        room = limit - num_prompt_tokens
        if requested is None:
            return room
        if requested > room:
            raise InvalidParameterError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {what}, {requested} in the "
                f"completion): {max_tokens_name}={requested} is too large. Please reduce the length of the {what} "
                f"or of the completion ({max_tokens_name} <= {room}).", max_tokens_name)
        return requested

    def check_priority(self, priority: int) -> None:
        """A request's priority: an integer; non-zero only under the priority policy (vLLM's wording)."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidParameterError(f"priority must be an integer, got {priority!r}.", "priority")
        if priority != 0 and self.scheduler_config.scheduling_policy != "priority":
            raise InvalidParameterError(f"Got priority {priority} but Priority scheduling is not enabled.",
                                        "priority")

    def embedding_only_message(self, api: str = "generation") -> str:
        return (f"The model does not support {api}: {self.model_name} is an embedding model (a "
                f"{self.arch.architecture} checkpoint, without a language-model head). Use /v1/embeddings "
                "(LLM.embed).")

    def check_embedding_length(self, num_prompt_tokens: int, param: str = "input") -> None:
        """An embedding's input may fill the context (no token follows it)."""
        if num_prompt_tokens > self.max_model_len:
            raise InvalidParameterError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens} tokens in the input for embedding generation. Please reduce the length "
                "of the input.", param)

    def pooling_sampling_params(self, pooling: PoolingParams) -> SamplingParams:
        """The engine-side form of an embedding request: a prompt prefilled, pooled, and never decoded."""
        resolved = pooling.resolved(self.model_config.pooler_config, self.arch.hidden_size)
        return SamplingParams(max_tokens=0, temperature=0.0, pooling=resolved)
