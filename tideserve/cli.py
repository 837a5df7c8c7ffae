"""Command line: ``tideserve serve``, ``tideserve generate``, ``tideserve chat`` and ``tideserve bench``.

``vllm serve`` command lines work with ``vllm`` replaced: the model as a positional argument or
``--model``, vLLM's flag names and size units, global options before or after the subcommand, and
vLLM flags that mean nothing here explained (tideserve/cli_compat.py) instead of failing in argparse.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from tideserve import __version__
from tideserve.cli_compat import (
    SERVER_FLAGS,
    add_foreign_flags,
    foreign_flag_messages,
    repair_dashes,
    unknown_flag_messages,
)
from tideserve.cli_engine_args import add_engine_args, engine_kwargs
from tideserve.sampling_params import SamplingParams
from tideserve.settings import add_setting_arguments, build_config

logger = logging.getLogger("tideserve.cli")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def add_global_options(p: argparse.ArgumentParser, top: bool) -> None:
    """--log-level and --version, on the top parser and on every subcommand (``serve ... --log-level info``
    works as well as ``--log-level info serve ...``). A subcommand's copy defaults to SUPPRESS, so it does
    not overwrite a value given before the subcommand."""
    default = "INFO" if top else argparse.SUPPRESS
    p.add_argument("--log-level", default=default, type=str.upper, choices=LOG_LEVELS, metavar="LEVEL",
                   help=f"logging level: {', '.join(LOG_LEVELS)} (any case; default INFO)")
    p.add_argument("--version", action="version", version=__version__, help="print the version and exit")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--sample-seed", type=int, default=None)


def sampling_params(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                          max_tokens=ns.max_tokens, seed=ns.sample_seed)


def cmd_generate(ns: argparse.Namespace) -> int:
    from tideserve.engine.llm import LLM

    llm = LLM(**engine_kwargs(ns))
    prompts = ns.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    for out in llm.generate(prompts, sampling_params(ns)):
        print(out.outputs[0].text)
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    from tideserve.engine.llm import LLM

    llm = LLM(**engine_kwargs(ns))
    params = sampling_params(ns)
    history: list[dict] = []
    if ns.system:
        history.append({"role": "system", "content": ns.system})
    print("tideserve chat — empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        try:
            reply = llm.chat(history, params)[0].outputs[0].text
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            history.pop()
            continue
        print(reply)
        history.append({"role": "assistant", "content": reply})
    return 0


def add_bench_parsers(sub: argparse._SubParsersAction) -> None:
    """``tideserve bench serve | offline | plot``; the commands live in tideserve/bench/cli.py."""
    from tideserve.bench.cli import add_bench_subcommands

    add_bench_subcommands(sub)


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The model positional, the server's flags (generated from the settings declared on ServerConfig),
    then vLLM's server flags that mean nothing here."""
    from tideserve.serve.config import SERVER_SETTINGS

    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as vLLM takes it (`tideserve serve MODEL`); same as --model")
    add_setting_arguments(p, SERVER_SETTINGS)
    add_foreign_flags(p, SERVER_FLAGS, "vLLM server flags with no meaning here (a warning, or an error "
                                       "with the reason)")


def server_config(ns: argparse.Namespace):
    from tideserve.serve.config import SERVER_SETTINGS, ServerConfig

    return build_config(ServerConfig, SERVER_SETTINGS, ns)


def cmd_serve(ns: argparse.Namespace) -> int:
    from tideserve.engine.async_engine import AsyncEngine
    from tideserve.engine.llm_engine import EngineArgs
    from tideserve.serve.openai.server import run_server

    config = server_config(ns)
    args = EngineArgs(**engine_kwargs(ns))
    args.configs()  # validate engine flags before the server starts listening
    stats_interval = None if config.disable_log_stats else 5.0
    return run_server(config, lambda: AsyncEngine.from_engine_args(
        args, max_queue=config.max_queue, log_stats_interval=stats_interval))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tideserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate,chat,bench}")
    serve = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    add_server_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)
    gen = sub.add_parser("generate", help="generate completions for prompts (args or stdin lines)")
    gen.add_argument("--prompt", action="append", help="a prompt; repeat for a batch")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)
    add_bench_parsers(sub)
    for p, depth in _all_parsers(parser):
        add_global_options(p, top=depth == 0)
        p.set_defaults(_parser=p)  # the deepest parser a command line reaches: its flags name the typos
    return parser


def _all_parsers(parser: argparse.ArgumentParser, depth: int = 0):
    yield parser, depth
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                yield from _all_parsers(child, depth + 1)


@dataclass
class CommandLine:
    """A parsed command line: the namespace, warnings to log once logging is set up, and the errors that
    stop it (all of them at once, so one run shows everything to fix)."""

    ns: argparse.Namespace
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def parse_command_line(argv: Sequence[str] | None = None,
                       parser: argparse.ArgumentParser | None = None) -> CommandLine:
    """Parse and check ``argv`` without running anything: unknown flags, vLLM flags with no meaning here,
    the model given twice, and the engine settings (their ValueError), all collected."""
    parser = parser or build_parser()
    argv, warnings = repair_dashes(sys.argv[1:] if argv is None else argv)
    missing = _missing_subcommand(parser, argv)
    if missing:
        return CommandLine(argparse.Namespace(command=argv[0] if argv else None), warnings, [missing])
    ns, extras = parser.parse_known_args(argv)
    command = " ".join(c for c in (getattr(ns, "command", None), getattr(ns, "bench_command", None)) if c)
    extras = _reclaim_flag_values(ns, argv, extras)
    cl = CommandLine(ns, warnings, unknown_flag_messages(extras, ns._parser, command))
    if not extras:
        _merge_model(cl)
    foreign_warnings, foreign_errors = foreign_flag_messages(ns)
    cl.warnings += foreign_warnings
    cl.errors += foreign_errors
    if getattr(ns, "_has_engine_args", False):
        from tideserve.engine.arg_utils import EngineArgs

        try:
            EngineArgs(**engine_kwargs(ns)).configs()
        except ValueError as exc:
            cl.errors.append(str(exc))
    return cl


def _reclaim_flag_values(ns: argparse.Namespace, argv: Sequence[str], extras: list[str]) -> list[str]:
    """The value of an unknown flag (``--max-num-sqs 256``) is left over too, or even taken as MODEL: drop
    it, so the error is about the flag alone."""
    unknown = {e for e in extras if e.startswith("-") and "=" not in e}
    values = {argv[i] for i in range(1, len(argv)) if argv[i - 1] in unknown and not argv[i].startswith("-")}
    tag = getattr(ns, "model_tag", None)
    if tag is not None and tag in values:
        ns.model_tag = None
    return [e for e in extras if e not in values]


def _missing_subcommand(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str | None:
    """``tideserve bench --model M`` (vLLM's seeds write it so): say which subcommands exist, instead of
    argparse's "invalid choice: 'M'"."""
    choices = _subcommands(parser)
    words = [t for t in argv if not t.startswith("-")]
    if not words or words[0] not in choices:
        return None
    child = choices[words[0]]
    nested = _subcommands(child)
    rest = list(argv[list(argv).index(words[0]) + 1:])
    if not nested or not rest or rest[0] in nested or rest[0] in ("-h", "--help", "--version"):
        return None
    names = ", ".join(nested)
    return (f"tideserve {words[0]} needs a subcommand before its flags: one of {names} "
            f"(e.g. tideserve {words[0]} {next(iter(nested))} {' '.join(rest[:2])} ...).")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _merge_model(cl: CommandLine) -> None:
    """``serve MODEL`` and ``serve --model MODEL`` mean the same; two different models are an error."""
    ns = cl.ns
    tag = getattr(ns, "model_tag", None)
    if tag is None:
        return
    if ns.model is not None and ns.model != tag:
        cl.errors.append(f"the model is given twice, as MODEL {tag!r} and as --model {ns.model!r}; "
                         "give it once.")
        return
    ns.model = tag


def main(argv: Sequence[str] | None = None) -> int:
    cl = parse_command_line(argv)
    if cl.errors:
        prog = " ".join(p for p in ("tideserve", getattr(cl.ns, "command", None),
                                    getattr(cl.ns, "bench_command", None)) if p)
        for message in cl.errors:
            print(f"{prog}: error: {message}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cl.ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for message in cl.warnings:
        logger.warning(message)
    try:
        return cl.ns.func(cl.ns)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
