"""Where settings come from: flags > TRACEPROXY_* environment > the TOML file named by
--config or TRACEPROXY_CONFIG > defaults. Reading that one file is the only side effect."""

from __future__ import annotations

import argparse
import os
import tomllib
from typing import Any, Mapping

from .errors import ConfigError, unknown
from .flags import given_flags
from .sections import BY_DOTTED, BY_ENV, CONFIG_ENV, ENV_PREFIX, SECTIONS, Raw, Settings, build, defaults, parse


def _read_toml(path: str, source: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} (from {source}) does not exist") from None
    except OSError as e:
        raise ConfigError(f"config file {path} (from {source}) cannot be read: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def _file_values(doc: Mapping[str, Any], where: str) -> Raw:
    raw: Raw = {}
    for name, value in doc.items():
        if name in SECTIONS and not isinstance(value, dict):
            raise ConfigError(f"{name} = {value!r} (from {where}): expected a [{name}] table")
        if name not in SECTIONS and isinstance(value, dict):
            raise unknown("section", f"[{name}]", [f"[{section}]" for section in SECTIONS], where)
        pairs = {f"{name}.{key}": v for key, v in value.items()} if name in SECTIONS else {name: value}
        for dotted, v in pairs.items():
            if dotted not in BY_DOTTED:
                raise _misplaced(dotted, where) or unknown("key", dotted, BY_DOTTED, where)
            raw[dotted] = (v, where)
    return raw


def _misplaced(dotted: str, where: str) -> ConfigError | None:
    """TOML's usual trap: a top-level key written below a [section] belongs to it."""
    section, _, key = dotted.partition(".")
    if key not in BY_DOTTED:
        return None
    return ConfigError(f"unknown key {dotted} in {where}: {key} is a top-level key, "
                       f"so it must come before the first [section] (here it is under [{section}])")


def _env_values(environ: Mapping[str, str]) -> Raw:
    # Unknown TRACEPROXY_* variables are not errors: the environment is shared with
    # other tools (a benchmark's TRACEPROXY_CMD, say). ``unknown_environment`` names
    # them so the command line can warn about a likely typo.
    return {BY_ENV[name].dotted: (value, f"env {name}") for name, value in environ.items() if name in BY_ENV}


def unknown_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning per TRACEPROXY_* variable that is not a setting, with a suggestion."""
    environ = os.environ if environ is None else environ
    return [str(unknown("environment variable", name, BY_ENV)) + " (ignored)"
            for name in sorted(environ) if name.startswith(ENV_PREFIX) and name != CONFIG_ENV
            and name not in BY_ENV]


def load_settings(
    flags: argparse.Namespace | Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Settings from flags > TRACEPROXY_* environment > the file named by --config/TRACEPROXY_CONFIG > defaults."""
    environ = os.environ if environ is None else environ
    given = given_flags(flags)
    raw = defaults()
    if "config" in given:
        path, source = str(given.pop("config")), "flag --config"
    else:
        path, source = environ.get(CONFIG_ENV), f"env {CONFIG_ENV}"
    if path is not None:
        raw.update(_checked(_file_values(_read_toml(path, source), f"file {path}")))
    raw.update(_checked(_env_values(environ)))
    raw.update({dotted: (value, f"flag {BY_DOTTED[dotted].flag}") for dotted, value in given.items()})
    return build(raw)


def _checked(values: Raw) -> Raw:
    """``values``, each parsed once here: a bad value in the file or the environment
    is an error even when a flag (or the environment) then overrides it, as a bad
    line in nginx's or Envoy's config is, whatever else is given."""
    for dotted, (value, source) in values.items():
        parse(BY_DOTTED[dotted], value, source)
    return values
