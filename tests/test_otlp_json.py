"""The direct OTLP/JSON writer against the protobuf route it replaces.

The reference is what the span file held before: our protobuf encoding
(``otlp_proto.py``, itself checked field by field against the SDK), parsed back and
turned into JSON by protobuf's ``MessageToDict`` with the OTLP/JSON exceptions
(integer enums, hex ids). The lines must be the same JSON, key for key and in the
same order, so every reader of the file (``traceproxy diagnose``, the Collector's
``otlpjson`` receiver) keeps reading them; the bytes differ only where JSON allows
(UTF-8 rather than ``\\u`` escapes, exponents without ``+``).
"""

from __future__ import annotations

import base64
import json
import math

import orjson
import pytest
from google.protobuf.json_format import MessageToDict, ParseDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from traceproxy.observe.otlp_json import OtlpJsonEncoder
from traceproxy.observe.otlp_proto import OtlpEncoder
from traceproxy.observe.spandata import (
    KIND_INTERNAL, KIND_SERVER, STATUS_ERROR, STATUS_OK, STATUS_UNSET, SpanData, SpanEvent,
)

from .test_otlp_proto import CLIENT, RESOURCE, ROOT_UNSAMPLED, SCOPE, SERVER

ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def reference_line(spans: list[SpanData], resource=RESOURCE, scope=SCOPE) -> str:
    """The span file's line before: protobuf bytes -> message -> MessageToDict -> hex ids."""
    message = ExportTraceServiceRequest.FromString(OtlpEncoder(resource, *scope).encode(spans))
    document = MessageToDict(message, use_integers_for_enums=True)
    for resource_spans in document.get("resourceSpans", ()):
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                for key in ID_FIELDS:
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
    return json.dumps(document, separators=(",", ":"))


def same_json(line: bytes, reference: str) -> bool:
    """The same document, members in the same order, whatever escapes either chose."""
    assert isinstance(line, bytes) and b"\n" not in line
    return json.loads(line, object_pairs_hook=list) == json.loads(reference, object_pairs_hook=list)


def odd_spans() -> list[SpanData]:
    """Every shape the writer has a rule for: defaults left out, oneof values kept,
    int64 wrapping, non-finite doubles, arrays, text that is not valid UTF-8."""
    base = CLIENT
    return [
        base._replace(attributes={"zero": 0, "false": False, "empty": "", "zero_double": 0.0,
                                  "negative_zero": -0.0, "nan": math.nan, "inf": math.inf, "-inf": -math.inf,
                                  "tiny": 5e-324, "huge": 1e300, "integral": 3.0, "int64_max": 2**63 - 1,
                                  "int64_min": -2**63, "wraps": 2**63 + 5, "uint64_max": 2**64 - 1}),
        base._replace(attributes={"empty_array": (), "mixed": ("a", 1, 2.5, True), "nested": (("x",), []),
                                  "list": ["a"], "none": None, "bytes": b"\x00\xff", "": "no key"}),
        base._replace(attributes={"surrogate": "bad \udcff byte", "unicode": "ünïcödé ✓ 日本 \U0001f600",
                                  "controls": "tab\tnewline\nquote\"backslash\\nul\x00"},
                      status_message="x \udc80 é", status_code=STATUS_ERROR),
        base._replace(name="", kind=0, status_code=STATUS_UNSET, status_message="", attributes={}, events=()),
        base._replace(status_code=STATUS_UNSET, status_message="message without a code"),
        base._replace(status_code=STATUS_OK, parent_span_id=0, trace_state="", sampled=False),
        base._replace(trace_id=1, span_id=1, parent_span_id=1, parent_is_remote=True, trace_state="k=v"),
        base._replace(trace_id=2**128 - 1, span_id=2**64 - 1, parent_span_id=2**64 - 1),
        base._replace(events=(SpanEvent("", 0), SpanEvent("no time", 0, {"k": 1}), SpanEvent("e", 7, {}),
                              SpanEvent("ünï", 9, {"a": ("b",), "c": 0.5}))),
        base._replace(kind=KIND_SERVER, name="POST /v1/chat/completions ünïcödé"),
        base._replace(kind=KIND_INTERNAL, start_unix_ns=0, end_unix_ns=1),
        base._replace(kind=7),
    ]


@pytest.mark.parametrize("spans", [
    pytest.param([SERVER, CLIENT, ROOT_UNSAMPLED], id="proxied-request-and-stall"),
    pytest.param([SERVER], id="one-span"),
    *(pytest.param([span], id=f"odd-{n}") for n, span in enumerate(odd_spans())),
    pytest.param(odd_spans(), id="all-odd-in-one-batch"),
])
def test_lines_equal_the_protobuf_route(spans):
    assert same_json(OtlpJsonEncoder(RESOURCE, *SCOPE).line(spans), reference_line(spans))


@pytest.mark.parametrize("resource, scope", [
    ({}, ("traceproxy", "")),
    ({"service.name": "s", "list": ("a", "b"), "ratio": 0.5, "on": True}, ("", "1.0")),
    ({"service.name": "ünï \udcff"}, SCOPE),
])
def test_resource_and_scope_equal_the_protobuf_route(resource, scope):
    assert same_json(OtlpJsonEncoder(resource, *scope).line([CLIENT]), reference_line([CLIENT], resource, scope))


def test_a_batch_without_spans_equals_the_protobuf_route():
    assert same_json(OtlpJsonEncoder(RESOURCE, *SCOPE).line([]), reference_line([]))


def test_lines_read_back_as_the_same_request():
    # The otlpjson reading rule: hex ids back to bytes, then protobuf's JSON mapping.
    spans = [SERVER, CLIENT, ROOT_UNSAMPLED]
    document = json.loads(OtlpJsonEncoder(RESOURCE, *SCOPE).line(spans))
    for span in document["resourceSpans"][0]["scopeSpans"][0]["spans"]:
        for key in ID_FIELDS:
            if key in span:
                span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    read_back = ParseDict(document, ExportTraceServiceRequest())
    assert read_back == ExportTraceServiceRequest.FromString(OtlpEncoder(RESOURCE, *SCOPE).encode(spans))


def test_the_encoder_can_be_reused():
    encoder = OtlpJsonEncoder(RESOURCE, *SCOPE)
    first = encoder.line([SERVER, CLIENT])
    encoder.line(odd_spans())
    assert encoder.line([SERVER, CLIENT]) == first


def test_attributes_written_once_and_reused_still_equal_the_protobuf_route():
    # The second and third lines of the same spans are written from the attributes kept
    # the first time, byte for byte what orjson writes of the document; True and 1 under
    # one key stay a boolValue and an intValue.
    flip = [CLIENT._replace(attributes={"k": True, "n": 1}), CLIENT._replace(attributes={"k": 1, "n": True})]
    spans = [SERVER, CLIENT, ROOT_UNSAMPLED, *odd_spans(), *flip]
    encoder = OtlpJsonEncoder(RESOURCE, *SCOPE)
    lines = [encoder.line(spans) for _ in range(3)]
    assert lines[0] == lines[1] == lines[2] == orjson.dumps(encoder.document(spans))
    assert same_json(lines[2], reference_line(spans))


def test_attributes_unique_to_each_request_are_not_kept():
    from traceproxy.observe.otlp_json import RepeatedAttributes

    encoder = OtlpJsonEncoder(RESOURCE, *SCOPE)
    for n in range(3 * RepeatedAttributes.DISTINCT):
        line = encoder.line([CLIENT._replace(attributes={"request_id": f"r{n}", "port": n, "method": "POST"})])
        assert f'"stringValue":"r{n}"'.encode() in line and f'"intValue":"{n}"'.encode() in line
    kept = encoder._attributes
    assert {"request_id", "port"} <= kept._varied and "method" not in kept._varied
    assert list(kept._written) == [("method", str, "POST")]  # the ids' first values let go
