"""The shipped default file (config/traceproxy.toml) and the reference
(docs/configuration.md), rendered from the schema; tests compare both with it."""

from __future__ import annotations

import textwrap
from typing import Any

from .sections import SCHEMA, SECTIONS


_HEADER = """\
# traceproxy configuration file (TOML).
#
# Every setting is shown commented out with its built-in default; uncomment a
# line to change it. The file is read only when named by --config PATH or
# TRACEPROXY_CONFIG=PATH. Precedence, highest first:
#   1. command-line flags            --timeouts-connect 2.5
#   2. TRACEPROXY_* environment      TRACEPROXY_TIMEOUTS_CONNECT=2.5
#   3. this file                     [timeouts] connect = 2.5
#   4. built-in defaults
"""


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def _comment(text: str) -> list[str]:
    return ["# " + line for line in textwrap.wrap(text, 76, break_on_hyphens=False)]


def render_default_toml() -> str:
    lines = [_HEADER.rstrip("\n")]
    section = ""
    for s in SCHEMA:
        if s.section != section:
            section = s.section
            lines += ["", *_comment(SECTIONS[section][1]), f"[{section}]"]
        lines += ["", *_comment(s.meaning), *_comment(f"Expected: {s.kind.expected}."),
                  f"# {s.key} = {toml_value(s.default)}"]
    return "\n".join(lines) + "\n"


def render_reference_markdown() -> str:
    """``docs/configuration.md``: every key, its flag, variable, default and meaning."""
    lines = ["# Configuration reference", "",
             "Generated from `traceproxy/config/sections.py` by `python -m traceproxy.config reference`;",
             "do not edit by hand. Precedence: flags, then `TRACEPROXY_*` environment variables, then the",
             "`--config` TOML file, then defaults. `config/traceproxy.toml` lists the same keys, commented out.",
             ""]
    section = None
    for s in SCHEMA:
        if s.section != section:
            section = s.section
            title = f"[{section}]" if section else "top level"
            intro = SECTIONS[section][1] if section else "Where the proxy listens and what it forwards to."
            lines += [f"## {title}", "", intro, "", "| key | flag / environment | default | meaning |", "|---|---|---|---|"]
        flags = " ".join(f"`{f}`" for f in (s.flag, *s.flag_aliases))
        meaning = f"{s.meaning} Expected: {s.kind.expected}.".replace("|", "\\|")
        lines.append(f"| `{s.key}` | {flags}<br>`{s.env}` | `{toml_value(s.default)}` | {meaning} |")
        if s is SCHEMA[-1] or SCHEMA[SCHEMA.index(s) + 1].section != section:
            lines.append("")
    return "\n".join(lines)
