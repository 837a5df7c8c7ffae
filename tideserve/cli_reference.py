"""The command-line reference (docs/configuration.md), written from the parser itself.

The engine's flags, their defaults, choices and help are declared once, on the config dataclasses
(tideserve/settings.py generates the parser's engine groups from them); the server's flags live in
``tideserve.cli``. This renders the parser, so the document cannot drift from what it accepts
(tests/test_cli_reference.py compares the two).

    python -m tideserve.cli_reference > docs/configuration.md
"""

from __future__ import annotations

import argparse

INTRO = """# Configuration: the command line

Generated from the parser (`python -m tideserve.cli_reference > docs/configuration.md`); `tideserve serve
--help` prints the same. Global options (`--log-level`, `--version`) go before or after the subcommand.
`tideserve serve MODEL` takes the model as vLLM does (positional, or `--model`). Sizes take units:
`16G`, `4GiB`, `512M`, or a bare number (GiB for `--swap-space`, bytes for `--max-body-size`).

vLLM's flags that mean nothing here are listed in their own groups: those marked "no effect" are accepted
with a one-line warning (ignoring them cannot change a result); those marked "refused" stop the server
with the reason and what to do instead. A flag that is neither gets argparse's error with the closest
real flags. Every request field is described in `docs/api.md`; metrics in `docs/metrics.md`.

Each flag of the engine and KV cache groups is also a field of `EngineArgs` and a keyword of `LLM(...)`:
its name with underscores (`--max-num-seqs` is `max_num_seqs`, `--kv-cache-shrink-delay` is
`kv_cache_shrink_delay`), with the same default; a misspelt keyword is a `ValueError` that names the
closest one. These settings, and the server's, are declared once, as fields of the config dataclasses
(`tideserve/config.py`, `ElasticConfig`, `ServerConfig`) written with `setting(default, help=...,
choices=...)`; the parser, `EngineArgs`, the keyword check and this page are generated from them
(`tideserve/settings.py`), so a new setting is one field.
"""


def _default(action: argparse.Action) -> str:
    if action.default in (None, argparse.SUPPRESS) or isinstance(action, argparse._StoreFalseAction):
        return ""
    if isinstance(action, argparse._StoreTrueAction):
        return "off" if action.default is False else "on"
    return f"`{action.default}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render(parser: argparse.ArgumentParser) -> str:
    """Markdown tables of ``tideserve serve``'s flags, one per argument group."""
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = subparsers.choices["serve"]
    parts = [INTRO]
    general = [a for g in serve._action_groups if g.title in ("options", "positional arguments")
               for a in g._group_actions]
    groups = [("general", general)] + [(g.title, g._group_actions) for g in serve._action_groups
                                       if g.title not in ("options", "positional arguments")]
    for title, actions in groups:
        rows = []
        for action in actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            names = ", ".join(f"`{name}`" for name in action.option_strings) or f"`{action.dest}` (positional)"
            choices = f" Choices: {', '.join(map(str, action.choices))}." if action.choices else ""
            rows.append(f"| {names} | {_default(action)} | {_cell((action.help or '') + choices)} |")
        if rows:
            heading = title if title[1:2].isupper() else title[0].upper() + title[1:]  # "vLLM ..." stays
            parts.append(f"## {heading}\n\n| flag | default | what it does |\n|---|---|---|\n"
                         + "\n".join(rows) + "\n")
    return "\n".join(parts)


def main() -> None:
    from tideserve.cli import build_parser

    print(render(build_parser()), end="")


if __name__ == "__main__":
    main()
