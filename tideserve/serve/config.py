"""Validated settings of the HTTP server (everything that is not an engine setting).

Kept apart from the engine's configs so the server can be built around an already-running engine
(tests share one loaded model between several servers with different settings).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from tideserve.config import parse_size
from tideserve.serve.openai.reasoning_parsers import REASONING_PARSERS
from tideserve.serve.openai.tool_parsers import TOOL_PARSERS
from tideserve.settings import setting, settings_fields
from tideserve.tokenizer.chat_template import load_chat_template

API_KEY_ENV = "TIDESERVE_API_KEY"
SERVER_GROUP = "server"
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def api_keys_from(cli_keys: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """Keys from ``--api-key`` (repeatable) or, when none is given, the TIDESERVE_API_KEY variable."""
    if cli_keys:
        return tuple(cli_keys)
    env = os.environ.get(API_KEY_ENV, "")
    return (env,) if env else ()


def _byte_size(text: str) -> int:
    """--max-body-size: '4GiB', '512MiB', '2GB' or a plain byte count."""
    try:
        return int(parse_size(text, "size"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass
class ServerConfig:
    """The server's settings; each declared with ``setting`` is a ``tideserve serve`` flag (in this
    order, in the "server" group), its help written here."""

    host: str = setting("127.0.0.1", group=SERVER_GROUP,
                        help="address to listen on (0.0.0.0: every interface, as in a container)")
    port: int = setting(8000, group=SERVER_GROUP, help="TCP port")
    served_model_name: str | None = setting(  # None: the name derived from the model file
        None, group=SERVER_GROUP, help="name(s) clients use, comma-separated (default: derived from the model file)")
    api_keys: tuple[str, ...] = setting(  # empty: no authentication
        (), group=SERVER_GROUP, name="api_key", action="append", unset=True, convert=api_keys_from,
        help=f"require 'Authorization: Bearer KEY' (repeatable; default: ${API_KEY_ENV})")
    rate_limit: int | None = setting(  # per API key (or per client address)
        None, group=SERVER_GROUP, help="requests per minute per API key")
    max_queue: int | None = setting(None, group=SERVER_GROUP, help="waiting requests beyond which new ones get 429")
    max_body_bytes: int = setting(16 * 2**20, group=SERVER_GROUP, name="max_body_size", type=_byte_size,
                                  help="largest request body, e.g. 16MiB")
    shutdown_timeout: float = setting(30.0, group=SERVER_GROUP, help="seconds SIGTERM waits for in-flight requests")
    # An engine step running longer than this turns /health to 503 (0: never). A CPU step of a full token
    # budget takes seconds on a small model and tens of seconds on a 7-8B float model on few cores (and the
    # first steps also compile kernels), so the default sits well above that: vLLM's
    # VLLM_ENGINE_ITERATION_TIMEOUT_S is 60 s too.
    engine_stall_timeout: float = setting(
        60.0, group=SERVER_GROUP, metavar="SECONDS",
        help="an engine step running longer than this turns /health to 503 (0: never; default {default:g}, well "
             "above a full-budget CPU step of a 7-8B model)")
    log_prompts: bool = setting(False, group=SERVER_GROUP, help="log prompt text (off: only token counts)")
    # --chat-template: a Jinja string or the path of a file holding one; replaces the model's template for
    # chat completions and /tokenize (a request's own chat_template still wins). Held as the template text.
    chat_template: str | None = setting(
        None, group=SERVER_GROUP,
        help="a Jinja chat template, or the path of a file holding one, used instead of the model's (a request's "
             "chat_template field still wins)")
    # GET /tokenizer_info: lm-evaluation-harness finds it (with /tokenize) and then tokenizes through the
    # server, so a GGUF model needs no Hugging Face tokenizer on the client's side. vLLM serves it only with
    # this flag; here it is on, since it tells nothing a client cannot already learn from /tokenize.
    enable_tokenizer_info_endpoint: bool = setting(
        True, group=SERVER_GROUP,
        help="serve GET /tokenizer_info (special tokens, chat template, context length), through which "
             "lm-evaluation-harness tokenizes remotely")
    disable_log_stats: bool = setting(False, group=SERVER_GROUP, help="no periodic throughput/KV-usage log lines")
    uvicorn_log_level: str = setting(
        "warning", group=SERVER_GROUP, choices=UVICORN_LOG_LEVELS,
        help="the HTTP server's own log level (access lines are tideserve's)")
    # Tool calling: "auto" tool choice parses the model's own call format with this parser (vLLM's flags).
    enable_auto_tool_choice: bool = setting(
        False, group=SERVER_GROUP,
        help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser')
    tool_call_parser: str | None = setting(
        None, group=SERVER_GROUP, choices=tuple(sorted(TOOL_PARSERS)),
        help="the model's tool-call format: hermes (Hermes, Qwen2.5), llama3_json (Llama 3.x), mistral")
    # Reasoning models: the thinking section comes back as reasoning_content, apart from the answer, and
    # structured output constrains only the answer (vLLM's flag and parser names).
    reasoning_parser: str | None = setting(
        None, group=SERVER_GROUP, choices=tuple(sorted(REASONING_PARSERS)),
        help="split the model's thinking section into reasoning_content: deepseek_r1 (DeepSeek-R1, QwQ; the "
             "prompt may open the section), qwen3 (Qwen3; thinking is optional and opens the output)")
    # Samples per prompt this server accepts (at most the engine's cap, input_processor.MAX_N). Not a flag.
    max_n: int = 128

    def __post_init__(self) -> None:
        self.api_keys = tuple(k for k in self.api_keys if k)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}.")
        for name in ("rate_limit", "max_queue"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 (or unset), got {value!r}.")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes!r}.")
        if not self.engine_stall_timeout >= 0:
            raise ValueError(f"engine_stall_timeout must be >= 0 seconds (0: off), got {self.engine_stall_timeout!r}.")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout!r}.")
        self.chat_template = load_chat_template(self.chat_template)
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}.")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(sorted(REASONING_PARSERS))}, "
                             f"got {self.reasoning_parser!r}.")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice (--enable-auto-tool-choice) requires tool_call_parser "
                             f"(--tool-call-parser {{{','.join(TOOL_PARSERS)}}}) to be set.")


SERVER_SETTINGS = tuple(settings_fields(ServerConfig))
