"""Exporter process: where a batch of spans goes (OTLP, an OTLP/JSON file, stderr).

A sink has ``export(spans) -> bool`` (True: delivered) and ``shutdown()``. Each sink
imports only what its destination needs, so a console exporter never loads gRPC.
The OTLP sink hands everything the config leaves empty to the OTel SDK exporter, so
the standard ``OTEL_EXPORTER_OTLP_*`` variables (endpoint, headers, timeout,
insecure, compression, certificates) keep their documented meaning.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

from .export_wire import ExportConfig
from .spandata import SpanData

HTTP_TRACES_PATH = "/v1/traces"
_TIMEOUT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
_KIND_NAMES = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_STATUS_NAMES = {0: "UNSET", 1: "OK", 2: "ERROR"}


def make_sink(config: ExportConfig):
    if config.exporter == "console":
        return ConsoleSink()
    from .export_convert import SpanConverter, build_resource

    converter = SpanConverter(build_resource(config))
    if config.exporter == "file":
        return FileSink(Path(config.file_path), converter)
    if config.exporter == "otlp":
        return OtlpSink(otlp_exporter(config), converter)
    raise ValueError(f"no exporter process for exporter={config.exporter!r}")


class OtlpSink:
    def __init__(self, exporter, converter) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self._exporter, self._converter = exporter, converter
        self._success = SpanExportResult.SUCCESS

    def export(self, spans: list[SpanData]) -> bool:
        return self._exporter.export(self._converter.readable_spans(spans)) is self._success

    def shutdown(self) -> None:
        self._exporter.shutdown()


def otlp_exporter(config: ExportConfig):
    kwargs = {}
    if not any(os.environ.get(name) for name in _TIMEOUT_VARIABLES):
        kwargs["timeout"] = config.export_timeout
    if config.otlp_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        if config.otlp_endpoint:
            kwargs["endpoint"] = config.otlp_endpoint
        return OTLPSpanExporter(**kwargs)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    if config.otlp_endpoint:
        kwargs["endpoint"] = http_traces_url(config.otlp_endpoint)
    return OTLPSpanExporter(**kwargs)


def http_traces_url(base: str) -> str:
    """A base endpoint (like OTEL_EXPORTER_OTLP_ENDPOINT) -> the traces URL."""
    path = urlsplit(base).path.rstrip("/")
    if path.endswith(HTTP_TRACES_PATH):
        return base
    return base.rstrip("/") + HTTP_TRACES_PATH


class FileSink:
    """One OTLP/JSON ``ExportTraceServiceRequest`` per line, like the Collector's file exporter."""

    def __init__(self, path: Path, converter) -> None:
        from .export_convert import otlp_json_line

        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")
        self._converter, self._line = converter, otlp_json_line

    def export(self, spans: list[SpanData]) -> bool:
        self._file.write(self._line(self._converter.readable_spans(spans)) + "\n")
        self._file.flush()
        return True

    def shutdown(self) -> None:
        self._file.close()


class ConsoleSink:
    """One human-readable line per span on stderr, for debugging."""

    def export(self, spans: list[SpanData]) -> bool:
        sys.stderr.write("".join(console_line(span) + "\n" for span in spans))
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
