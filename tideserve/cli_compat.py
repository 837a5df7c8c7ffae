"""vLLM's command-line flags that mean nothing in tideserve, and helpful errors for flags nobody knows.

Scripts written for ``vllm serve`` (and the articles users copy them from) carry flags tideserve has no
use for. Each one listed here is accepted with a one-line warning when ignoring it cannot change any
result (only logs, speed or where files go), and refused with the reason when it would (another
tokenizer, TLS, CORS). Flags that neither tideserve nor this table knows still fail, naming the closest
flags that exist; dashes that word processors substitute for ``--`` are repaired with a warning.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Harmless = Callable[[str, argparse.Namespace], bool]


@dataclass(frozen=True)
class ForeignFlag:
    """Flags of vLLM (or of the seeds' articles) that tideserve accepts only to explain them; several
    names share the reason, each is its own flag.

    ``harmless`` decides, for a flag that takes a value, which values are ignored with a warning (the
    others are refused); ``refuse`` refuses the flag whatever its value."""

    flags: tuple[str, ...]
    reason: str
    takes_value: bool = False
    harmless: Harmless | None = None
    refuse: bool = False


def _dest(name: str) -> str:
    return "foreign_" + name.lstrip("-").replace("-", "_")


def _one_of(*values: str) -> Harmless:
    return lambda value, ns: value.lower() in values


def _same_as_model(value: str, ns: argparse.Namespace) -> bool:
    return value == (getattr(ns, "model_tag", None) or getattr(ns, "model", None))


ENGINE_FLAGS = (
    ForeignFlag(("--trust-remote-code",), "its model architectures are built in; no code from a model "
                "repository ever runs"),
    ForeignFlag(("--enable-mrv2",), "there is one model runner, and the KV cache pool already sizes itself "
                "from measurement and grows and shrinks with load (the elastic pool, on by default)"),
    ForeignFlag(("--use-v2-block-manager",), "the KV cache is always paged by one block manager (vLLM "
                "removed this flag too)"),
    ForeignFlag(("--enable-dynamic-batching", "--use-contiguous-batching"), "continuous batching is always "
                "on (neither is a vLLM flag either)"),
    ForeignFlag(("--max-paddings",), "batches are flat, without padding", takes_value=True),
    ForeignFlag(("--max-seq-len-to-capture",),
                "CUDA graphs cover every context up to max_model_len (see --enforce-eager)", takes_value=True),
    ForeignFlag(("--disable-custom-all-reduce",), "one engine runs on one device, with no all-reduce"),
    ForeignFlag(("--worker-use-ray",), "one engine runs in one process"),
    ForeignFlag(("--distributed-executor-backend",), "one engine runs in one process", takes_value=True),
    ForeignFlag(("--max-parallel-loading-workers",), "the weights load in one pass", takes_value=True),
    ForeignFlag(("--download-dir",), "hub models are fetched into the Hugging Face cache (set HF_HOME or "
                "HF_HUB_CACHE to move it)", takes_value=True),
    ForeignFlag(("--num-scheduler-steps",), "the scheduler runs once per model step", takes_value=True),
    ForeignFlag(("--async-scheduling",), "the engine already steps in its own thread, apart from the HTTP "
                "server"),
    ForeignFlag(("--max-num-partial-prefills", "--long-prefill-token-threshold"), "chunked prefill shares "
                "one token budget per step (--max-num-batched-tokens)", takes_value=True),
    ForeignFlag(("--speculative-model", "--num-speculative-tokens"), "vLLM's older spelling: use "
                "--speculative-config '{\"model\": PATH, \"num_speculative_tokens\": 4}' (a draft model) or "
                "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'", takes_value=True),
    ForeignFlag(("--tokenizer-mode",), "the model's fast tokenizer is always used", takes_value=True,
                harmless=_one_of("auto", "hf")),
    ForeignFlag(("--load-format",), "the weights are read from the model's GGUF or safetensors files as "
                "they are", takes_value=True, harmless=_one_of("auto", "safetensors", "gguf")),
    ForeignFlag(("--tokenizer",), "the tokenizer always comes with the model (its GGUF metadata or its "
                "directory's tokenizer files)", takes_value=True, harmless=_same_as_model),
    ForeignFlag(("--revision", "--tokenizer-revision", "--code-revision"), "a hub id is fetched at its "
                "default revision; download the revision you want and pass its local directory as the model",
                takes_value=True, refuse=True),
    ForeignFlag(("--enable-lora", "--lora-modules"), "LoRA adapters are not implemented; merge the adapter "
                "into the weights and serve the merged model", takes_value=True, refuse=True),
)

SERVER_FLAGS = (
    ForeignFlag(("--disable-log-requests",), "request contents are never logged unless --log-prompts is "
                "given; each request gets one access-log line without its text"),
    ForeignFlag(("--enable-log-requests",), "each request gets one access-log line; --log-prompts adds the "
                "prompts' text"),
    ForeignFlag(("--max-log-len",), "prompts are logged only with --log-prompts", takes_value=True),
    ForeignFlag(("--disable-frontend-multiprocessing",), "the HTTP server and the engine share one process"),
    ForeignFlag(("--disable-fastapi-docs",), "the API docs stay at /docs (they reveal nothing the API "
                "itself does not)"),
    ForeignFlag(("--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs"), "tideserve serves plain HTTP; "
                "terminate TLS in a reverse proxy (nginx, envoy, a cloud load balancer) in front of it",
                takes_value=True, refuse=True),
    ForeignFlag(("--root-path",), "routes are served at /; strip the prefix in the reverse proxy",
                takes_value=True, refuse=True),
    ForeignFlag(("--allowed-origins", "--allowed-methods", "--allowed-headers"), "no CORS headers are sent; "
                "add them in a reverse proxy", takes_value=True, refuse=True),
    ForeignFlag(("--allow-credentials",), "no CORS headers are sent; add them in a reverse proxy",
                refuse=True),
    ForeignFlag(("--response-role",), "replies always have the role 'assistant'", takes_value=True,
                harmless=_one_of("assistant")),
)


def add_foreign_flags(parser: argparse.ArgumentParser, table: Sequence[ForeignFlag], title: str) -> None:
    """Register ``table``'s flags on ``parser`` in a help group of their own."""
    group = parser.add_argument_group(title)
    for flag in table:
        kind = "refused" if flag.refuse else ("refused unless harmless" if flag.harmless else "no effect")
        for name in flag.flags:
            common = {"dest": _dest(name), "default": None, "help": f"vLLM flag, {kind}: {flag.reason}"}
            if flag.takes_value:
                group.add_argument(name, metavar="VALUE", **common)
            else:
                group.add_argument(name, action="store_const", const="", **common)


def foreign_flag_messages(ns: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(warnings, errors) for the foreign flags given in ``ns``, one per flag."""
    warnings: list[str] = []
    errors: list[str] = []
    for flag in (*ENGINE_FLAGS, *SERVER_FLAGS):
        for name in flag.flags:
            value = getattr(ns, _dest(name), None)
            if value is None:
                continue
            if flag.refuse or (flag.harmless is not None and not flag.harmless(value, ns)):
                shown = f"{name} {value}" if flag.takes_value else name
                errors.append(f"{shown} is not supported by tideserve: {flag.reason}.")
            else:
                warnings.append(f"{name} has no effect in tideserve: {flag.reason}.")
    return warnings, errors


# Word processors turn "--" into an en dash, an em dash or a minus sign; articles are full of them.
_DASHES = ("\u2013", "\u2014", "\u2212", "\u2012", "\u2015")


def repair_dashes(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``argv`` with a leading typographic dash turned back into ``--``, and one warning per repair."""
    repaired: list[str] = []
    warnings: list[str] = []
    for token in argv:
        stripped = token.lstrip("".join(_DASHES))
        if stripped != token and stripped[:1].isalpha():
            fixed = "--" + stripped
            warnings.append(f"{token!r} starts with a typographic dash ({token[0]!r}) where '--' belongs; "
                            f"read as {fixed}.")
            token = fixed
        repaired.append(token)
    return repaired, warnings


def unknown_flag_messages(extras: Sequence[str], parser: argparse.ArgumentParser, command: str) -> list[str]:
    """One error per argument no parser took, with the closest flags ``parser`` knows."""
    known = sorted(s for action in parser._actions for s in action.option_strings
                   if s.startswith("--") and not action.dest.startswith("foreign_"))  # never suggest a no-op
    messages = []
    for token in extras:
        if not token.startswith("-"):
            messages.append(f"unexpected argument {token!r} (tideserve {command} takes one model at most; "
                            "flags start with --).")
            continue
        name = token.split("=", 1)[0]
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.75)
        hint = f"; did you mean {' or '.join(close)}?" if close else "."
        messages.append(f"unrecognized flag {name}: tideserve {command} has no such flag{hint} "
                        f"(tideserve {command} --help lists them all)")
    return messages
