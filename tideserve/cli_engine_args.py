"""The engine's command-line flags, shared by every command that builds an engine (``serve``, ``generate``,
``chat``, ``bench offline``), so their flags never drift apart.

The flags are generated from the settings declared on the config dataclasses (one flag per EngineArgs
field; see tideserve/settings.py); vLLM's engine flags that mean nothing here follow them. The settings are
imported only when a parser is built, so importing this module costs nothing.
"""

from __future__ import annotations

import argparse

from tideserve.cli_compat import ENGINE_FLAGS, add_foreign_flags
from tideserve.settings import add_setting_arguments, values_from


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags, generated from the settings declared on the config dataclasses (one flag per
    EngineArgs field; see tideserve/settings.py), then vLLM's engine flags that mean nothing here."""
    from tideserve.engine.arg_utils import ENGINE_SETTINGS

    add_setting_arguments(p, ENGINE_SETTINGS)
    add_foreign_flags(p, ENGINE_FLAGS, "vLLM engine flags with no meaning here (a warning, or an error "
                                       "with the reason)")
    p.set_defaults(_has_engine_args=True)


def engine_kwargs(ns: argparse.Namespace) -> dict:
    """The EngineArgs keywords of a parsed command line."""
    from tideserve.engine.arg_utils import ENGINE_SETTINGS

    return values_from(ns, ENGINE_SETTINGS)
