"""Where settings come from: flags > TRACEPROXY_* environment > the TOML file named by
--config or TRACEPROXY_CONFIG > defaults. Reading that one file is the only side effect."""

from __future__ import annotations

import argparse
import os
import stat
import tomllib
from typing import Any, Mapping

from .errors import ConfigError, unknown
from .flags import given_flags
from .sections import BY_DOTTED, BY_ENV, CONFIG_ENV, ENV_PREFIX, SECTIONS, Raw, Settings, build, defaults, parse


# Far above any real config file (the shipped one, every key with its meaning, is some
# tens of KiB): past it the path names something else, such as /dev/zero or a log.
MAX_CONFIG_BYTES = 1024 * 1024

# What cannot hold a config: a block device is a disk. A FIFO or a character device can
# (--config <(envsubst < tpl), --config /dev/stdin from a pipe, /dev/null for none),
# read to its end or to the size cap, which also stops /dev/zero.
_NOT_A_FILE = ((stat.S_ISDIR, "a directory"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _read_toml(path: str, source: str) -> dict[str, Any]:
    named = f"config file {path} (from {source})"
    if not path.strip():
        raise ConfigError(f"the config file's path (from {source}) is empty: expected the path of a TOML file")
    try:
        data = _read_config_bytes(path, named)
    except FileNotFoundError:
        raise ConfigError(f"{named} does not exist") from None
    except OSError as e:
        raise ConfigError(f"{named} cannot be read: {e.strerror or e}") from None
    try:
        # utf-8-sig: editors on Windows may begin the file with a byte-order mark.
        return tomllib.loads(data.decode("utf-8-sig"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{named} is not valid TOML: {e}") from None


def _read_config_bytes(path: str, named: str) -> bytes:
    """The bytes of the file, FIFO or character device at ``path``, up to MAX_CONFIG_BYTES.
    Opened without blocking, as open() of a named FIFO waits for a writer, and judged by
    what was opened; read blocking, as a pipe's writer may be slower than we are."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        what = next((name for is_it, name in _NOT_A_FILE if is_it(mode)), None)
        if what:
            raise ConfigError(f"{named} is {what}, not a file: expected the path of a TOML file")
        # Left non-blocking, a read may come back short or empty before the end: from a
        # pipe whose writer has not written yet, or a FUSE file system that honours the flag.
        os.set_blocking(fd, True)
        data = _read_to_end(fd, MAX_CONFIG_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{named} is over {MAX_CONFIG_BYTES // (1024 * 1024)} MiB: is it the config file?")
    if not data and stat.S_ISFIFO(mode):
        # A FIFO that no process holds open for writing reads as ended at once (a named
        # FIFO with no writer, a pipe whose writer failed): not an empty config.
        raise ConfigError(f"{named} is a FIFO that gave nothing: is anything writing to it?")
    return data


def _read_to_end(fd: int, limit: int) -> bytes:
    """Up to ``limit`` bytes, read until the end: one read of a pipe gives what is in it so far."""
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = os.read(fd, limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


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
