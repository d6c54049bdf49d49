"""Checks serve makes at startup, and serve --check without writing anything, of what
the settings meet outside themselves: the OTEL_* variables and the file system. Each
error names the key, its value and where it came from, as a loading error does."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from .errors import ConfigError, refusal
from .sections import BY_DOTTED, Settings


def named_setting(settings: Settings, dotted: str, value: str) -> str:
    """How a startup check names a setting, as the config's own errors do."""
    return f"{dotted} = {value!r} (from {settings.source(dotted)})"


_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def check_otlp_endpoint(settings: Settings, environ, protocol: str) -> None:
    """The collector endpoint the exporter will use, tracing.otlp_endpoint or else the
    OTEL_* variable that gives it, judged by the one rule the key is loaded with: a
    variable the key would refuse fails every export later, in the client's own words."""
    endpoint = settings.tracing.otlp_endpoint
    if endpoint:
        named = named_setting(settings, "tracing.otlp_endpoint", endpoint)
    else:
        variable = next((name for name in _ENDPOINT_VARIABLES if environ.get(name)), None)
        if variable is None:
            return
        endpoint = environ[variable]
        named = f"{variable} = {endpoint!r} (from env)"
    if protocol == "http/protobuf" and not endpoint.strip().lower().startswith(("http://", "https://")):
        # http/protobuf posts to a URL: HOST:PORT and gRPC targets are gRPC's forms.
        raise ConfigError(f"{named}: OTLP over http/protobuf needs an http:// or https:// URL such as "
                          f"http://127.0.0.1:4318; HOST:PORT and gRPC targets are for tracing.otlp_protocol = grpc")
    if settings.tracing.otlp_endpoint:
        return  # the key was judged by its rule when the settings were loaded
    rule = BY_DOTTED["tracing.otlp_endpoint"].kind
    try:
        rule.parse(endpoint)
    except ValueError as exc:
        raise ConfigError(f"{named}: {refusal(exc, rule.expected)}") from None


def check_appendable(settings: Settings, dotted: str, path: str, create: bool = True) -> None:
    """Open the file as the exporter process will (its folder made), so that a path it
    cannot write is a startup error naming the key, not an exporter that dies later and
    takes the access log with it. Without ``create``, judge the same from what exists."""
    expected = "expected the path of a file the proxy can create or append to"
    named = named_setting(settings, dotted, path)
    folder = Path(path).parent
    reason = _make_folder(folder) if create else _why_folder_cannot_be_made(folder)
    if reason:
        raise ConfigError(f"{named}: its folder {str(folder)!r} cannot be made ({reason}); {expected}")
    reason = _append_to(Path(path)) if create else _why_file_cannot_be_appended(Path(path))
    if reason:
        raise ConfigError(f"{named}: cannot append to it ({reason}); {expected}")


_A_PART_IS_A_FILE = "a part of it is a file, not a folder"


def _make_folder(folder: Path) -> str | None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        # mkdir says "File exists" or "Not a directory" when a part of the path is a file.
        if isinstance(exc, (FileExistsError, NotADirectoryError)):
            return _A_PART_IS_A_FILE
        return exc.strerror or str(exc)
    return None


def _append_to(path: Path) -> str | None:
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _why_folder_cannot_be_made(folder: Path) -> str | None:
    """What _make_folder would say, judged without making anything."""
    existing = folder
    try:
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
    except OSError as exc:  # a folder on the way that cannot be searched
        return exc.strerror or str(exc)
    if not existing.is_dir():
        return _A_PART_IS_A_FILE
    if existing != folder and not os.access(existing, os.W_OK | os.X_OK):
        return os.strerror(errno.EACCES)
    return None


def _why_file_cannot_be_appended(path: Path) -> str | None:
    """What _append_to would say, judged without creating the file (its folder either
    exists or, as judged before, can be made)."""
    try:
        if path.is_dir():
            return os.strerror(errno.EISDIR)
        if path.exists():
            return None if os.access(path, os.W_OK) else os.strerror(errno.EACCES)
    except OSError as exc:
        return exc.strerror or str(exc)
    if path.parent.is_dir() and not os.access(path.parent, os.W_OK | os.X_OK):
        return os.strerror(errno.EACCES)
    return None
