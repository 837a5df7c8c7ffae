"""Request bodies of the OpenAI-compatible API, as pydantic models.

Fields follow OpenAI's API plus vLLM's extras (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ...), so clients written for either work unchanged. Every field declared here is
honoured, refused when set, or accepted and ignored because it cannot change the result: which one, and
why, is in ``fields.py`` (and docs/api.md), and a test keeps the two in step. Unknown fields are accepted
(``extra="allow"``) and reported once by the server, as vLLM does: clients often send fields a server
does not know, and refusing them would break those clients. Ranges are checked by ``SamplingParams``
(one set of messages for the offline API and the server); only types are checked here.
"""

from __future__ import annotations

from typing import Any, Literal

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
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: int = 0
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    spaces_between_special_tokens: bool = True
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    cache_salt: str | None = None
    request_id: str | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    logits_processors: list[Any] | None = None
    logprob_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    stream_interval: int | None = None
    session_id: str | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs, and the guided_* fields
    # of older vLLM releases that many clients still send.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted: one grammar engine serves every request
    guided_whitespace_pattern: str | None = None  # refused when set (see fields.py)
    structural_tag: str | dict[str, Any] | None = None  # refused when set (see fields.py)


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


class ChatTemplateOptions(OpenAIBaseModel):
    """vLLM's chat template controls, for chat completions and /tokenize with messages."""

    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None


class ChatExtras(ChatTemplateOptions):
    """Chat fields beyond the sampling ones: OpenAI's newer ones and vLLM's."""

    # OpenAI's
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    # vLLM's
    echo: bool = False
    add_special_tokens: bool | None = None  # None: exactly one BOS (see Tokenizer.encode_chat)
    prompt_logprobs: int | None = None
    include_reasoning: bool = True
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingRequest, ChatExtras):
    messages: list[dict[str, Any]] = Field(json_schema_extra=_MESSAGES_SCHEMA)
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
    add_special_tokens: bool = True
    prompt_embeds: str | list[str] | None = None


class ResponsesTool(OpenAIBaseModel):
    """A Responses API tool: a function is flat (``name``, ``parameters`` beside ``type``); other types
    (OpenAI's hosted tools) are refused by name."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    name: str


class ResponsesTextFormat(OpenAIBaseModel):
    """``text.format``: the Responses API's response_format, with the json_schema fields inline."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesText(OpenAIBaseModel):
    format: ResponsesTextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(OpenAIBaseModel):
    """``POST /v1/responses``: OpenAI's Responses API (one turn, nothing stored) plus vLLM's sampling extras."""

    model: str | None = None
    # A text, or input items: messages ({"role", "content"}), function_call and function_call_output items.
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedTool | None = None
    parallel_tool_calls: bool | None = True
    text: ResponsesText | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    # vLLM's extras
    seed: int | None = Field(default=None, ge=_SEED_MIN, le=_SEED_MAX)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None


def _one_of_input_and_messages(schema: dict[str, Any]) -> None:
    """The published schema says what the server checks: exactly one of the two, never null (clients and the
    schema fuzzer then build requests that can succeed)."""
    for name in ("input", "messages"):
        prop = schema["properties"][name]
        prop["anyOf"] = [option for option in prop.get("anyOf", []) if option.get("type") != "null"]
        prop.pop("default", None)
    schema["oneOf"] = [{"required": ["input"]}, {"required": ["messages"]}]


class EmbeddingRequest(ChatTemplateOptions):
    """``POST /v1/embeddings``: OpenAI's request plus vLLM's extras (truncation, normalization, priority, and a
    conversation in ``messages`` in place of ``input``, rendered by the chat template)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_one_of_input_and_messages)
    model: str | None = None
    # Text, a batch of texts, token ids, or a batch of token-id lists (OpenAI's four forms); or None with messages.
    input: str | list[str] | list[int] | list[list[int]] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] = "left"
    add_special_tokens: bool = True
    normalize: bool | None = None
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None
    # vLLM's chat-embedding form: one conversation, one embedding. No generation prompt by default (the text
    # embedded is the conversation itself), as vLLM.
    messages: list[dict[str, Any]] | None = Field(None, json_schema_extra=_MESSAGES_SCHEMA)
    add_generation_prompt: bool = False


class TokenizeRequest(ChatTemplateOptions):
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
