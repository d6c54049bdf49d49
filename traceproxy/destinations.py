"""Where a proxy is reached and where its output goes, in the words its start-up
lines and ``serve --check`` use: the admin listener as a URL to open, span and access
log files as absolute paths (a relative path is relative to the folder serve was
started in, which is easy to lose track of), OTLP as the address the exporter sends to."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .config import HostPort
from .observe.export_wire import ExportConfig
from .observe.otlp_settings import grpc_target, http_endpoint


def admin_url(admin: HostPort | None) -> str:
    return "off" if admin is None else f"http://{admin}"


def spans_destination(export: ExportConfig | None, environ: Mapping[str, str]) -> str:
    """``export`` as ``app.tracing_export_config`` resolved it (None: nothing exported);
    for OTLP, the address the exporter process will send to, resolved as it resolves it."""
    if export is None or export.exporter == "off":
        return "off"
    if export.exporter == "file":
        return os.path.abspath(export.file_path)
    if export.exporter == "console":
        return "stderr (console exporter)"
    if export.otlp_protocol == "grpc":
        target, plaintext = grpc_target(export.otlp_endpoint, environ)
        return f"OTLP grpc to {target} ({'plaintext' if plaintext else 'TLS'})"
    return f"OTLP {export.otlp_protocol} to {http_endpoint(export.otlp_endpoint, environ)}"


def access_log_destination(path: str) -> str:
    """``access_log.path``: empty for off, - for stdout, else a file."""
    if not path:
        return "off"
    return "stdout" if path == "-" else os.path.abspath(path)
