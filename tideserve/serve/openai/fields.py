"""What the server does with every request field OpenAI or vLLM documents: no field is silently ignored.

Each field of ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` and ``/v1/embeddings`` is in
exactly one class:
- honoured: it changes the result as documented (structured output and tool calling included);
- refused when set: a 400 "X is not supported: why", naming the field (``REFUSED``; the default value,
  and values that ask for nothing, pass);
- accepted and ignored, because it cannot change the result (``IGNORED``, with the reason).
Fields in neither OpenAI's nor vLLM's API are unknown: accepted, with one warning per field name for the
life of the server, as vLLM does. docs/api.md shows these tables; tests/serve/test_fields.py checks that
every declared field is in exactly one class and that the docs list each with its class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tideserve.serve.openai.errors import bad_request


@dataclass(frozen=True)
class Refusal:
    why: str
    accepts: Callable[[Any], bool] = lambda value: not value  # values that ask for nothing


@dataclass(frozen=True)
class EndpointFields:
    honoured: dict[str, str]  # field -> what it does
    refused: dict[str, Refusal]
    ignored: dict[str, str]  # field -> why it cannot change the result

    def classes(self) -> dict[str, dict]:
        return {"honoured": self.honoured, "refused when set": self.refused, "accepted, ignored": self.ignored}


def _is_none(value: Any) -> bool:
    return value is None


_SHARED_HONOURED = {
    "model": "must be a served model name (404 otherwise); may be omitted",
    "n": "parallel samples (at most 128 per prompt)",
    "best_of": "generates best_of samples and returns the n with the highest cumulative logprob; usage "
               "counts every sample's tokens; refused with stream when best_of > n",
    "temperature": "sampling temperature; 0 is greedy",
    "top_p": "nucleus sampling",
    "top_k": "top-k sampling (0 or -1: off)",
    "min_p": "min-p sampling",
    "presence_penalty": "OpenAI's presence penalty",
    "frequency_penalty": "OpenAI's frequency penalty",
    "repetition_penalty": "vLLM's multiplicative repetition penalty (prompt and output tokens)",
    "seed": "per-request random generator: the same seed gives the same tokens whatever the batch",
    "stop": "stop strings (never sent to the client unless include_stop_str_in_output)",
    "stop_token_ids": "stop tokens",
    "include_stop_str_in_output": "keep the stop string in the text",
    "ignore_eos": "generate past EOS (benchmarks)",
    "min_tokens": "EOS and stop tokens are masked until this many tokens exist",
    "skip_special_tokens": "drop special tokens from the text",
    "stream": "server-sent events",
    "stream_options": "include_usage (a final usage chunk) and continuous_usage_stats (usage in every chunk)",
    "logit_bias": "token id (string) -> bias in [-100, 100], added to the logits before sampling",
    "allowed_token_ids": "only these tokens may be sampled",
    "bad_words": "these words never appear in the output (their last token is banned after the others)",
    "priority": "lower is served first under --scheduling-policy priority (and may preempt); non-zero is "
                "refused under fcfs, as vLLM does",
    "truncate_prompt_tokens": "keep only the last N prompt tokens (-1: max_model_len), instead of a 400",
    "truncation_side": "left (default: keep the last tokens) or right (keep the first ones)",
    "return_tokens_as_token_ids": "logprob tokens are written 'token_id:N' (for tokens that are not valid "
                                  "UTF-8 alone)",
    "return_token_ids": "choices carry token_ids and prompt_token_ids",
    "cache_salt": "prefix-cache entries are shared only between requests with the same salt",
    "request_id": "the request id (response id, logs) when no X-Request-Id header is sent",
    # Structured output (docs/structured-output.md): one constraint per request, enforced by a grammar.
    "response_format": "json_object (any JSON object) or json_schema (output matches json_schema.schema, its "
                       "objects closed unless they set additionalProperties, as OpenAI and vLLM's default "
                       "backend); text: no constraint; structural_tag is a 400",
    "structured_outputs": "vLLM's constraint object: exactly one of json, regex, choice, grammar (Lark or "
                          "GBNF) or json_object, plus disable_any_whitespace and disable_additional_properties",
    "guided_json": "older vLLM name for structured_outputs.json (a schema, or its JSON text)",
    "guided_regex": "older vLLM name for structured_outputs.regex",
    "guided_choice": "older vLLM name for structured_outputs.choice",
    "guided_grammar": "older vLLM name for structured_outputs.grammar",
}
_SHARED_REFUSED = {
    "use_beam_search": Refusal("beam search is not implemented; use n or best_of"),
    "logits_processors": Refusal("the server runs no user-supplied code; logit_bias, allowed_token_ids "
                                 "and bad_words cover the common cases"),
    "logprob_token_ids": Refusal("logprobs of chosen token ids are not implemented; use logprobs"),
    "kv_transfer_params": Refusal("there is no KV connector (disaggregated prefill) to transfer KV with"),
    "thinking_token_budget": Refusal("capping the thinking section is not implemented; use max_tokens",
                                     _is_none),
    "guided_whitespace_pattern": Refusal("JSON whitespace is compact by default; send structured_outputs "
                                         "with disable_any_whitespace false to let the model place it", _is_none),
    "structural_tag": Refusal("structural tags are not implemented; use response_format json_schema, "
                              "structured_outputs regex or grammar", _is_none),
}
_SHARED_IGNORED = {
    "user": "an end-user id for OpenAI's abuse monitoring; generation does not read it (vLLM ignores it too)",
    "spaces_between_special_tokens": "only Python (slow) tokenizers put spaces around special tokens; "
                                     "tideserve decodes with fast tokenizers, where the text is the same "
                                     "either way (as in transformers and vLLM's fast detokenizer)",
    "length_penalty": "scales beam-search scores only, and use_beam_search is refused",
    "vllm_xargs": "read only by custom logits processors and plugins, which this server does not load",
    "stream_interval": "how many tokens vLLM groups per streamed chunk; the streamed text is the same, "
                       "tideserve sends each step's tokens (coalesced for a slow reader)",
    "session_id": "a routing hint for session affinity in front of the engine; one engine has nothing "
                  "to route",
    "guided_decoding_backend": "one grammar engine (llguidance) serves every request; any backend enforces "
                               "the same constraint, so naming one changes nothing",
}
COMPLETION_FIELDS = EndpointFields(
    honoured={
        **_SHARED_HONOURED,
        "prompt": "text, a batch of texts, token ids or a batch of token-id lists",
        "max_tokens": "default 16, as OpenAI",
        "logprobs": "top-N logprobs per token (capped by --max-logprobs)",
        "echo": "prepend the prompt (and its logprobs with logprobs set)",
        "prompt_logprobs": "each choice carries prompt_logprobs (vLLM's shape)",
        "add_special_tokens": "add the tokenizer's special tokens (BOS) to a text prompt (default true)",
    },
    refused={
        **_SHARED_REFUSED,
        "suffix": Refusal("insertion (fill in the middle) needs a model and template made for it"),
        "prompt_embeds": Refusal("prompts are text or token ids; embedding inputs are not implemented",
                                 _is_none),
    },
    ignored=dict(_SHARED_IGNORED),
)

CHAT_FIELDS = EndpointFields(
    honoured={
        **_SHARED_HONOURED,
        "messages": "system, user, assistant and tool messages; text content (string or text parts)",
        "max_tokens": "deprecated by OpenAI; max_completion_tokens wins when both are set",
        "max_completion_tokens": "output token limit (default: what the context leaves)",
        "logprobs": "true: the sampled token's logprob",
        "top_logprobs": "alternatives per token with logprobs true (capped by --max-logprobs)",
        "add_generation_prompt": "end the prompt with the assistant turn's header (default true)",
        "continue_final_message": "continue the last (assistant) message instead of starting a new one; "
                                  "add_generation_prompt must then be false",
        "chat_template": "a Jinja template for this request (overrides --chat-template and the model's)",
        "chat_template_kwargs": "extra template variables (e.g. enable_thinking)",
        "documents": "passed to templates that read documents (RAG); refused by one that does not",
        "reasoning_effort": "passed to templates that read reasoning_effort; refused by one that does not",
        "echo": "prepend the last message's content when it is the assistant's (as vLLM)",
        "add_special_tokens": "true/false: encode the rendered prompt with/without the tokenizer's special "
                              "tokens; unset: exactly one BOS",
        "prompt_logprobs": "the response carries prompt_logprobs (vLLM's shape)",
        # Tool calling (docs/structured-output.md)
        "tools": "function tools, passed to the chat template as tools (the model's own format)",
        "tool_choice": "none, auto (needs --enable-auto-tool-choice --tool-call-parser; else a 400, as "
                       "vLLM), required or a named function (both forced by a grammar); default auto with "
                       "tools, else none",
        "parallel_tool_calls": "false: at most one call per choice (required: the grammar allows one)",
        # Reasoning output (--reasoning-parser)
        "include_reasoning": "with --reasoning-parser, false leaves reasoning_content out of the response "
                             "(without a parser false is a 400: the reasoning stays in the content)",
    },
    refused={
        **_SHARED_REFUSED,
        "modalities": Refusal("only text output is produced", lambda v: v is None or list(v) == ["text"]),
        "audio": Refusal("there is no audio output", _is_none),
        "verbosity": Refusal("a control of OpenAI's GPT-5 models; this model has none", _is_none),
        "web_search_options": Refusal("there is no web search tool", _is_none),
        "functions": Refusal("deprecated by OpenAI in favour of tools"),
        "function_call": Refusal("deprecated by OpenAI in favour of tool_choice", _is_none),
    },
    ignored={
        **_SHARED_IGNORED,
        "metadata": "tags for OpenAI's stored-completions dashboard; nothing is stored here",
        "store": "asks OpenAI to keep the completion for its dashboard and evals; the response is the "
                 "same, nothing is kept (there is no retrieval endpoint)",
        "service_tier": "OpenAI's processing tier (latency and price); one tier here, same output",
        "prediction": "predicted outputs only speed up OpenAI's decoding; the output is the same",
        "prompt_cache_key": "OpenAI's cache routing hint; prefix caching here is automatic and never "
                            "changes the output",
        "safety_identifier": "like user: an end-user id for abuse monitoring",
        "mm_processor_kwargs": "options of a multimodal processor; only text content is accepted (image "
                               "and audio parts are refused), so nothing is processed",
        "media_io_kwargs": "options for loading media; only text content is accepted",
    },
)


RESPONSES_FIELDS = EndpointFields(
    honoured={
        "model": _SHARED_HONOURED["model"],
        "input": "a text (one user message) or input items: messages (system, developer, user, assistant; "
                 "text content), function_call and function_call_output items",
        "instructions": "a system message before the input",
        "max_output_tokens": "output token limit (default: what the context leaves); reaching it makes the "
                             "response incomplete (incomplete_details.reason max_output_tokens)",
        "temperature": _SHARED_HONOURED["temperature"],
        "top_p": _SHARED_HONOURED["top_p"],
        "stream": "server-sent events: response.created, output items and their text or arguments deltas, "
                  "response.completed (or response.incomplete)",
        "tools": "function tools ({type, name, description, parameters}), as chat completions' tools; "
                 "OpenAI's hosted tools (web search, file search, ...) are a 400",
        "tool_choice": "as chat completions' (auto needs --enable-auto-tool-choice --tool-call-parser); "
                       "a named function is {type: function, name}",
        "parallel_tool_calls": "false: at most one call (required: the grammar allows one)",
        "text": "format: text, json_object, or json_schema (name, schema): output constrained as "
                "chat's response_format (objects closed unless they set additionalProperties)",
        "metadata": "returned in the response object as given",
        "include": "message.output_text.logprobs: each output_text part (and stream delta) carries its tokens' "
                   "logprobs; other values (hosted tools' and reasoning outputs, images) are a 400",
        "top_logprobs": "alternatives per token with their logprobs (capped by --max-logprobs); implies "
                        "message.output_text.logprobs",
        "seed": _SHARED_HONOURED["seed"],
        "top_k": _SHARED_HONOURED["top_k"],
        "min_p": _SHARED_HONOURED["min_p"],
        "repetition_penalty": _SHARED_HONOURED["repetition_penalty"],
        "stop": _SHARED_HONOURED["stop"],
        "ignore_eos": _SHARED_HONOURED["ignore_eos"],
        "priority": _SHARED_HONOURED["priority"],
        "cache_salt": _SHARED_HONOURED["cache_salt"],
        "request_id": "the request id (the response id is resp_ID) when no X-Request-Id header is sent",
    },
    refused={
        "previous_response_id": Refusal("responses are not stored; send the earlier turns in input",
                                        _is_none),
        "conversation": Refusal("conversations are not stored; send the earlier turns in input", _is_none),
        "background": Refusal("responses are not stored, so there is nothing to poll later; stream instead"),
        "prompt": Refusal("stored prompt templates live on OpenAI's platform; send instructions and input",
                          _is_none),
        "reasoning": Refusal("reasoning controls (effort, summaries) are not implemented; with "
                             "--reasoning-parser the thinking comes back as a reasoning item",
                             lambda v: not v or all(x is None for x in v.values())),
        "truncation": Refusal("the input is never cut: an input longer than the context gets a 400",
                              lambda v: v in (None, "disabled")),
    },
    ignored={
        "user": _SHARED_IGNORED["user"],
        "safety_identifier": "like user: an end-user id for abuse monitoring",
        "store": "asks OpenAI to keep the response for later retrieval; the response is the same, nothing is "
                 "kept (GET /v1/responses/ID answers 404)",
        "service_tier": "OpenAI's processing tier (latency and price); one tier here, same output",
        "prompt_cache_key": "OpenAI's cache routing hint; prefix caching here is automatic and never changes "
                            "the output",
        "stream_options": "include_obfuscation pads OpenAI's stream events against side channels; the "
                          "events' content is the same",
        "max_tool_calls": "caps calls to hosted tools, which this server has none of",
    },
)


EMBEDDING_FIELDS = EndpointFields(
    honoured={
        "model": _SHARED_HONOURED["model"],
        "input": "text, a batch of texts (up to 2,048), token ids or a batch of token-id lists; each becomes "
                 "one embedding, in order",
        "encoding_format": "float (a list of numbers) or base64 (little-endian float32 bytes, what the openai "
                           "SDK asks for by default and decodes)",
        "dimensions": "accepted when it equals the model's hidden size; any other value is a 400 (the model "
                      "is not a matryoshka model, so its embeddings cannot be shortened)",
        "truncate_prompt_tokens": "keep each input's last N tokens (-1: max_model_len); without it an input "
                                  "longer than the context is a 400",
        "truncation_side": "left (default): truncate_prompt_tokens keeps the last N tokens; right: the first N",
        "add_special_tokens": "add the tokenizer's special tokens (BOS) to a text input (default true); with "
                              "messages, unset means what the chat template adds (exactly one BOS)",
        "messages": "in place of input: one conversation (the chat endpoint's messages), rendered by the chat "
                    "template and embedded as one input (vLLM's chat embedding form)",
        "add_generation_prompt": "with messages: end the rendered conversation with the assistant's turn "
                                 "header (default false: the conversation as it stands)",
        "continue_final_message": CHAT_FIELDS.honoured["continue_final_message"],
        "chat_template": CHAT_FIELDS.honoured["chat_template"],
        "chat_template_kwargs": CHAT_FIELDS.honoured["chat_template_kwargs"],
        "documents": CHAT_FIELDS.honoured["documents"],
        "normalize": "scale the vector to unit length (default: --pooler-config's, true)",
        "priority": _SHARED_HONOURED["priority"],
        "cache_salt": _SHARED_HONOURED["cache_salt"],
        "request_id": "the request id (the response id is embd-ID) when no X-Request-Id header is sent",
    },
    refused={},
    ignored={
        "user": "an end-user id for OpenAI's abuse monitoring; the embedding does not depend on it",
    },
)


def refuse_unsupported(req: Any, fields: EndpointFields) -> None:
    """400 for the first refused field the request sets: "X is not supported: why."."""
    for name, refusal in fields.refused.items():
        if not refusal.accepts(getattr(req, name, None)):
            raise bad_request(f"{name} is not supported: {refusal.why}.", name)
