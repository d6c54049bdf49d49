"""Exporter process: where a batch of spans goes (OTLP, an OTLP/JSON file, stderr).

A sink has ``export(spans) -> bool`` (True: delivered) and ``shutdown()``. Each sink
imports only what its destination needs, so a console exporter never loads gRPC.
The OTLP sink hands everything the config leaves empty to the OTel SDK exporter, so
the standard ``OTEL_EXPORTER_OTLP_*`` variables (endpoint, headers, timeout,
insecure, compression, certificates) keep their documented meaning.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import sys
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

from traceproxy import __version__

from .export_wire import ExportConfig
from .otlp_proto import OtlpEncoder
from .spandata import SpanData

log = logging.getLogger("traceproxy.export")

DEFAULT_SERVICE_NAME = SCOPE_NAME = "traceproxy"
_ID_FIELDS = ("traceId", "spanId", "parentSpanId")
HTTP_TRACES_PATH = "/v1/traces"
_TIMEOUT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
_KIND_NAMES = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_STATUS_NAMES = {0: "UNSET", 1: "OK", 2: "ERROR"}


def make_sink(config: ExportConfig):
    if config.exporter == "console":
        return ConsoleSink()
    encoder = OtlpEncoder(resource_attributes(config), SCOPE_NAME, __version__)
    if config.exporter == "file":
        return FileSink(Path(config.file_path), encoder)
    if config.exporter == "otlp":
        return OtlpSink(otlp_transport(config), encoder)
    raise ValueError(f"no exporter process for exporter={config.exporter!r}")


def resource_attributes(config: ExportConfig) -> dict:
    """The SDK's resource detection (OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME,
    telemetry.sdk.*) < the config's attributes < the config's service name."""
    from opentelemetry.sdk.resources import Resource

    attributes = dict(config.resource_attributes)
    attributes["service.name"] = config.service_name or DEFAULT_SERVICE_NAME
    return dict(Resource.create(attributes).attributes)


class EncodedBatch(NamedTuple):
    payload: bytes  # a serialized ExportTraceServiceRequest
    spans: int


class OtlpSink:
    def __init__(self, transport, encoder: OtlpEncoder) -> None:
        self._transport, self._encoder = transport, encoder

    def export(self, spans: list[SpanData]) -> bool:
        return self._transport.send(EncodedBatch(self._encoder.encode(spans), len(spans)))

    def shutdown(self) -> None:
        self._transport.shutdown()


def otlp_transport(config: ExportConfig):
    """The OTel SDK's OTLP exporter, fed bytes we encoded (``otlp_proto.py``).

    The SDK exporter is kept for what it does well: the ``OTEL_EXPORTER_OTLP_*``
    settings, TLS, compression, retries with backoff, the export timeout. Only its
    encoding step is bypassed, through the hooks named in ``GrpcTransport`` and
    ``HttpTransport``; pyproject pins the exporter's minor version for them."""
    kwargs = {}
    if not any(os.environ.get(name) for name in _TIMEOUT_VARIABLES):
        kwargs["timeout"] = config.export_timeout
    if config.otlp_protocol == "grpc":
        if config.otlp_endpoint:
            kwargs["endpoint"] = config.otlp_endpoint
        return GrpcTransport(**kwargs)
    if config.otlp_endpoint:
        kwargs["endpoint"] = http_traces_url(config.otlp_endpoint)
    return HttpTransport(**kwargs)


class HttpTransport:
    """OTLP http/protobuf: the SDK exporter's HTTP client posts our payload."""

    def __init__(self, **kwargs) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        self._exporter = OTLPSpanExporter(**kwargs)
        client = getattr(self._exporter, "_client", None)
        if not callable(getattr(client, "export", None)):
            raise RuntimeError("this opentelemetry-exporter-otlp-proto-http has no _client.export(bytes); "
                               "install the version pinned in traceproxy's pyproject.toml")
        self._client = client

    def send(self, batch: EncodedBatch) -> bool:
        return bool(self._client.export(batch.payload).success)

    def shutdown(self) -> None:
        self._exporter.shutdown()


def _grpc_exporter_class():
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    class EncodedGrpcExporter(OTLPSpanExporter):
        """Exports ``EncodedBatch``es: the OTLP mixin's ``_translate_data`` and
        ``_count_data`` hooks take the batch instead of SDK spans. The payload is
        parsed back into the request message because the gRPC stub serializes
        messages itself: about 0.5 ms for a 512-span batch, parse and serialize,
        against ~3 ms to encode it; swapping the stub's serializer would reach
        further into the SDK than its two documented hooks."""

        def _translate_data(self, data: EncodedBatch) -> ExportTraceServiceRequest:
            return ExportTraceServiceRequest.FromString(data.payload)

        def _count_data(self, data: EncodedBatch) -> int:
            return data.spans

    return EncodedGrpcExporter


class GrpcTransport:
    def __init__(self, **kwargs) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self._exporter = _grpc_exporter_class()(**kwargs)
        self._success = SpanExportResult.SUCCESS

    def send(self, batch: EncodedBatch) -> bool:
        return self._exporter._export(batch) is self._success

    def shutdown(self) -> None:
        self._exporter.shutdown()


def http_traces_url(base: str) -> str:
    """A base endpoint (like OTEL_EXPORTER_OTLP_ENDPOINT) -> the traces URL."""
    path = urlsplit(base).path.rstrip("/")
    if path.endswith(HTTP_TRACES_PATH):
        return base
    return base.rstrip("/") + HTTP_TRACES_PATH


class FileSink:
    """One OTLP/JSON ``ExportTraceServiceRequest`` per line, like the Collector's file exporter."""

    def __init__(self, path: Path, encoder: OtlpEncoder) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Unbuffered: a write that fails (a full disk) must not stay in a buffer, to go
        # out glued to the next batch's line.
        self._file = open(path, "ab", buffering=0)
        self._path = path
        self._encoder = encoder

    def export(self, spans: list[SpanData]) -> bool:
        line = (otlp_json_line(self._encoder.encode(spans)) + "\n").encode("utf-8")
        end = os.fstat(self._file.fileno()).st_size
        try:
            view = memoryview(line)
            while view:
                view = view[self._file.write(view):]
        except OSError as exc:
            # Cut off what part of the line did get written: every line stays a whole
            # OTLP/JSON document, and the batch counts as failed.
            try:
                os.ftruncate(self._file.fileno(), end)
            except OSError:
                pass
            # Once per episode: the exporter's log filter holds back the repeats.
            log.warning("span file %s: cannot write (%s); batches are dropped until it can",
                        self._path, exc.strerror or exc)
            return False
        return True

    def shutdown(self) -> None:
        self._file.close()


def otlp_json_line(payload: bytes) -> str:
    """A serialized ``ExportTraceServiceRequest`` as a compact OTLP/JSON line (no newline).

    OTLP/JSON is protobuf's canonical JSON mapping with the OTLP exceptions that the
    Collector's file exporter writes and its otlpjson receiver reads: camelCase
    names, int64 as decimal strings, enums as integers, and trace/span ids as
    lowercase hex (protobuf's own mapping would make them base64)."""
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    document = MessageToDict(ExportTraceServiceRequest.FromString(payload), use_integers_for_enums=True)
    for span in _spans_and_links(document):
        for key in _ID_FIELDS:
            if key in span:
                span[key] = base64.b64decode(span[key]).hex()
    return json.dumps(document, separators=(",", ":"))


def _spans_and_links(document: dict):
    for resource_spans in document.get("resourceSpans", ()):
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                yield span
                yield from span.get("links", ())


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
