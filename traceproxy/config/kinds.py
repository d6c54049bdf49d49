"""Kinds: how a raw value (a TOML value, or a string from a flag or an environment
variable) becomes a typed one, and how its accepted form is said in errors, --help,
the default file and the reference. Addresses and URLs are in addresses.py."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from ..lifecycle.stall import STALL_KINDS
from .errors import Rejected


@dataclass(frozen=True)
class Kind:
    parse: Callable[[Any], Any]  # raises ValueError on a bad value
    expected: str  # the accepted form, quoted in errors, --help and the default file
    metavar: str


def _number(raw: Any, cast: type) -> Any:
    # bool is an int subclass, and int(2.5) would silently truncate
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)) or (cast is int and isinstance(raw, float)):
        raise ValueError
    value = cast(raw)
    if not math.isfinite(value):
        raise ValueError
    return value


def require_str(raw: Any) -> str:
    """``raw`` if it is a string (a TOML value may be anything), else the kind's form is shown."""
    if not isinstance(raw, str):
        raise ValueError
    return raw


# Durations are turned into integer nanoseconds and timer delays: past this, a finite
# value would overflow them, and no timeout or window of a proxy needs more.
MAX_SECONDS = 365 * 24 * 3600
# Below a millisecond a timeout fires before any network answer can come (every connect
# would time out) and an interval turns its loop into a busy one: such a value is a typo
# (a unit slip, an exponent), never a setting.
MIN_SECONDS = 0.001


def seconds(*, zero: str | None = None, minimum: float = MIN_SECONDS) -> Kind:
    """Finite seconds from ``minimum`` to a year, or 0 when ``zero`` says what 0 means.
    Out of that range the error shows the value as given and this form, which says the
    bounds exactly: a reason such as "N s is under M s" would only repeat them, rounded."""

    def parse(raw: Any) -> float:
        value = _number(raw, float)
        if value == 0 and zero is not None:
            return 0.0
        if not minimum <= value <= MAX_SECONDS:
            raise ValueError
        return value

    off = f", or 0 for {zero}" if zero else ""
    return Kind(parse, f"a number of seconds, at least {minimum:g} s{off}, at most {MAX_SECONDS} (a year)", "SECONDS")


def integer(minimum: int, maximum: int | None = None, *, zero: str | None = None) -> Kind:
    def parse(raw: Any) -> int:
        value = _number(raw, int)
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError
        return value

    if maximum is not None:
        expected = f"an integer from {minimum} to {maximum}"
    else:
        expected = f"an integer >= {minimum}" + (f" (0 = {zero})" if zero else "")
    return Kind(parse, expected, "N")


_BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True}
_BOOL_WORDS |= {"false": False, "0": False, "no": False, "off": False}


def boolean() -> Kind:
    def parse(raw: Any) -> bool:
        if isinstance(raw, bool):
            return raw
        # A TOML integer 1 or 0, as the word "1" or "0" from a flag or a variable.
        if isinstance(raw, int) and raw in (0, 1):
            return bool(raw)
        word = require_str(raw).lower()
        if word not in _BOOL_WORDS:
            raise ValueError
        return _BOOL_WORDS[word]

    return Kind(parse, "true or false (also 1/0, yes/no, on/off)", "BOOL")


def choice(*options: str) -> Kind:
    def parse(raw: Any) -> str:
        value = require_str(raw).strip().lower()
        if value not in options:
            raise ValueError
        return value

    return Kind(parse, "one of " + ", ".join(repr(o) for o in options), "|".join(o or '""' for o in options))


def stall_kinds() -> Kind:
    """Stall kinds, as lifecycle.stall declares them; comma-separated in a flag or env var, a list in TOML."""

    def parse(raw: Any) -> tuple[str, ...]:
        items = list(raw) if isinstance(raw, (list, tuple)) else [i for i in require_str(raw).split(",") if i.strip()]
        kinds = tuple(require_str(item).strip().lower() for item in items)
        if not all(k in STALL_KINDS for k in kinds):
            raise ValueError
        return kinds

    return Kind(parse, "a list of stall kinds from " + ", ".join(STALL_KINDS), "KINDS")


def text() -> Kind:
    return Kind(lambda raw: require_str(raw).strip(), "a string", "TEXT")


def file_path(*, empty: str | None = None) -> Kind:
    """A path the proxy opens (the keys' own help says what - means). Empty only where
    ``empty`` says what it means: otherwise it would become ".", the working folder, and
    fail later as a folder that cannot be appended to. A NUL cannot be in a path: open()
    would refuse it at startup, as a traceback."""

    def parse(raw: Any) -> str:
        value = require_str(raw).strip()
        if not value and empty is None:
            raise Rejected("the path is empty")
        if "\0" in value:
            raise ValueError
        return value

    return Kind(parse, "a file path" + (f", or empty for {empty}" if empty else ""), "PATH")


def ratio(*, empty: str) -> Kind:
    def parse(raw: Any) -> float | None:
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            return None
        value = _number(raw, float)
        if not 0.0 <= value <= 1.0:
            raise ValueError
        return value

    return Kind(parse, f'a number from 0 to 1, or "" ({empty})', "RATIO")


_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def header_names() -> Kind:
    """One or more HTTP header names, comma-separated in a flag or env var, a list in TOML."""

    def parse(raw: Any) -> tuple[str, ...]:
        items = list(raw) if isinstance(raw, (list, tuple)) else require_str(raw).split(",")
        names = tuple(require_str(item).strip().lower() for item in items)
        if not names or not all(_HEADER_NAME.fullmatch(n) for n in names):
            raise ValueError
        return names

    return Kind(parse, 'one or more header names, e.g. ["x-request-id", "x-correlation-id"]', "NAMES")


def url_path() -> Kind:
    def parse(raw: Any) -> str:
        value = require_str(raw).strip()
        # Sent as is on a request line: printable ASCII only (RFC 3986; anything else
        # would be percent-encoded by the operator, as a URL in a request line must be).
        if not value.startswith("/") or not all(c.isascii() and c.isprintable() and not c.isspace() for c in value):
            raise Rejected(f"{value!r} is not a path starting with / in printable ASCII (percent-encode the rest)")
        return value

    return Kind(parse, "a URL path starting with /, e.g. /health", "PATH")
