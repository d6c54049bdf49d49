"""What a bad setting raises, and how an unknown name is answered."""

from __future__ import annotations

import difflib
from typing import Iterable


class ConfigError(Exception):
    """An invalid setting; the message names the key, its source, the bad value and the expected form."""


class Rejected(ValueError):
    """A parser's specific reason, shown before the expected form. Any other ValueError shows only the form."""


def refusal(exc: ValueError, expected: str) -> str:
    """What a kind's parser refused, as every error says it: a Rejected's reason, then the
    expected form (the reason alone would not say what to write instead)."""
    reason = f"{exc}; " if isinstance(exc, Rejected) else ""
    return f"{reason}expected {expected}"


def unknown(what: str, name: str, known: Iterable[str], where: str = "") -> ConfigError:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.8)
    place = f" in {where}" if where else ""
    hint = f"; did you mean {close[0]}?" if close else ""
    return ConfigError(f"unknown {what} {name}{place}{hint}")
