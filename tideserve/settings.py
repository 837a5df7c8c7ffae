"""Settings written once: on the config dataclasses, everything else generated from them.

A config field becomes a user-facing setting by being declared with ``setting(default, help=..., ...)``:
its default, help text, choices and command-line spelling travel together in the field's metadata. From
those fields come the CLI's argparse groups (``add_setting_arguments``), the fields of ``EngineArgs``
and their mapping to the configs (``settings_fields``, ``build_config``), the check of
``LLM(**kwargs)`` (``check_names``), and docs/configuration.md (rendered from the parser). One new knob
is one edit, and tests/test_settings.py proves every setting reaches each of those places.

Plain Python (no torch), so the core's configs can use it and ``tideserve serve --help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ENGINE_GROUP = "engine"
KV_GROUP = "KV cache (elastic by default: sized from measurement, grows and shrinks)"
_KEY = "tideserve.setting"


@dataclass(frozen=True)
class Setting:
    """How one config field is spelled outside Python.

    ``name``: the ``EngineArgs`` / ``LLM`` keyword and argparse dest when it differs from the field's
    (``ElasticConfig.shrink_delay_s`` is ``kv_cache_shrink_delay``). ``unset``: the keyword defaults to
    None, which means "the config's own default" (or one the engine derives, as max_num_batched_tokens
    without chunked prefill); the field's default is then what the help text quotes. ``bool_flags`` for a
    bool: "auto" is ``--x`` for a default of False and ``--x`` plus ``--no-x`` for True; "no" is
    ``--no-x`` alone. ``parser_choices=False`` shows the choices as the metavar but leaves the check
    to the config, whose error explains more than argparse's "invalid choice". ``action`` is argparse's
    (``"append"`` for a repeatable flag); ``convert`` turns the keyword's value, None included, into the
    field's (``--api-key`` values, or $TIDESERVE_API_KEY when none is given)."""

    help: str | None = None
    group: str = ENGINE_GROUP
    name: str | None = None
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    choices: tuple[Any, ...] | None = None
    parser_choices: bool = True
    metavar: str | None = None
    type: Callable[[str], Any] | None = None
    bool_flags: str = "auto"
    unset: bool = False
    action: str | None = None
    convert: Callable[[Any], Any] | None = None


def config_from_json(value: Any, cls: type, name: str, example: str) -> Any:
    """A JSON-object setting (``--kv-events-config``, ``--pooler-config``) as ``cls``: from JSON text (the
    flag), a dict (Python) or one already built; None stays None. Unknown keys are refused, listing the known."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} must be a JSON object such as {example}, got {value!r} ({exc}).") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object (a dict), got {value!r}.")
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"{name} has unknown key(s) {unknown}; known: {known}.")
    return cls(**value)


def setting(default: Any, **kwargs: Any) -> Any:
    """A dataclass field that is a setting. ``{default}`` in the help text is replaced by the default."""
    help_text = kwargs.get("help")
    if help_text and "{default" in help_text:
        kwargs["help"] = help_text.format(default=default)
    return dataclasses.field(default=default, metadata={_KEY: Setting(**kwargs)})


@dataclass(frozen=True)
class SettingField:
    """One setting as the generated places see it: its keyword, where it lands, and how it is spelled."""

    name: str  # EngineArgs / LLM keyword and argparse dest
    config: type  # the dataclass that owns it
    field_name: str  # the field in that dataclass
    spec: Setting
    default: Any  # the config's default
    type_hint: str

    @property
    def arg_default(self) -> Any:
        """The keyword's (and the flag's) default: None where unset means the config's own."""
        return None if self.spec.unset else self.default

    @property
    def flag(self) -> str:
        return self.spec.flag or "--" + self.name.replace("_", "-")


def settings_fields(*configs: type) -> list[SettingField]:
    """The settings of ``configs``, in the order given and each dataclass's field order."""
    out = []
    for config in configs:
        for f in dataclasses.fields(config):
            spec = f.metadata.get(_KEY)
            if spec is None:
                continue
            hint = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            out.append(SettingField(spec.name or f.name, config, f.name, spec, f.default, hint))
    names = [s.name for s in out]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise TypeError(f"settings declared twice: {duplicates}")
    return out


def args_fields(settings: Iterable[SettingField]) -> list[tuple[str, str, dataclasses.Field]]:
    """``dataclasses.make_dataclass`` rows for an ``EngineArgs``-like class with one field per setting."""
    rows = []
    for s in settings:
        hint = s.type_hint if not s.spec.unset or "None" in s.type_hint else f"{s.type_hint} | None"
        rows.append((s.name, hint, dataclasses.field(default=s.arg_default, metadata={_KEY: s})))
    return rows


def build_config(config: type, settings: Iterable[SettingField], values: Any, base: Any = None) -> Any:
    """``config`` from the attributes of ``values`` (EngineArgs) named by its settings; an unset one
    keeps the config's default (or ``base``'s value when a base instance is given)."""
    kwargs = {}
    for s in settings:
        if not issubclass(config, s.config):
            continue
        value = getattr(values, s.name)
        if s.spec.convert is not None:
            value = s.spec.convert(value)
        elif s.spec.unset and value is None:
            continue
        kwargs[s.field_name] = value
    if base is None:
        return config(**kwargs)
    return dataclasses.replace(base, **kwargs) if kwargs else base


def _cli_type(s: SettingField) -> Callable[[str], Any] | None:
    """The argparse ``type``: the declared one, else int or float when that is the field's only type."""
    if s.spec.type is not None:
        return s.spec.type
    parts = {p.strip() for p in s.type_hint.split("|")} - {"None"}
    return {frozenset({"int"}): int, frozenset({"float"}): float}.get(frozenset(parts))


def add_setting_arguments(parser: argparse.ArgumentParser, settings: Sequence[SettingField],
                          groups: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One flag per setting, in argparse groups named by ``Setting.group`` (created in order of first
    use). Returns the groups, so callers can add to them."""
    groups = dict(groups or {})
    for s in settings:
        spec = s.spec
        if spec.group not in groups:
            groups[spec.group] = parser.add_argument_group(spec.group)
        g = groups[spec.group]
        if isinstance(s.default, bool):
            negative = "--no-" + s.flag[2:]
            if spec.bool_flags == "no":
                g.add_argument(negative, dest=s.name, action="store_false", help=spec.help)
            elif s.default:
                g.add_argument(s.flag, *spec.aliases, dest=s.name, action="store_true", default=True,
                               help=spec.help)
                g.add_argument(negative, dest=s.name, action="store_false")
            else:
                g.add_argument(s.flag, *spec.aliases, dest=s.name, action="store_true", help=spec.help)
            continue
        kwargs: dict[str, Any] = {"dest": s.name, "default": s.arg_default, "help": spec.help}
        cli_type = _cli_type(s)
        if cli_type is not None:
            kwargs["type"] = cli_type
        if spec.action is not None:
            kwargs["action"] = spec.action
        if spec.choices is not None and spec.parser_choices:
            kwargs["choices"] = list(spec.choices)
        metavar = spec.metavar
        if metavar is None and spec.choices is not None and not spec.parser_choices:
            metavar = "{" + ",".join(map(str, spec.choices)) + "}"
        if metavar is not None:
            kwargs["metavar"] = metavar
        g.add_argument(s.flag, *spec.aliases, **kwargs)
    return groups


def values_from(ns: argparse.Namespace, settings: Iterable[SettingField]) -> dict[str, Any]:
    """The settings' values from a parsed command line, as keywords."""
    return {s.name: getattr(ns, s.name) for s in settings}


def check_names(given: Iterable[str], known: Iterable[str], what: str = "engine argument") -> None:
    """Unknown keywords are a ValueError that names them, the closest known name of each, and all the
    known ones."""
    known = sorted(set(known))
    unknown = sorted(set(given) - set(known))
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        if close:
            hints.append(f"{name!r} -> {close[0]!r}")
    hint = f" Did you mean: {', '.join(hints)}?" if hints else ""
    raise ValueError(f"unknown {what}(s): {unknown}; known: {known}.{hint}")
