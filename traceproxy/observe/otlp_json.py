"""Exporter process: ``SpanData`` -> one OTLP/JSON ``ExportTraceServiceRequest`` line.

OTLP/JSON is protobuf's canonical JSON mapping of the OTLP messages, with the
exceptions that the Collector's file exporter writes and its ``otlpjson`` receiver
reads:

- field names in lowerCamelCase, in field-number order;
- trace and span ids as lowercase hex (protobuf's own mapping would make them base64);
- enums (span kind, status code) as integers;
- 64-bit integers (times, int attribute values) as decimal strings; 32-bit ones
  (``flags``) as numbers;
- a field at its default (an empty string, a zero) is left out, except inside an
  ``AnyValue``, whose one value is always written (``{"intValue": "0"}``).

Written straight from the spans, not through protobuf messages: the document is
the one ``MessageToDict`` makes of the protobuf encoding (``otlp_proto.py``) of the
same spans, key for key and in the same order, so readers of the file (``traceproxy
diagnose``, the Collector) read the same requests as before.
``tests/test_otlp_json.py`` compares the two.

Most of a span's attributes repeat from request to request; ``line`` writes those once
and reuses the bytes (``RepeatedAttributes``, a third less of the exporter's work per
kept request), so its lines are the same bytes as ``document`` written out.
``line`` writes each span's document with orjson as soon as it is made and appends the
bytes to the line: the batch's document is never held whole (a batch of 512 requests' spans as
dicts was tens of MB at the exporter's peak), and orjson writes in about a tenth of
``json.dumps``' time. Its bytes differ from ``json.dumps``' only where JSON allows:
text outside ASCII is written as UTF-8 rather than ``\\u`` escapes, and an exponent
has no ``+``.

Hazards, mirroring ``otlp_proto.py``:
- Text that is not valid UTF-8 (a lone surrogate) becomes ``?``, as the protobuf
  encoding makes it; a line must stay readable.
- ``bool`` is tested before ``int``; an int outside int64 wraps as protobuf would
  read it back; other odd values are written as their ``str()``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import orjson

from . import semconv as sc
from .otlp_proto import FLAG_HAS_IS_REMOTE, FLAG_IS_REMOTE, FLAG_SAMPLED, UNCACHED_KEYS
from .spandata import SpanData, SpanEvent

_INT64_SPAN = 1 << 64
_INT64_MAX = (1 << 63) - 1
_NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


class OtlpJsonEncoder:
    """Resource and scope are built once; ``line`` makes one document per batch."""

    def __init__(self, resource_attributes: Mapping, scope_name: str, scope_version: str,
                 schema_url: str = sc.SCHEMA_URL) -> None:
        self._resource = {"attributes": key_values(resource_attributes)} if resource_attributes else {}
        self._scope = _without_defaults({"name": text(scope_name), "version": text(scope_version)})
        # On the resource's spans and the scope's alike, after their spans (field 3 of each).
        self._schema = {"schemaUrl": text(schema_url)} if schema_url else {}
        # The line around the spans, written once: what document() makes, cut where the spans go.
        head = orjson.dumps(self._document([0]))
        self._head, self._tail = head.split(b'"spans":[0]')
        self._empty = orjson.dumps(self.document(()))
        self._attributes = RepeatedAttributes()

    def document(self, spans: Iterable[SpanData]) -> dict:
        return self._document([span_document(span) for span in spans])

    def _document(self, span_documents: list) -> dict:
        scope_spans = {"scope": self._scope}
        if span_documents:
            scope_spans["spans"] = span_documents
        return {"resourceSpans": [{"resource": self._resource, "scopeSpans": [scope_spans | self._schema]}
                                  | self._schema]}

    def line(self, spans: Iterable[SpanData]) -> bytes:
        """A compact OTLP/JSON line in UTF-8, without its newline: ``document`` written out."""
        # Each span's bytes are copied into one buffer as soon as they are written: kept
        # alive one object per span until a join, orjson's output costs several times as
        # much to make (a fresh heap block for each).
        line = bytearray(self._head)
        line += b'"spans":['
        without_spans = len(line)
        attributes = self._attributes.key_values
        for span in spans:
            line += orjson.dumps(span_document(span, attributes))
            line += b","
        if len(line) == without_spans:
            return self._empty
        line[-1:] = b"]"
        line += self._tail
        return bytes(line)


def span_document(span: SpanData, attributes: "Callable[[Mapping], list] | None" = None) -> dict:
    """``attributes``: how its attributes are written (``key_values`` unless given)."""
    write = attributes or key_values
    flags = FLAG_HAS_IS_REMOTE | (FLAG_SAMPLED if span.sampled else 0)
    out = {"traceId": "%032x" % span.trace_id, "spanId": "%016x" % span.span_id}
    if span.trace_state:
        out["traceState"] = text(span.trace_state)
    if span.parent_span_id:
        out["parentSpanId"] = "%016x" % span.parent_span_id
        if span.parent_is_remote:
            flags |= FLAG_IS_REMOTE
    if span.name:
        out["name"] = text(span.name)
    if span.kind:
        out["kind"] = int(span.kind)
    if span.start_unix_ns:
        out["startTimeUnixNano"] = str(int(span.start_unix_ns))
    if span.end_unix_ns:
        out["endTimeUnixNano"] = str(int(span.end_unix_ns))
    if span.attributes:
        out["attributes"] = write(span.attributes)
    if span.events:
        out["events"] = [event_document(event, write) for event in span.events]
    status = {}
    if span.status_message:
        status["message"] = text(span.status_message)
    if span.status_code:
        status["code"] = int(span.status_code)
    out["status"] = status  # always written, like the protobuf encoding's, if empty
    out["flags"] = flags
    return out


def event_document(event: SpanEvent, attributes: "Callable[[Mapping], list] | None" = None) -> dict:
    out = {}
    if event.time_unix_ns:
        out["timeUnixNano"] = str(int(event.time_unix_ns))
    if event.name:
        out["name"] = text(event.name)
    if event.attributes:
        out["attributes"] = (attributes or key_values)(event.attributes)
    return out


def key_values(attributes: Mapping) -> list[dict]:
    return [_key_value(key, value) for key, value in attributes.items()]


class RepeatedAttributes:
    """``key_values`` for the span file's lines, with the attributes that repeat from request
    to request (the method, the route, the addresses, the model, the outcome: most of a
    span's) written once and then reused as they were written (``orjson.Fragment``).

    A key's values are kept as they come, up to ``DISTINCT`` of them; a key that brings more
    (an id, a client port, a sequence number) is one whose values do not repeat, and from
    then on is written each time and never kept. Keying by the attribute's name, not by
    sighting: keeping every value until it is seen again held thousands of one-off values
    alive among each batch's short-lived objects, which pinned the allocator's arenas (the
    exporter grew from 25 to 34 MB over four S1 runs). The keys are the spans' own, so what
    is kept is bounded by them. Only text, integers and booleans are kept (their type is
    part of the identity: ``True == 1``); a timing never repeats."""

    DISTINCT = 16

    def __init__(self) -> None:
        self._written: dict[tuple, orjson.Fragment] = {}
        self._kept_per_key: dict[str, int] = {}
        # Keys past DISTINCT values; from the start, those the protobuf encoder knows never
        # repeat (the request id, the response id, ...), which need no learning.
        self._varied: set[str] = set(UNCACHED_KEYS)

    def key_values(self, attributes: Mapping) -> list:
        out = []
        written, varied = self._written, self._varied
        for key, value in attributes.items():
            kind = type(value)
            if (kind is not str and kind is not int and kind is not bool) or key in varied:
                out.append(_key_value(key, value))
                continue
            identity = (key, kind, value)
            fragment = written.get(identity)
            if fragment is None:
                fragment = self._keep(key, identity, _key_value(key, value))
            out.append(fragment)
        return out

    def _keep(self, key: str, identity: tuple, document: dict):
        """The document, kept written when its key has room for another value; else as it is."""
        kept = self._kept_per_key.get(key, 0)
        if kept >= self.DISTINCT:
            self._varied.add(key)  # and its values kept so far are read no more
            for stale in [identity for identity in self._written if identity[0] == key]:
                del self._written[stale]
            return document
        self._kept_per_key[key] = kept + 1
        fragment = self._written[identity] = orjson.Fragment(orjson.dumps(document))
        return fragment


def _key_value(key: str, value) -> dict:
    if key:
        return {"key": text(key), "value": any_value(value)}
    return {"value": any_value(value)}


def any_value(value) -> dict:
    if type(value) is str:  # most attributes: tested first
        return {"stringValue": value if value.isascii() else text(value)}
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(as_int64(int(value)))}
    if isinstance(value, float):
        return {"doubleValue": double_value(value)}
    if isinstance(value, (tuple, list)):
        items = [any_value(item) for item in value]
        return {"arrayValue": {"values": items} if items else {}}
    if not isinstance(value, str):
        value = str(value)
    return {"stringValue": text(value)}


def text(value: str) -> str:
    if value.isascii():
        return value
    return value.encode("utf-8", "replace").decode("utf-8")


def as_int64(value: int) -> int:
    """What an int64 field reads back: the low 64 bits, two's complement."""
    if -_INT64_MAX - 1 <= value <= _INT64_MAX:
        return value
    value %= _INT64_SPAN
    return value - _INT64_SPAN if value > _INT64_MAX else value


def double_value(value: float):
    if math.isnan(value):
        return "NaN"
    return _NON_FINITE.get(value, float(value))


def _without_defaults(fields: dict) -> dict:
    return {key: value for key, value in fields.items() if value}
