"""Exporter process: where a batch of spans goes (OTLP, an OTLP/JSON file, stderr).

A sink has ``export(spans) -> bool`` (True: delivered), ``export_raw(payload) -> bool``
for an engine's encoded export request relayed as it came (``otlp_relay.py``), and
``shutdown()``. Each sink imports only what its destination needs, so a console
exporter never loads gRPC.
The OTLP sink encodes the batch itself (``otlp_proto.py``) and sends the bytes
(``otlp_transport.py``), where the standard ``OTEL_EXPORTER_OTLP_*`` variables keep
their documented meaning (``otlp_settings.py``); the file sink writes OTLP/JSON
directly (``otlp_json.py``). The OpenTelemetry SDK is used for its resource
detection only.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from traceproxy import __version__

from .export_wire import ExportConfig
from .line_file import LineFile
from .otlp_json import OtlpJsonEncoder
from .otlp_proto import OtlpEncoder
from .otlp_settings import http_traces_url  # noqa: F401 (where callers have found it)
from .spandata import SpanData

log = logging.getLogger("traceproxy.export")

DEFAULT_SERVICE_NAME = SCOPE_NAME = "traceproxy"
_KIND_NAMES = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_STATUS_NAMES = {0: "UNSET", 1: "OK", 2: "ERROR"}


def make_sink(config: ExportConfig):
    if config.exporter == "console":
        return ConsoleSink()
    if config.exporter == "file":
        return FileSink(Path(config.file_path), OtlpJsonEncoder(resource_attributes(config), SCOPE_NAME, __version__))
    if config.exporter == "otlp":
        return OtlpSink(otlp_transport(config), OtlpEncoder(resource_attributes(config), SCOPE_NAME, __version__))
    raise ValueError(f"no exporter process for exporter={config.exporter!r}")


def resource_attributes(config: ExportConfig) -> dict:
    """The SDK's resource detection (OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME,
    telemetry.sdk.*) < the config's attributes < the config's service name."""
    from opentelemetry.sdk.resources import Resource

    attributes = dict(config.resource_attributes)
    attributes["service.name"] = config.service_name or DEFAULT_SERVICE_NAME
    return dict(Resource.create(attributes).attributes)


class OtlpSink:
    def __init__(self, transport, encoder: OtlpEncoder) -> None:
        self._transport, self._encoder = transport, encoder

    def export(self, spans: list[SpanData]) -> bool:
        return self._transport.send(self._encoder.encode(spans))

    def export_raw(self, payload: bytes) -> bool:
        return self._transport.send(payload)

    def shutdown(self) -> None:
        self._transport.shutdown()


def otlp_transport(config: ExportConfig):
    from .otlp_settings import otlp_settings
    from .otlp_transport import GrpcTransport, HttpTransport

    settings = otlp_settings(config)
    return GrpcTransport(settings) if settings.protocol == "grpc" else HttpTransport(settings)


class FileSink:
    """One OTLP/JSON ``ExportTraceServiceRequest`` per line, like the Collector's file exporter."""

    def __init__(self, path: Path, encoder: OtlpJsonEncoder) -> None:
        self._lines = LineFile(path)
        self._path = path
        self._encoder = encoder

    def export(self, spans: list[SpanData]) -> bool:
        return self._append(self._encoder.line(spans))

    def export_raw(self, payload: bytes) -> bool:
        from .otlp_relay import line

        return self._append(line(payload))

    def _append(self, line: bytes) -> bool:
        try:
            self._lines.append(line + b"\n")
        except OSError as exc:
            # Once per episode: the exporter's log filter holds back the repeats.
            log.warning("span file %s: cannot write (%s); batches are dropped until it can",
                        self._path, exc.strerror or exc)
            return False
        return True

    def shutdown(self) -> None:
        self._lines.close()


class ConsoleSink:
    """One human-readable line per span on stderr, for debugging."""

    def export(self, spans: list[SpanData]) -> bool:
        sys.stderr.write("".join(console_line(span) + "\n" for span in spans))
        sys.stderr.flush()
        return True

    def export_raw(self, payload: bytes) -> bool:
        from .otlp_relay import console_lines

        sys.stderr.write("".join(line + "\n" for line in console_lines(payload)))
        sys.stderr.flush()
        return True

    def shutdown(self) -> None:
        sys.stderr.flush()


def console_line(span: SpanData) -> str:
    parent = f"{span.parent_span_id:016x}" if span.parent_span_id else "-"
    status = _STATUS_NAMES.get(span.status_code, str(span.status_code))
    if span.status_message:
        status += f"({span.status_message})"
    attributes = " ".join(f"{key}={value!r}" for key, value in sorted(span.attributes.items()))
    events = ",".join(event.name for event in span.events)
    return (
        f"span trace={span.trace_id:032x} id={span.span_id:016x} parent={parent}"
        f" kind={_KIND_NAMES.get(span.kind, span.kind)} name={span.name!r}"
        f" duration_ms={(span.end_unix_ns - span.start_unix_ns) / 1e6:.3f} status={status}"
        + (f" events=[{events}]" if events else "")
        + (f" {attributes}" if attributes else "")
    )
