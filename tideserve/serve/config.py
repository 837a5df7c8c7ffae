"""Validated settings of the HTTP server (everything that is not an engine setting).

Kept apart from the engine's configs so the server can be built around an already-running engine
(tests share one loaded model between several servers with different settings).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tideserve.tokenizer.chat_template import load_chat_template

API_KEY_ENV = "TIDESERVE_API_KEY"


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None: the name derived from the model file
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    rate_limit: int | None = None  # requests per minute per API key (or per client address)
    max_queue: int | None = None  # waiting requests beyond which new ones get 429
    max_logprobs: int = 20
    max_n: int = 128  # samples per prompt; guards against a request that would never finish
    log_prompts: bool = False
    max_body_bytes: int = 16 * 2**20
    shutdown_timeout: float = 30.0  # seconds SIGTERM waits for in-flight requests
    # An engine step running longer than this turns /health to 503 (0: never). A CPU step of a full token
    # budget takes seconds on a small model and tens of seconds on a 7-8B float model on few cores (and the
    # first steps also compile kernels), so the default sits well above that: vLLM's
    # VLLM_ENGINE_ITERATION_TIMEOUT_S is 60 s too.
    engine_stall_timeout: float = 60.0
    uvicorn_log_level: str = "warning"
    # --chat-template: a Jinja string or the path of a file holding one; replaces the model's template for
    # chat completions and /tokenize (a request's own chat_template still wins). Held as the template text.
    chat_template: str | None = None
    # Tool calling: "auto" tool choice parses the model's own call format with this parser (vLLM's flags).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # hermes, llama3_json or mistral

    def __post_init__(self) -> None:
        self.api_keys = tuple(k for k in self.api_keys if k)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}.")
        for name in ("rate_limit", "max_queue"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 (or unset), got {value!r}.")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}.")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes!r}.")
        if not self.engine_stall_timeout >= 0:
            raise ValueError(f"engine_stall_timeout must be >= 0 seconds (0: off), got {self.engine_stall_timeout!r}.")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout!r}.")
        self.chat_template = load_chat_template(self.chat_template)
        from tideserve.serve.openai.tool_parsers import TOOL_PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}.")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice (--enable-auto-tool-choice) requires tool_call_parser "
                             f"(--tool-call-parser {{{','.join(TOOL_PARSERS)}}}) to be set.")


def api_keys_from(cli_keys: list[str] | None) -> tuple[str, ...]:
    """Keys from ``--api-key`` (repeatable) or, when none is given, the TIDESERVE_API_KEY variable."""
    if cli_keys:
        return tuple(cli_keys)
    env = os.environ.get(API_KEY_ENV, "")
    return (env,) if env else ()
