"""Request bodies of the OpenAI-compatible API, as pydantic models.

Fields follow OpenAI's API plus vLLM's extras (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ...), so clients written for either work unchanged. Unknown fields are accepted
(``extra="allow"``) and reported once by the server, as vLLM does: clients often send fields a server
does not know, and refusing them would break those clients. Ranges are checked by ``SamplingParams``
(one set of messages for the offline API and the server); only types are checked here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# torch's generators take seeds in [-2**63, 2**64); per-sample seeds are seed + index.
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or ())


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(OpenAIBaseModel):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` is accepted: the grammar always
    enforces the schema exactly)."""

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's per-request ``structured_outputs`` object; unknown keys are refused (a constraint that is
    silently dropped would be worse than an error)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = False
    disable_fallback: bool = False  # accepted: there is no fallback engine to disable


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
    # Structured output: OpenAI's response_format, vLLM's structured_outputs, and the guided_* fields
    # of older vLLM releases that many clients still send.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[ChatCompletionToolsParam] | None = None
    # None: "auto" when tools are given, else "none" (OpenAI's and vLLM's defaults)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True


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
    tools: list[ChatCompletionToolsParam] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
