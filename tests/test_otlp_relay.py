"""A relayed engine request's span-file line against protobuf's own JSON mapping.

The reference is what the span file held before the walk (``otlp_relay.py``) replaced
it: the request parsed by protobuf, ``MessageToDict`` with integer enums, trace and span
ids turned from base64 to hex. The lines must be the same JSON, members in the same
order, whatever the engine put in its spans, so every reader of the file (``traceproxy
diagnose``, the Collector's ``otlpjson`` receiver, users' tools) reads the same requests.
"""

from __future__ import annotations

import base64
import json
import math
import random
import struct

import pytest
from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from traceproxy.observe import otlp_relay
from traceproxy.observe.otlp_proto import varint
from traceproxy.observe.otlp_relay import console_lines, json_line, line

from .sglang_spans import Request, payload, random_trace_id


def reference_line(body: bytes) -> str:
    document = MessageToDict(ExportTraceServiceRequest.FromString(body), use_integers_for_enums=True)
    for resource_spans in document.get("resourceSpans", ()):
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                for item in (span, *span.get("links", ())):
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if key in item:
                            item[key] = base64.b64decode(item[key]).hex()
    return json.dumps(document, separators=(",", ":"))


@pytest.fixture
def walked_only(monkeypatch):
    """The walk writes the line itself: protobuf's mapping is not asked."""
    def refused(request):
        raise AssertionError("the walk left the request to protobuf's mapping")

    monkeypatch.setattr(otlp_relay, "_reference", refused)


def assert_same_json(body: bytes) -> None:
    written = line(body)
    assert isinstance(written, bytes) and b"\n" not in written
    assert json.loads(written, object_pairs_hook=list) == json.loads(reference_line(body), object_pairs_hook=list)
    assert json.loads(json_line(body)) == json.loads(written)


def set_value(any_value: AnyValue, value) -> None:
    if isinstance(value, bool):
        any_value.bool_value = value
    elif isinstance(value, int):
        any_value.int_value = value
    elif isinstance(value, float):
        any_value.double_value = value
    elif isinstance(value, bytes):
        any_value.bytes_value = value
    elif isinstance(value, list):
        any_value.array_value.SetInParent()
        for item in value:
            set_value(any_value.array_value.values.add(), item)
    elif isinstance(value, dict):
        any_value.kvlist_value.SetInParent()
        add_attributes(any_value.kvlist_value.values, value)
    elif value is not None:
        any_value.string_value = value


def add_attributes(key_values, attributes: dict) -> None:
    for key, value in attributes.items():
        kv = key_values.add()
        kv.key = key
        if value is not None:
            set_value(kv.value, value)


EVERY_VALUE = {
    "text": "prefill_forward", "empty text": "", "unicode": "naïve ✓ 日本", "yes": True, "no": False,
    "int": 42, "zero": 0, "negative": -7, "int64 max": 2**63 - 1, "int64 min": -2**63,
    "double": 0.25, "zero double": 0.0, "negative zero": -0.0, "big double": 1e300, "tiny": 5e-324,
    "nan": math.nan, "inf": math.inf, "-inf": -math.inf,
    "array": [1, "two", 3.5, False, [b"\x00"]], "empty array": [], "kvlist": {"a": 1, "nested": {"b": "c"}},
    "empty kvlist": {}, "bytes": b"\x00\xff binary", "empty bytes": b"", "no value": None, "": "empty key",
}


def every_field_request() -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add(schema_url="https://opentelemetry.io/schemas/1.26.0")
    add_attributes(resource_spans.resource.attributes, {"service.name": "sglang", "pid": 4242})
    resource_spans.resource.dropped_attributes_count = 3
    scope_spans = resource_spans.scope_spans.add(schema_url="https://example.com/scope")
    scope_spans.scope.name, scope_spans.scope.version = "sglang server", "0.4.6"
    add_attributes(scope_spans.scope.attributes, {"scope.attribute": True})
    scope_spans.scope.dropped_attributes_count = 1
    span = scope_spans.spans.add(
        trace_id=bytes(range(16)), span_id=b"\x01" * 8, parent_span_id=b"\xfe" * 8, trace_state="k=v", flags=0x301,
        name="decode_forward", kind=Span.SPAN_KIND_SERVER, start_time_unix_nano=1_700_000_000_123_456_789,
        end_time_unix_nano=2**64 - 1, dropped_attributes_count=2, dropped_events_count=4, dropped_links_count=5,
        status=Status(code=Status.STATUS_CODE_ERROR, message="boom"))
    add_attributes(span.attributes, EVERY_VALUE)
    event = span.events.add(time_unix_nano=1_700_000_000_000_000_001, name="exception", dropped_attributes_count=6)
    add_attributes(event.attributes, {"exception.message": "bad", "count": 2})
    span.events.add()  # an empty event: {}
    link = span.links.add(trace_id=b"\xab" * 16, span_id=b"\xcd" * 8, trace_state="x=y", dropped_attributes_count=7,
                          flags=1)
    add_attributes(link.attributes, {"link.kind": "follows"})
    span.links.add()
    scope_spans.spans.add(name="bare")  # no ids, no status: left out
    scope_spans.spans.add(status=Status())  # an empty status is written: {}
    scope_spans.spans.add(status=Status(code=Status.STATUS_CODE_OK), kind=99)  # an enum value not in the enum
    request.resource_spans.add()  # no resource, no scopes
    request.resource_spans.add().scope_spans.add()  # an empty scope's spans
    return request


def test_every_field_and_value_type_is_written_as_protobuf_maps_it(walked_only):
    assert_same_json(every_field_request().SerializeToString())


def test_sglang_shaped_requests_are_written_as_protobuf_maps_them(walked_only):
    rng = random.Random(7)
    for role in ("prefill", "decode"):
        request = Request(random_trace_id(), role, parent=rng.getrandbits(64).to_bytes(8, "big"))
        assert_same_json(payload(request.stages(5) + [request.nested("forward", batch_size=8)] + request.finish()))


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 2 else 6)
    return [lambda: rng.choice(["", "a", "ü", "x" * 200]), lambda: rng.random() < 0.5,
            lambda: rng.randint(-2**63, 2**63 - 1), lambda: rng.choice([0.0, rng.uniform(-1e9, 1e9), math.nan]),
            lambda: rng.randbytes(rng.randrange(4)), lambda: None,
            lambda: [random_value(rng, depth + 1) for _ in range(rng.randrange(3))],
            lambda: {f"k{i}": random_value(rng, depth + 1) for i in range(rng.randrange(3))}][kind]()


def test_random_spans_are_written_as_protobuf_maps_them(walked_only):
    rng = random.Random(2024)
    for _ in range(30):
        request = ExportTraceServiceRequest()
        for _ in range(rng.randrange(3)):
            resource_spans = request.resource_spans.add()
            if rng.random() < 0.7:
                add_attributes(resource_spans.resource.attributes, {"service.name": "engine"})
            for _ in range(rng.randrange(3)):
                scope_spans = resource_spans.scope_spans.add()
                for _ in range(rng.randrange(4)):
                    span = scope_spans.spans.add(
                        trace_id=rng.randbytes(16), span_id=rng.randbytes(8),
                        parent_span_id=rng.choice([b"", rng.randbytes(8)]), name=rng.choice(["", "s"]),
                        kind=rng.randrange(6), start_time_unix_nano=rng.choice([0, rng.getrandbits(64)]),
                        flags=rng.choice([0, 1, 0x300]), dropped_events_count=rng.choice([0, 2**32 - 1]))
                    add_attributes(span.attributes, {f"a{i}": random_value(rng) for i in range(rng.randrange(5))})
                    for _ in range(rng.randrange(3)):
                        add_attributes(span.events.add(name="e", time_unix_nano=rng.getrandbits(64)).attributes,
                                       {"v": random_value(rng)})
                    if rng.random() < 0.5:
                        span.status.code = rng.randrange(3)
        assert_same_json(request.SerializeToString())


# ---------------------------------------------------------------- odd but valid encodings
def tag(field: int, wire_type: int) -> bytes:
    return varint(field << 3 | wire_type)


def delimited(field: int, body: bytes) -> bytes:
    return tag(field, 2) + varint(len(body)) + body


def in_a_request(*span_bodies: bytes) -> bytes:
    return delimited(1, delimited(2, b"".join(delimited(2, body) for body in span_bodies)))


@pytest.mark.parametrize("span_body", [
    # fields out of number order, flags (16) before the ids
    tag(16, 5) + struct.pack("<I", 1) + delimited(5, b"late name") + delimited(1, b"\x11" * 16),
    # a scalar twice: the last one counts
    delimited(5, b"first") + delimited(5, b"second") + tag(6, 0) + varint(2) + tag(6, 0) + varint(3),
    # defaults written out explicitly: still left out
    delimited(1, b"") + delimited(5, b"") + tag(6, 0) + varint(0) + tag(7, 1) + struct.pack("<Q", 0),
    # fields this protobuf does not know: left out
    tag(100, 0) + varint(5) + delimited(101, b"unknown") + tag(102, 1) + b"\x00" * 8 + tag(103, 5) + b"\x00" * 4
    + delimited(5, b"named"),
    # a negative enum value, a dropped count past 2^31, attributes apart from each other
    tag(6, 0) + varint(-1) + tag(10, 0) + varint(2**32 - 1) + delimited(9, KeyValue(key="a").SerializeToString())
    + delimited(5, b"n") + delimited(9, KeyValue(key="b", value=AnyValue(int_value=-1)).SerializeToString()),
    # a status sent twice: protobuf merges the two
    delimited(15, Status(message="m").SerializeToString()) + delimited(15, Status(code=2).SerializeToString()),
    # an attribute value set twice: one oneof member replaces the other
    delimited(9, delimited(1, b"k") + delimited(2, AnyValue(string_value="s").SerializeToString()
                                                 + AnyValue(int_value=0).SerializeToString())),
    # a long varint for a small number
    tag(6, 0) + b"\x81\x80\x80\x00" + delimited(5, b"x"),
    # a bool whose varint carries bits above 64: protobuf keeps the low 64 (zero), false
    delimited(9, delimited(1, b"k") + delimited(2, tag(2, 0) + b"\x80" * 9 + b"\x02")),
    # an empty status and flags last, as an SDK ends a span, but a status and flags before them too
    delimited(15, Status(code=2).SerializeToString()) + delimited(5, b"n") + delimited(15, b"")
    + tag(16, 5) + struct.pack("<I", 0x100),
    tag(16, 5) + struct.pack("<I", 1) + delimited(15, b"") + tag(16, 5) + struct.pack("<I", 0x300),
    # the last field's bytes end as an empty status and flags would
    delimited(5, b"n") + delimited(9, KeyValue(key="k", value=AnyValue(
        bytes_value=b"\x7a\x00\x85\x01\x00\x01\x00\x00")).SerializeToString()),
])
def test_odd_but_valid_encodings_are_read_as_protobuf_reads_them(span_body):
    assert_same_json(in_a_request(span_body))


def test_spans_as_the_sdk_exports_them_are_written_as_protobuf_maps_them(walked_only):
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import Link, Status as SdkStatus, StatusCode, set_span_in_context

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("sglang server", "0.4.6")
    thread = tracer.start_span("Scheduler", attributes={"tp_rank": 0, "pid": 4242, "thread_label": "Scheduler"})
    previous = None
    for name in ("decode_prepare", "decode_forward", "decode_loop"):
        stage = tracer.start_span(name, context=set_span_in_context(thread),
                                  links=[Link(previous.get_span_context())] if previous else None,
                                  attributes={"batch_size": 8, "ratio": 0.5, "ids": [1, 2]})
        stage.add_event("scheduled", {"queue": "waiting"})
        stage.end()
        previous = stage
    thread.set_status(SdkStatus(StatusCode.ERROR, "aborted"))
    thread.end()
    assert_same_json(encode_spans(memory.get_finished_spans()).SerializeToString())


def test_an_attribute_seen_before_is_the_same_json_in_each_span(walked_only):
    request = Request(random_trace_id(), "decode")
    spans = [request.nested("decode_loop", batch_size=8) for _ in range(3)] + request.finish()
    body = payload(spans)
    assert_same_json(body)
    assert_same_json(body)


def test_fields_only_protobuf_maps_are_left_to_it():
    request = every_field_request()
    entity = request.resource_spans[0].resource.entity_refs.add()
    entity.type, entity.id_keys[:] = "service", ["service.name"]
    request.resource_spans[0].scope_spans[0].spans[0].attributes.add(key_strindex=3)
    request.resource_spans[0].scope_spans[0].spans[0].attributes.add().value.string_value_strindex = 4
    assert_same_json(request.SerializeToString())


def test_a_scope_sent_twice_is_merged_as_protobuf_merges_it():
    first, second = b"\x0a\x01a", b"\x12\x01v"  # a name, then a version
    span = delimited(2, delimited(5, b"n"))
    assert_same_json(delimited(1, delimited(2, delimited(1, first) + span + delimited(1, second))))


def test_an_empty_request_is_an_empty_document():
    assert line(b"") == b"{}"


def test_a_request_that_does_not_parse_is_an_error_not_a_line():
    with pytest.raises(Exception):
        line(b"\x0a\x05\x12")


def test_the_reference_route_writes_the_same_document(monkeypatch):
    # Taken when the installed OTLP messages have fields the walk does not know.
    body = every_field_request().SerializeToString()
    fast = line(body)
    monkeypatch.setattr(otlp_relay, "_WALK_KNOWS_THE_SCHEMA", False)
    assert json.loads(line(body), object_pairs_hook=list) == json.loads(fast, object_pairs_hook=list)


def test_the_console_shows_one_line_per_span_with_hex_ids():
    request = Request(random_trace_id(), "decode")
    lines = console_lines(payload(request.stages(2)))
    assert len(lines) == 2 and "service='sglang'" in lines[0] and "name='decode_prepare'" in lines[0]
    assert f"trace={request.trace_id.hex()}" in lines[0]
