"""Exporter process: ``SpanData`` -> the OTLP protobuf wire format, written directly.

Why not the SDK's encoder: building ``ReadableSpan`` objects and then protobuf
message objects costs about 180 µs per proxied request (two spans, ~25 attributes,
~15 events), more than proxying the request itself, and the exporter process
shares the proxy's cores. Written straight as bytes, with the repeating parts
cached, the same request costs a small fraction of that.

What is written is an ``ExportTraceServiceRequest`` (opentelemetry-proto,
``collector/trace/v1``): one ResourceSpans holding one ScopeSpans (``traceproxy``
and its version) holding the spans, both naming the semantic conventions the
resource and the spans follow (``schema_url``, ``semconv.SCHEMA_URL``). The field numbers below are the proto's;
``tests/test_otlp_proto.py`` decodes the output with the official generated
classes and compares it with the SDK's own encoding of the same spans, so a wrong
number or wire type cannot pass unnoticed.

Hazards:
- Strings must be valid UTF-8 or a collector rejects the whole batch: text is
  encoded with ``errors="replace"`` (a lone surrogate becomes ``?``).
- Attribute values: ``bool`` is tested before ``int`` (a bool is an int in Python).
  A tuple or list is an ``array_value`` of its items (``gen_ai.response.finish_reasons``
  is a string array). Other types (None, bytes) are not produced by ``spans.py`` and
  are written as their ``str()``, never dropped silently.
- The cache of encoded str and int attributes is keyed by (key, value) and bounded:
  high-cardinality keys (request ids, error messages) bypass it, and it is emptied
  when it reaches ``CACHE_LIMIT`` entries, so memory stays bounded whatever arrives.
  Values that change every request (ids, sizes) churn through it; a miss costs
  little more than encoding without a cache.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

from . import semconv as sc
from .spandata import SpanData, SpanEvent

CACHE_LIMIT = 8192
# Keys whose values are (nearly) unique per request: caching them would only churn.
UNCACHED_KEYS = frozenset({
    sc.REQUEST_ID, sc.GEN_AI_RESPONSE_ID, sc.ERROR_MESSAGE, sc.REJECTED_TRACEPARENT, sc.URL_QUERY, sc.URL_FULL,
})

# Span.flags (fixed32): bits 0-7 are the W3C trace flags; bit 8 says whether bit 9
# (the parent is remote) is known. The SDK's encoder sets bits 8 and 9 only.
FLAG_SAMPLED = 0x01
FLAG_HAS_IS_REMOTE = 0x100
FLAG_IS_REMOTE = 0x200

_fixed64 = struct.Struct("<Q").pack
_fixed32 = struct.Struct("<I").pack
_double = struct.Struct("<d").pack


def varint(value: int) -> bytes:
    """Unsigned LEB128; a negative int64 is written as its 64-bit two's complement."""
    if value < 0:
        value += 1 << 64
    if value < 0x80:
        return _SMALL_VARINTS[value]
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL_VARINTS = [bytes((n,)) for n in range(0x80)]


def read_varint(data: bytes, position: int) -> tuple[int, int]:
    """The varint at ``position`` and the position after it; IndexError past the end of
    ``data`` or past ten bytes (a varint holds at most 64 bits; protobuf keeps the low 64)."""
    value = shift = 0
    while True:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")


def length_delimited(tag: bytes, payload: bytes) -> bytes:
    return tag + varint(len(payload)) + payload


# Tags: (field number << 3) | wire type (0 varint, 1 fixed64, 2 length-delimited, 5 fixed32).
# ExportTraceServiceRequest.resource_spans = 1; ResourceSpans.resource = 1, .scope_spans = 2;
# Resource.attributes = 1; ScopeSpans.scope = 1, .spans = 2; InstrumentationScope.name = 1,
# .version = 2; KeyValue.key = 1, .value = 2; AnyValue string = 1, bool = 2, int = 3, double = 4,
# array = 5 (ArrayValue.values = 1, each an AnyValue).
T_RESOURCE_SPANS = T_RESOURCE = T_RESOURCE_ATTRIBUTE = T_SCOPE = T_SCOPE_NAME = T_KEY = b"\x0a"
T_SCOPE_SPANS = T_SPANS = T_SCOPE_VERSION = T_VALUE = b"\x12"
T_STRING, T_BOOL, T_INT, T_DOUBLE, T_ARRAY, T_ARRAY_ITEM = b"\x0a", b"\x10", b"\x18", b"\x21", b"\x2a", b"\x0a"
# Span: trace_id = 1, span_id = 2, trace_state = 3, parent_span_id = 4, name = 5, kind = 6
# (enum), start = 7 and end = 8 (fixed64), attributes = 9, events = 11, status = 15,
# flags = 16 (fixed32). Event: time_unix_nano = 1 (fixed64), name = 2, attributes = 3.
# Status: message = 2, code = 3 (enum).
T_TRACE_ID, T_SPAN_ID, T_TRACE_STATE, T_PARENT_SPAN_ID = b"\x0a\x10", b"\x12\x08", b"\x1a", b"\x22\x08"
T_NAME, T_KIND, T_START, T_END = b"\x2a", b"\x30", b"\x39", b"\x41"
T_SPAN_ATTRIBUTE, T_EVENT, T_STATUS, T_FLAGS = b"\x4a", b"\x5a", b"\x7a", b"\x85\x01"
T_EVENT_TIME, T_EVENT_NAME, T_EVENT_ATTRIBUTE = b"\x09", b"\x12", b"\x1a"
T_STATUS_MESSAGE, T_STATUS_CODE = b"\x12", b"\x18"
# ResourceSpans.schema_url = 3 and ScopeSpans.schema_url = 3, after the resource's or the scope's spans.
T_SCHEMA_URL = b"\x1a"


def any_value(value) -> bytes:
    if isinstance(value, bool):
        return T_BOOL + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        return T_INT + varint(value)
    if isinstance(value, float):
        return T_DOUBLE + _double(value)
    if isinstance(value, (tuple, list)):
        return length_delimited(T_ARRAY, b"".join(length_delimited(T_ARRAY_ITEM, any_value(item)) for item in value))
    if not isinstance(value, str):
        value = str(value)
    return length_delimited(T_STRING, value.encode("utf-8", "replace"))


def key_value(key: str, value) -> bytes:
    """A KeyValue message with its length prefix (the caller adds the field's tag)."""
    return _key_value(length_delimited(T_KEY, key.encode()), value)


def _key_value(key_field: bytes, value) -> bytes:
    value_field = any_value(value)
    size = len(value_field)
    body = key_field + T_VALUE + (_SMALL_VARINTS[size] if size < 0x80 else varint(size)) + value_field
    size = len(body)
    return (_SMALL_VARINTS[size] if size < 0x80 else varint(size)) + body


def attributes(tag: bytes, attrs: Mapping) -> bytes:
    """Uncached: for the resource and for event attributes (rare: stalls only)."""
    return b"".join(tag + key_value(key, value) for key, value in attrs.items())


class OtlpEncoder:
    """Encodes batches of ``SpanData`` into one ``ExportTraceServiceRequest`` each.

    ``resource_attributes``: the Resource's attributes (service.name and the rest),
    encoded once here. Not thread-safe (the exporter process has one thread)."""

    def __init__(self, resource_attributes: Mapping, scope_name: str, scope_version: str,
                 schema_url: str = sc.SCHEMA_URL) -> None:
        resource = length_delimited(T_RESOURCE, attributes(T_RESOURCE_ATTRIBUTE, resource_attributes))
        scope = length_delimited(
            T_SCOPE, length_delimited(T_SCOPE_NAME, scope_name.encode())
            + length_delimited(T_SCOPE_VERSION, scope_version.encode()))
        self._resource_field = resource
        self._scope_field = scope
        # The same URL on both: the resource's attributes and the spans' follow one release.
        self._schema_field = length_delimited(T_SCHEMA_URL, schema_url.encode()) if schema_url else b""
        self._values: dict[tuple[str, str | int], bytes] = {}
        self._key_fields: dict[str, bytes] = {}  # keys are ours: a fixed, small set
        self._names: dict[str, bytes] = {}
        self._events: dict[str, tuple[bytes, bytes]] = {}

    def encode(self, spans: Iterable[SpanData]) -> bytes:
        span_fields = b"".join(length_delimited(T_SPANS, self.span(span)) for span in spans)
        scope_spans = length_delimited(T_SCOPE_SPANS, self._scope_field + span_fields + self._schema_field)
        return length_delimited(T_RESOURCE_SPANS, self._resource_field + scope_spans + self._schema_field)

    def span(self, span: SpanData) -> bytes:
        flags = FLAG_HAS_IS_REMOTE | (FLAG_SAMPLED if span.sampled else 0)
        parts = [T_TRACE_ID, span.trace_id.to_bytes(16, "big"), T_SPAN_ID, span.span_id.to_bytes(8, "big")]
        if span.trace_state:
            parts.append(length_delimited(T_TRACE_STATE, span.trace_state.encode()))
        if span.parent_span_id:
            parts += (T_PARENT_SPAN_ID, span.parent_span_id.to_bytes(8, "big"))
            if span.parent_is_remote:
                flags |= FLAG_IS_REMOTE
        parts += (self._name(span.name), T_KIND, varint(span.kind),
                  T_START, _fixed64(span.start_unix_ns), T_END, _fixed64(span.end_unix_ns))
        self._span_attributes(span.attributes, parts)
        for event in span.events:
            parts.append(self._event(event))
        parts += (self._status(span.status_code, span.status_message), T_FLAGS, _fixed32(flags))
        return b"".join(parts)

    def _span_attributes(self, attrs: Mapping, parts: list) -> None:
        cache = self._values
        for key, value in attrs.items():
            kind = type(value)
            # str and int values share one cache: no str equals an int. Not bools or
            # floats: True == 1 and 1.0 == 1 would find an int's encoding.
            if (kind is str or kind is int) and key not in UNCACHED_KEYS:
                encoded = cache.get((key, value))
                if encoded is None:
                    if len(cache) >= CACHE_LIMIT:
                        cache.clear()
                    encoded = cache[key, value] = _key_value(self._key_field(key), value)
            else:
                encoded = _key_value(self._key_field(key), value)
            parts += (T_SPAN_ATTRIBUTE, encoded)

    def _key_field(self, key: str) -> bytes:
        field = self._key_fields.get(key)
        if field is None:
            field = self._key_fields[key] = length_delimited(T_KEY, key.encode())
        return field

    def _name(self, name: str) -> bytes:
        encoded = self._names.get(name)
        if encoded is None:
            if len(self._names) >= CACHE_LIMIT:
                self._names.clear()
            encoded = self._names[name] = length_delimited(T_NAME, name.encode())
        return encoded

    def _event(self, event: SpanEvent) -> bytes:
        if event.attributes:
            body = (T_EVENT_TIME + _fixed64(event.time_unix_ns) + length_delimited(T_EVENT_NAME, event.name.encode())
                    + attributes(T_EVENT_ATTRIBUTE, event.attributes))
            return length_delimited(T_EVENT, body)
        # Without attributes an event's length depends only on its name: cache the
        # bytes before and after the timestamp.
        around = self._events.get(event.name)
        if around is None:
            name_field = length_delimited(T_EVENT_NAME, event.name.encode())
            around = (T_EVENT + varint(9 + len(name_field)) + T_EVENT_TIME, name_field)
            if len(self._events) < CACHE_LIMIT:
                self._events[event.name] = around
        return around[0] + _fixed64(event.time_unix_ns) + around[1]

    @staticmethod
    def _status(code: int, message: str) -> bytes:
        body = b""
        if message:
            body += length_delimited(T_STATUS_MESSAGE, message.encode("utf-8", "replace"))
        if code:
            body += T_STATUS_CODE + varint(code)
        return length_delimited(T_STATUS, body)
