"""Exporter process: ``SpanData`` -> OTel SDK ``ReadableSpan``, and OTLP/JSON lines.

Only the exporter process imports this (it pulls in the OTel SDK and protobuf).

OTLP/JSON is protobuf's canonical JSON mapping with the OTLP exceptions that the
Collector's file exporter writes and its otlpjson receiver reads: camelCase names,
int64 as decimal strings, enums as integers, and trace/span ids as lowercase hex
(protobuf's own mapping would make them base64).
"""

from __future__ import annotations

import base64
import json
from functools import lru_cache

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from traceproxy import __version__

from .export_wire import ExportConfig
from .spandata import STATUS_ERROR, STATUS_OK, SpanData

DEFAULT_SERVICE_NAME = "traceproxy"
SCOPE = InstrumentationScope("traceproxy", __version__)

# OTLP's enum starts at UNSPECIFIED=0; the SDK's SpanKind starts at INTERNAL=0 and
# cannot say "unspecified", so 0 becomes INTERNAL.
_KIND_FROM_OTLP = {
    0: SpanKind.INTERNAL,
    1: SpanKind.INTERNAL,
    2: SpanKind.SERVER,
    3: SpanKind.CLIENT,
    4: SpanKind.PRODUCER,
    5: SpanKind.CONSUMER,
}
_SAMPLED, _NOT_SAMPLED = TraceFlags(TraceFlags.SAMPLED), TraceFlags(TraceFlags.DEFAULT)
_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def build_resource(config: ExportConfig) -> Resource:
    """Env-detected attributes (OTEL_RESOURCE_ATTRIBUTES, ...) < the caller's < service.name."""
    attributes = dict(config.resource_attributes)
    attributes["service.name"] = config.service_name or DEFAULT_SERVICE_NAME
    return Resource.create(attributes)


class SpanConverter:
    def __init__(self, resource: Resource) -> None:
        self.resource = resource

    def readable_spans(self, spans: list[SpanData]) -> list[ReadableSpan]:
        return [self.readable_span(span) for span in spans]

    def readable_span(self, span: SpanData) -> ReadableSpan:
        return ReadableSpan(
            name=span.name,
            context=_span_context(span),
            parent=_parent_context(span),
            resource=self.resource,
            attributes=span.attributes,
            events=[Event(e.name, e.attributes or {}, e.time_unix_ns) for e in span.events],
            kind=_KIND_FROM_OTLP.get(span.kind, SpanKind.INTERNAL),
            status=_status(span),
            start_time=span.start_unix_ns,
            end_time=span.end_unix_ns,
            instrumentation_scope=SCOPE,
        )


def _span_context(span: SpanData) -> SpanContext:
    return SpanContext(
        span.trace_id,
        span.span_id,
        is_remote=False,
        trace_flags=_SAMPLED if span.sampled else _NOT_SAMPLED,
        trace_state=_trace_state(span.trace_state),
    )


def _parent_context(span: SpanData) -> SpanContext | None:
    if not span.parent_span_id:
        return None
    return SpanContext(span.trace_id, span.parent_span_id, is_remote=span.parent_is_remote)


def _status(span: SpanData) -> Status:
    # The API discards (with a warning) a description on anything but ERROR.
    if span.status_code == STATUS_ERROR:
        return Status(StatusCode.ERROR, span.status_message or None)
    return Status(StatusCode.OK if span.status_code == STATUS_OK else StatusCode.UNSET)


@lru_cache(maxsize=256)
def _trace_state(header: str) -> TraceState:
    return TraceState.from_header([header]) if header else TraceState()


def otlp_json_line(readable_spans: list[ReadableSpan]) -> str:
    """One ``ExportTraceServiceRequest`` as a compact OTLP/JSON line (no newline)."""
    document = MessageToDict(encode_spans(readable_spans), use_integers_for_enums=True)
    for span in _spans_and_links(document):
        _hex_ids(span)
    return json.dumps(document, separators=(",", ":"))


def _spans_and_links(document: dict):
    for resource_spans in document.get("resourceSpans", ()):
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                yield span
                yield from span.get("links", ())


def _hex_ids(message: dict) -> None:
    for key in _ID_FIELDS:
        if key in message:
            message[key] = base64.b64decode(message[key]).hex()
