"""Where a proxy is reached and where its output goes, in the words its start-up
lines and ``serve --check`` use: the admin listener as a URL to open, span and access
log files as absolute paths (a relative path is relative to the folder serve was
started in, which is easy to lose track of), OTLP as the URL the exporter posts to."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .config import HostPort
from .observe.export_sinks import http_traces_url
from .observe.export_wire import ExportConfig

# Where the OTel SDK's exporters send when neither the config nor OTEL_* names an
# endpoint (exporter = "otlp" set explicitly).
_SDK_DEFAULT_HTTP_BASE = "http://localhost:4318"
_SDK_DEFAULT_GRPC = "http://localhost:4317"


def admin_url(admin: HostPort | None) -> str:
    return "off" if admin is None else f"http://{admin}"


def spans_destination(export: ExportConfig | None, environ: Mapping[str, str]) -> str:
    """``export`` as ``app.tracing_export_config`` resolved it (None: nothing exported)."""
    if export is None or export.exporter == "off":
        return "off"
    if export.exporter == "file":
        return os.path.abspath(export.file_path)
    if export.exporter == "console":
        return "stderr (console exporter)"
    return f"OTLP {export.otlp_protocol} to {_otlp_endpoint(export, environ)}"


def access_log_destination(path: str) -> str:
    """``access_log.path``: empty for off, - for stdout, else a file."""
    if not path:
        return "off"
    return "stdout" if path == "-" else os.path.abspath(path)


def _otlp_endpoint(export: ExportConfig, environ: Mapping[str, str]) -> str:
    """The address the SDK exporter will use, resolved as it resolves it: the config
    key (for http/protobuf with /v1/traces added unless there), else the traces
    variable as it is, else the general variable or the SDK's default (for
    http/protobuf with /v1/traces appended)."""
    http = export.otlp_protocol == "http/protobuf"
    if export.otlp_endpoint:
        return http_traces_url(export.otlp_endpoint) if http else export.otlp_endpoint
    if environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    if not http:
        return environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or _SDK_DEFAULT_GRPC
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or _SDK_DEFAULT_HTTP_BASE
    return f"{base.removesuffix('/')}/v1/traces"
