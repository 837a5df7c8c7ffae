"""Request bodies of the OpenAI-compatible API, as pydantic models.

Fields follow OpenAI's API plus vLLM's extras (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ...), so clients written for either work unchanged. Unknown fields are accepted
(``extra="allow"``) and reported once by the server, as vLLM does: clients often send fields a server
does not know, and refusing them would break those clients. Ranges are checked by ``SamplingParams``
(one set of messages for the offline API and the server); only types are checked here.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# torch's generators take seeds in [-2**63, 2**64); per-sample seeds are seed + index.
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1
# What the chat template accepts (tokenizer.normalize_messages checks it, with messages naming the fault).
# Only documented in /openapi.json, for clients' generators and the schema fuzzer; validation stays there.
_MESSAGES_SCHEMA = {"minItems": 1, "items": {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"enum": ["system", "user", "assistant", "tool"]},
                   "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {
                       "type": "object", "required": ["type", "text"],
                       "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}}}}


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or ())


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by chat and text completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = Field(default=None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as vLLM does
    logit_bias: dict[str, float] | None = None  # accepted only when empty: not supported
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]] = Field(json_schema_extra=_MESSAGES_SCHEMA)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class CompletionRequest(SamplingRequest):
    # Text, a batch of texts, token ids, or a batch of token-id lists (lm-eval sends the latter).
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None  # not supported: refused when set
    prompt_logprobs: int | None = None


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
