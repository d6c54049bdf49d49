"""The command line: one flag per setting for serve, and the settings' forms as
argparse types for the other commands' own flags."""

from __future__ import annotations

import argparse
from typing import Any, Mapping

from .addresses import HostPort, address
from .errors import refusal, unknown
from .kinds import Kind, seconds
from .render import toml_value
from .sections import BY_DOTTED, CONFIG_ENV, SCHEMA


# Short flags beside the derived ones, by dotted key (declared with each key's setting).
FLAG_ALIASES = {s.dotted: s.flag_aliases for s in SCHEMA if s.flag_aliases}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Adds --config and one flag per setting; all default to None so "not given" stays visible."""
    group = parser.add_argument_group("settings (flags > TRACEPROXY_* env > --config file > defaults)")
    group.add_argument("--config", metavar="PATH", default=None,
                       help=f"TOML config file (env {CONFIG_ENV}); none is read unless named")
    for s in SCHEMA:
        text = f"{s.meaning} Expected: {s.kind.expected}. Default: {toml_value(s.default)}. Env: {s.env}."
        # argparse %-formats help strings
        switch = {"nargs": "?", "const": "true"} if s.kind.metavar == "BOOL" else {}  # --inject-rid alone = true
        group.add_argument(s.flag, *s.flag_aliases, dest=s.dest, metavar=s.kind.metavar,
                           default=None, help=text.replace("%", "%%"), **switch)


def given_flags(flags: argparse.Namespace | Mapping[str, Any] | None) -> dict[str, Any]:
    """Flags that were given, as dotted key -> raw value, plus "config" for --config."""
    if flags is None:
        return {}
    if isinstance(flags, argparse.Namespace):
        given = {s.dotted: getattr(flags, s.dest, None) for s in SCHEMA}
        given["config"] = getattr(flags, "config", None)
    else:
        for name in flags:
            if name != "config" and name not in BY_DOTTED:
                raise unknown("key", name, BY_DOTTED, "flags")
        given = dict(flags)
    return {key: value for key, value in given.items() if value is not None}


def _argument(kind: Kind, text: str) -> Any:
    try:
        return kind.parse(text.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{refusal(exc, kind.expected)}, got {text!r}") from None


def listen_argument(text: str) -> HostPort:
    """HOST:PORT to listen on (port 0: a free one), as the ``listen`` key takes it."""
    return _argument(address(), text)


def seconds_argument(zero: str) -> Any:
    """Seconds from a millisecond to a year, or 0 for ``zero``, as the config's durations."""
    kind = seconds(zero=zero)
    return lambda text: _argument(kind, text)
