"""Exporter process: where OTLP goes and how, from the config and the standard
``OTEL_EXPORTER_OTLP_*`` variables.

The variables keep the meaning the OpenTelemetry Python SDK's OTLP exporters give
them, so a deployment configured for those needs no change. For each setting the
traces variable (``OTEL_EXPORTER_OTLP_TRACES_X``) wins over the general one
(``OTEL_EXPORTER_OTLP_X``); a config key, where there is one, wins over both.

- endpoint: ``tracing.otlp_endpoint``, else the variables. Over http/protobuf a base
  endpoint (config or ``OTEL_EXPORTER_OTLP_ENDPOINT``) gets ``/v1/traces`` appended;
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is taken as the full URL. Over gRPC the
  URL's host:port is the target, and a bare target is used as it is.
- headers: ``name=value`` pairs separated by commas, URL-encoded (the W3C baggage
  format); names are lowercased.
- timeout: seconds for one export, retries included (the Python SDK's reading of the
  variables); ``tracing``'s own export timeout when neither is set.
- compression: ``gzip``, ``deflate`` or ``none``.
- TLS: ``CERTIFICATE`` (the CA bundle to trust), ``CLIENT_CERTIFICATE`` and
  ``CLIENT_KEY`` (mutual TLS). gRPC is plaintext when the endpoint is ``http://``,
  or ``INSECURE`` is ``true`` and the endpoint is not ``https://``.

Standard library only; nothing here opens a connection.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit, urlunsplit

from .export_wire import ExportConfig

log = logging.getLogger("traceproxy.export")

PREFIX, TRACES_PREFIX = "OTEL_EXPORTER_OTLP_", "OTEL_EXPORTER_OTLP_TRACES_"
HTTP_TRACES_PATH = "/v1/traces"
DEFAULT_HTTP_ENDPOINT = "http://localhost:4318"
DEFAULT_GRPC_ENDPOINT = "http://localhost:4317"
COMPRESSIONS = ("none", "gzip", "deflate")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")  # an HTTP token, lowercase


@dataclass(frozen=True)
class OtlpSettings:
    protocol: str  # "grpc" | "http/protobuf"
    endpoint: str  # http/protobuf: the URL posted to; grpc: the channel's target
    timeout: float  # seconds for one export, retries included
    headers: dict[str, str] = field(default_factory=dict)  # lowercase names
    compression: str = "none"
    insecure: bool = False  # grpc: a plaintext channel
    certificate: str = ""  # a CA bundle file; "" = the system's
    client_certificate: str = ""
    client_key: str = ""


def otlp_settings(config: ExportConfig, environ: Mapping[str, str] = os.environ) -> OtlpSettings:
    def variable(name: str) -> str:
        return environ.get(TRACES_PREFIX + name) or environ.get(PREFIX + name) or ""

    if config.otlp_protocol == "grpc":
        endpoint, insecure = grpc_target(config.otlp_endpoint, environ)
    else:
        endpoint, insecure = http_endpoint(config.otlp_endpoint, environ), False
    return OtlpSettings(
        protocol=config.otlp_protocol,
        endpoint=endpoint,
        timeout=_timeout(variable("TIMEOUT"), config.export_timeout),
        headers=parse_headers(variable("HEADERS")),
        compression=_compression(variable("COMPRESSION")),
        insecure=insecure,
        certificate=variable("CERTIFICATE"),
        client_certificate=variable("CLIENT_CERTIFICATE"),
        client_key=variable("CLIENT_KEY"),
    )


def http_endpoint(configured: str, environ: Mapping[str, str]) -> str:
    if configured:
        return http_traces_url(configured)
    if full := environ.get(TRACES_PREFIX + "ENDPOINT"):
        return full
    return _with_traces_path(environ.get(PREFIX + "ENDPOINT") or DEFAULT_HTTP_ENDPOINT)


def http_traces_url(base: str) -> str:
    """A base endpoint, or already the traces URL (tracing.otlp_endpoint takes either) ->
    the traces URL."""
    if urlsplit(base).path.rstrip("/").endswith(HTTP_TRACES_PATH):
        return base
    return _with_traces_path(base)


def _with_traces_path(base: str) -> str:
    """The signal path appended to the base URL's path, as the specification says for
    OTEL_EXPORTER_OTLP_ENDPOINT: a query string stays after it, and a fragment, never
    sent, goes."""
    parts = urlsplit(base)
    return urlunsplit(parts._replace(path=parts.path.rstrip("/") + HTTP_TRACES_PATH, fragment=""))


def grpc_target(configured: str, environ: Mapping[str, str]) -> tuple[str, bool]:
    """(the channel's target, whether it is plaintext)."""
    endpoint = (configured or environ.get(TRACES_PREFIX + "ENDPOINT") or environ.get(PREFIX + "ENDPOINT")
                or DEFAULT_GRPC_ENDPOINT)
    url = urlsplit(endpoint)
    # Set but empty counts as set, as in the SDK: it says "not insecure".
    insecure_variable = next((environ[name] for name in (TRACES_PREFIX + "INSECURE", PREFIX + "INSECURE")
                              if environ.get(name) is not None), None)
    if url.scheme == "https":
        insecure = False
    elif insecure_variable is not None:
        insecure = insecure_variable.strip().lower() == "true"
    else:
        insecure = url.scheme == "http"
    return url.netloc or endpoint, insecure


def parse_headers(raw: str) -> dict[str, str]:
    headers = {}
    for item in raw.split(","):
        if not item.strip():
            continue
        name, has_value, value = item.partition("=")
        name = unquote(name).strip().lower()
        if not has_value or not _HEADER_NAME.fullmatch(name):
            log.warning("OTEL_EXPORTER_OTLP_[TRACES_]HEADERS: ignoring %r, expected name=value", item.strip())
            continue
        headers[name] = unquote(value).strip()
    return headers


def _timeout(raw: str, configured: float) -> float:
    if not raw:
        return configured
    try:
        seconds = float(raw)
    except ValueError:
        seconds = 0.0
    if 0 < seconds < math.inf:
        return seconds
    log.warning("OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT = %r is not a positive number of seconds; using %s",
                raw, configured)
    return configured


def _compression(raw: str) -> str:
    value = raw.strip().lower() or "none"
    if value in COMPRESSIONS:
        return value
    log.warning("OTEL_EXPORTER_OTLP_[TRACES_]COMPRESSION = %r: expected one of %s; sending uncompressed",
                raw, ", ".join(COMPRESSIONS))
    return "none"
