"""An ``ExportTraceServiceRequest`` read back from the OTLP protobuf wire format: the
fields the engine-span join needs.

Why the official generated classes (opentelemetry-proto, installed with the OTLP
exporter), when ``otlp_proto.py`` writes the format by hand: reading is the other way
round. protobuf's C parser (upb, its default implementation) takes a 64-span SGLang
batch in about 210 us with the fields below read out; a reader walking the bytes in
Python took about 720 us for the same batch (measured on one core of a 2-core
machine). The receivers read every batch the engines export, so the faster one wins.
Writing is different: there the cost is building message objects from our own tuples,
which the hand-written encoder avoids.

What is kept per span: its ids, name, times, status code and the few attributes
SGLang's spans carry (``KEPT_SPAN_ATTRIBUTES``); per resource, the attributes that
name a worker (``KEPT_RESOURCE_ATTRIBUTES``). Events and links are parsed (the C
parser does) but never turned into Python objects.

Hazards:
- The input is anyone's bytes: what does not parse, and a kept span whose trace id is
  not 16 bytes or whose span id is not 8, raises ``MalformedOtlp``, which the receivers
  answer with 400 (gRPC: INVALID_ARGUMENT), as a collector does.
- Text is protobuf's to decode (invalid UTF-8 in a string field fails the parse).
"""

from __future__ import annotations

from typing import NamedTuple

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

KEPT_SPAN_ATTRIBUTES = frozenset({"rid", "bootstrap_room", "host_id", "pid", "thread_label", "tp_rank"})
KEPT_RESOURCE_ATTRIBUTES = frozenset({"service.name", "service.instance.id", "host.name", "process.pid"})


class MalformedOtlp(ValueError):
    """The bytes are not an ``ExportTraceServiceRequest``; the message says why."""


class SpanFacts(NamedTuple):
    trace_id: int
    span_id: int
    parent_span_id: int  # 0 for a root span
    name: str
    start_ns: int
    end_ns: int
    attributes: dict  # the kept ones only
    status_code: int


class ResourceBatch(NamedTuple):
    resource: dict  # the kept resource attributes
    spans: list[SpanFacts]  # the kept spans
    received: int = 0  # every span of the resource, kept or not


def parse_export_request(data: bytes) -> ExportTraceServiceRequest:
    """protobuf's parse of one export request; raises ``MalformedOtlp``."""
    try:
        return ExportTraceServiceRequest.FromString(data)
    except (DecodeError, ValueError) as exc:
        raise MalformedOtlp(f"not an OTLP ExportTraceServiceRequest ({exc})") from None


def read_export_request(data: bytes) -> list[ResourceBatch]:
    """The resources of one request, each with every span whole; raises ``MalformedOtlp``.
    (The receivers read less of it: ``engine_spans.read_engine_request``.)"""
    request = parse_export_request(data)
    batches = []
    for resource_spans in request.resource_spans:
        kept, received = [], 0
        for scope_spans in resource_spans.scope_spans:
            spans = scope_spans.spans
            received += len(spans)
            kept.extend(span_facts(span, kept_attributes(span.attributes, KEPT_SPAN_ATTRIBUTES), span.status.code)
                        for span in spans)
        batches.append(ResourceBatch(kept_attributes(resource_spans.resource.attributes, KEPT_RESOURCE_ATTRIBUTES),
                                     kept, received))
    return batches


def count_spans(batches: list[ResourceBatch]) -> int:
    return sum(batch.received for batch in batches)


def span_facts(span, attributes: dict, status_code: int) -> SpanFacts:
    """A span's facts, with the attributes and status code given; raises ``MalformedOtlp``
    for ids of the wrong size."""
    trace_id, span_id, parent = span.trace_id, span.span_id, span.parent_span_id
    check_ids(span, trace_id, span_id, parent)
    return SpanFacts(int.from_bytes(trace_id, "big"), int.from_bytes(span_id, "big"),
                     int.from_bytes(parent, "big") if parent else 0, span.name, span.start_time_unix_nano,
                     span.end_time_unix_nano, attributes, status_code)


def check_ids(span, trace_id: bytes, span_id: bytes, parent: bytes) -> None:
    """Raises ``MalformedOtlp`` unless the ids are 16 bytes, 8 and 8 or none (a root span)."""
    if len(trace_id) != 16 or len(span_id) != 8 or len(parent) not in (0, 8):
        raise MalformedOtlp(f"span {span.name!r}: trace_id of {len(trace_id)} bytes, span_id of {len(span_id)}, "
                            f"parent_span_id of {len(parent)} (expected 16, 8 and 8 or none)")


def kept_attributes(key_values, kept: frozenset) -> dict:
    """Of ``key_values``, those named in ``kept`` with a scalar value."""
    out = {}
    for kv in key_values:
        if kv.key in kept:
            value = kv.value
            kind = value.WhichOneof("value")
            if kind in ("string_value", "int_value", "bool_value", "double_value"):
                out[kv.key] = getattr(value, kind)
    return out
