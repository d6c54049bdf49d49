"""The hand-written OTLP encoder against the OpenTelemetry SDK's own encoder.

The same spans go through both: ours as bytes, the SDK's as ``ReadableSpan`` ->
``encode_spans``. Ours, decoded by the official generated classes, must equal the
SDK's message field for field (except ``flags``, where ours also carries the W3C
sampled bit, as the OTLP spec asks).
"""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from traceproxy.observe import otlp_proto
from traceproxy.observe.otlp_proto import OtlpEncoder, varint
from traceproxy.observe.semconv import SCHEMA_URL
from traceproxy.observe.spandata import (
    KIND_CLIENT, KIND_INTERNAL, KIND_SERVER, STATUS_ERROR, STATUS_OK, STATUS_UNSET, SpanData, SpanEvent,
)

RESOURCE = {"service.name": "traceproxy-test", "deployment.environment": "ci", "host.cpus": 2}
SCOPE = ("traceproxy", "9.9.9")
_KINDS = {KIND_INTERNAL: SpanKind.INTERNAL, KIND_SERVER: SpanKind.SERVER, KIND_CLIENT: SpanKind.CLIENT}
_STATUS = {STATUS_UNSET: StatusCode.UNSET, STATUS_OK: StatusCode.OK, STATUS_ERROR: StatusCode.ERROR}


def sdk_span(span: SpanData) -> ReadableSpan:
    """The reference: what the SDK's exporter would be handed for this span."""
    flags = TraceFlags(TraceFlags.SAMPLED if span.sampled else TraceFlags.DEFAULT)
    context = SpanContext(span.trace_id, span.span_id, is_remote=False, trace_flags=flags,
                          trace_state=TraceState.from_header([span.trace_state]) if span.trace_state else None)
    parent = (SpanContext(span.trace_id, span.parent_span_id, is_remote=span.parent_is_remote)
              if span.parent_span_id else None)
    message = span.status_message if span.status_code == STATUS_ERROR else None
    return ReadableSpan(
        name=span.name, context=context, parent=parent, resource=Resource(RESOURCE, SCHEMA_URL),
        attributes=span.attributes,
        events=[Event(e.name, e.attributes or {}, e.time_unix_ns) for e in span.events],
        kind=_KINDS[span.kind], status=Status(_STATUS[span.status_code], message),
        start_time=span.start_unix_ns, end_time=span.end_unix_ns,
        instrumentation_scope=InstrumentationScope(*SCOPE, schema_url=SCHEMA_URL),
    )


SERVER = SpanData(
    trace_id=0x0AF7651916CD43DD8448EB211C80319C, span_id=0xB7AD6B7169203331, parent_span_id=0x00F067AA0BA902B7,
    name="POST /v1/chat/completions", kind=KIND_SERVER, start_unix_ns=1_790_000_000_000_000_001,
    end_unix_ns=1_790_000_000_123_456_789,
    attributes={"http.request.method": "POST", "http.response.status_code": 200, "server.port": 8000,
                "traceproxy.upstream.connection.reused": True, "gen_ai.request.stream": False,
                "traceproxy.response.chunk_max_gap_s": 0.25, "traceproxy.request_id": "rid-1",
                "user_agent.original": "AsyncOpenAI/Python 1.99 ünïcödé ✓", "negative": -5,
                "big": 2**62, "zero": 0, "empty": "", "gen_ai.response.finish_reasons": ("stop", "length")},
    events=(SpanEvent("first_downstream_rx_byte", 1_790_000_000_000_000_001),
            SpanEvent("stall", 1_790_000_000_100_000_000,
                      {"traceproxy.stall.outcome": "FBS", "traceproxy.stall.waited_s": 30.0}),
            SpanEvent("last_downstream_tx_byte", 1_790_000_000_123_456_789)),
    status_code=STATUS_UNSET, trace_state="vendor=abc,other=1", sampled=True, parent_is_remote=True,
)
CLIENT = SpanData(
    trace_id=SERVER.trace_id, span_id=0x1122334455667788, parent_span_id=SERVER.span_id,
    name="POST /v1/chat/completions", kind=KIND_CLIENT, start_unix_ns=SERVER.start_unix_ns + 10,
    end_unix_ns=SERVER.end_unix_ns - 10,
    attributes={"traceproxy.outcome": "UF", "error.type": "upstream_connection_failure"},
    status_code=STATUS_ERROR, status_message="connect refused: 127.0.0.1:1", sampled=True,
)
ROOT_UNSAMPLED = SpanData(
    trace_id=1, span_id=2, parent_span_id=0, name="stall FBS first_byte", kind=KIND_INTERNAL,
    start_unix_ns=5, end_unix_ns=6, attributes={}, sampled=False,
)


def decoded(encoder: OtlpEncoder, spans: list[SpanData]) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest.FromString(encoder.encode(spans))


def test_encoding_equals_the_sdk_encoding_of_the_same_spans():
    spans = [SERVER, CLIENT, ROOT_UNSAMPLED]
    ours = decoded(OtlpEncoder(RESOURCE, *SCOPE), spans)
    reference = encode_spans([sdk_span(s) for s in spans])
    our_flags = [s.flags for s in ours.resource_spans[0].scope_spans[0].spans]
    for message in (ours, reference):
        for span in message.resource_spans[0].scope_spans[0].spans:
            span.ClearField("flags")
    assert ours == reference
    # bit 8: "is the parent remote" is known; bit 9: it is (a client's traceparent); bit 0: sampled
    assert our_flags == [0x301, 0x101, 0x100]


def test_cached_strings_are_encoded_the_same_the_second_time():
    encoder = OtlpEncoder(RESOURCE, *SCOPE)
    first, second = encoder.encode([SERVER, CLIENT]), encoder.encode([SERVER, CLIENT])
    assert first == second
    assert len(ExportTraceServiceRequest.FromString(second).resource_spans[0].scope_spans[0].spans) == 2


def test_the_string_cache_stays_bounded(monkeypatch):
    monkeypatch.setattr(otlp_proto, "CACHE_LIMIT", 50)
    encoder = OtlpEncoder(RESOURCE, *SCOPE)
    for n in range(400):
        span = CLIENT._replace(name=f"GET /path/{n}", attributes={"url.path": f"/path/{n}"})
        encoder.encode([span])
        assert len(encoder._values) <= 50 and len(encoder._names) <= 50
    assert decoded(encoder, [span]).resource_spans[0].scope_spans[0].spans[0].name == "GET /path/399"


def test_text_that_is_not_valid_unicode_still_decodes():
    span = CLIENT._replace(attributes={"traceproxy.error": "bad \udcff byte"}, status_message="x \udc80")
    decoded_span = decoded(OtlpEncoder(RESOURCE, *SCOPE), [span]).resource_spans[0].scope_spans[0].spans[0]
    assert decoded_span.attributes[0].value.string_value == "bad ? byte"
    assert decoded_span.status.message == "x ?"


@pytest.mark.parametrize("value, expected", [
    (0, b"\x00"), (1, b"\x01"), (127, b"\x7f"), (128, b"\x80\x01"), (300, b"\xac\x02"),
    (-1, b"\xff" * 9 + b"\x01"),
])
def test_varint(value, expected):
    assert varint(value) == expected
