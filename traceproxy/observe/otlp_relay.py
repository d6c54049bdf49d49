"""Exporter process: an engine's encoded ``ExportTraceServiceRequest``, relayed as it came,
written where the proxy's own spans go when that is not a collector.

To a collector the bytes go as they are (``OtlpSink.export_raw``). The span file holds
OTLP/JSON lines (``otlp_json.py``): the request becomes one line, protobuf's JSON
mapping (``MessageToDict``: lowerCamelCase names in field-number order, enums as
integers, 64-bit integers as decimal strings, bytes as base64, fields at their default
left out, a set ``oneof`` member or sub-message always written), with the one exception
the Collector's file exporter makes and ``traceproxy diagnose`` reads: trace and span
ids as lowercase hex, not base64. Nothing else of the engine's spans is changed: the
line says what the engine said.

The line is read from the request's encoding field by field (``_wire_document``, the
span's fields in one loop) and written by orjson: protobuf's ``MessageToDict`` and
``json.dumps`` cost the exporter process four to five times as much a span, the largest
cost of relaying to a file. The request is still parsed by protobuf first, so one it
refuses is refused here too and the walk reads only well-formed bytes. What the walk
does not expect goes protobuf's way (``_reference``), the same document more slowly:
a field it does not know (from a newer OTLP, or a wire type it does not expect), a
sub-message sent twice (protobuf merges them), an ``AnyValue`` with two members.
``tests/test_otlp_relay.py`` compares the two routes.

Hazards:
- Fields are written in field-number order whatever their order on the wire (a span's
  ``flags``, field 16, after its ``status``); a field sent twice counts as its last.
- Attributes are read once per distinct encoding and their dicts shared between spans
  (``_attribute``): a document is written out, never changed.
- When the installed OTLP messages lack a field the walk writes (an older
  opentelemetry-proto), every request goes protobuf's way (``_WALK_KNOWS_THE_SCHEMA``),
  which leaves it out, as before.
"""

from __future__ import annotations

import base64
import struct

import orjson
from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue, ArrayValue, InstrumentationScope, KeyValue, KeyValueList,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from .otlp_json import as_int64, double_value
from .otlp_proto import read_varint

_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def line(payload: bytes) -> bytes:
    """One compact OTLP/JSON line in UTF-8, without its newline."""
    return orjson.dumps(document(payload))


def json_line(payload: bytes) -> str:
    """``line`` as text."""
    return line(payload).decode("utf-8")


def document(payload: bytes) -> dict:
    # Parsed first, though the walk reads the bytes: a request protobuf refuses (cut
    # short, text not UTF-8) is refused here too, and the walk can trust the encoding.
    request = ExportTraceServiceRequest.FromString(payload)
    if _WALK_KNOWS_THE_SCHEMA:
        try:
            return _wire_document(bytes(payload))
        except (_Unusual, IndexError, struct.error):
            pass
    return _reference(request)


def console_lines(payload: bytes) -> list[str]:
    """One short line per span, for the console exporter."""
    lines = []
    for resource_spans in document(payload).get("resourceSpans", ()):
        service = next((a["value"].get("stringValue", "") for a in resource_spans.get("resource", {}).get(
            "attributes", ()) if a.get("key") == "service.name"), "")
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                lines.append(f"span trace={span.get('traceId', '')} id={span.get('spanId', '')} "
                             f"parent={span.get('parentSpanId') or '-'} service={service!r} "
                             f"name={span.get('name', '')!r}")
    return lines


# ------------------------------------------------------------------ the wire walk
# Each function reads one message's fields from the encoding and writes them in field-number
# order, those at their default left out, as MessageToDict does (a field sent twice: the
# last counts). A sub-message is written when it was sent, even empty.


class _Unusual(Exception):
    """An encoding the walk leaves to protobuf's mapping: a field it does not know (or
    in a wire type it does not expect), a sub-message sent twice (protobuf merges the
    two), an ``AnyValue`` with more than one member."""


def _int32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value > 0x7FFFFFFF else value


def _messages(buf: bytes, pos: int, end: int, field_number: int, read) -> list:
    """The sub-messages of one repeated field, for a message that holds nothing else
    (ExportTraceServiceRequest, ArrayValue, KeyValueList)."""
    items = []
    while pos < end:
        key = buf[pos]
        pos += 1
        if key != field_number << 3 | 2:
            raise _Unusual
        size = buf[pos]
        pos += 1
        if size > 0x7F:
            size, pos = read_varint(buf, pos - 1)
        items.append(read(buf, pos, pos + size))
        pos += size
    return items


def _fields(buf: bytes, pos: int, end: int, expected: dict) -> dict:
    """A less frequent message's fields by number: ``expected`` maps each to its wire
    type and whether it repeats; a repeated field is a list of (start, stop)
    slices, a length-delimited one a (start, stop) slice, a number a number."""
    fields = {}
    while pos < end:
        key = buf[pos]
        pos += 1
        if key > 0x7F:
            key, pos = read_varint(buf, pos - 1)
        number, wire_type = key >> 3, key & 7
        if expected.get(number, (None,))[0] != wire_type:
            raise _Unusual
        if wire_type == 2:
            size = buf[pos]
            pos += 1
            if size > 0x7F:
                size, pos = read_varint(buf, pos - 1)
            value = (pos, pos + size)
            pos += size
        elif wire_type == 0:
            value = buf[pos]
            pos += 1
            if value > 0x7F:
                value, pos = read_varint(buf, pos - 1)
        elif wire_type == 1:
            (value,) = _FIXED64.unpack_from(buf, pos)
            pos += 8
        else:
            (value,) = _FIXED32.unpack_from(buf, pos)
            pos += 4
        if expected[number][1]:
            fields.setdefault(number, []).append(value)
        elif wire_type == 2 and expected[number][2] and number in fields:
            raise _Unusual  # a sub-message twice: merged by protobuf
        else:
            fields[number] = value
    return fields


_LEN, _VARINT, _I64, _I32 = 2, 0, 1, 5
#                      number: (wire type, repeats, is a sub-message)
_RESOURCE_SPANS = {1: (_LEN, False, True), 2: (_LEN, True, True), 3: (_LEN, False, False)}
_RESOURCE = {1: (_LEN, True, True), 2: (_VARINT, False, False)}
_SCOPE = {1: (_LEN, False, False), 2: (_LEN, False, False), 3: (_LEN, True, True), 4: (_VARINT, False, False)}
_EVENT = {1: (_I64, False, False), 2: (_LEN, False, False), 3: (_LEN, True, True), 4: (_VARINT, False, False)}
_LINK = {1: (_LEN, False, False), 2: (_LEN, False, False), 3: (_LEN, False, False), 4: (_LEN, True, True),
         5: (_VARINT, False, False), 6: (_I32, False, False)}
_STATUS = {2: (_LEN, False, False), 3: (_VARINT, False, False)}
_FIXED64, _FIXED32, _DOUBLE = struct.Struct("<Q"), struct.Struct("<I"), struct.Struct("<d")
_START_END = struct.Struct("<QxQ")  # a span's start, the end's key, its end


def _wire_document(buf: bytes) -> dict:
    resource_spans = _messages(buf, 0, len(buf), 1, _resource_spans)
    return {"resourceSpans": resource_spans} if resource_spans else {}


def _text(buf: bytes, where: tuple[int, int]) -> str:
    return buf[where[0]:where[1]].decode("utf-8")


def _resource_spans(buf: bytes, pos: int, end: int) -> dict:
    fields = _fields(buf, pos, end, _RESOURCE_SPANS)
    out = {}
    if 1 in fields:
        resource = _fields(buf, *fields[1], _RESOURCE)
        out["resource"] = _with_attributes(buf, {}, resource.get(1), resource.get(2))
    if 2 in fields:
        out["scopeSpans"] = [_scope_spans(buf, *where) for where in fields[2]]
    if (schema := fields.get(3)) and schema[1] > schema[0]:
        out["schemaUrl"] = _text(buf, schema)
    return out


def _scope_spans(buf: bytes, pos: int, end: int) -> dict:
    # Its own loop, not _fields: it holds the spans, hundreds to a request.
    scope = schema = None
    spans = []
    while pos < end:
        key = buf[pos]
        if key != 0x12 and key != 0x0A and key != 0x1A:
            raise _Unusual
        size = buf[pos + 1]
        if size < 0x80:
            pos += 2
        else:
            size, pos = read_varint(buf, pos + 1)
        after = pos + size
        if key == 0x12:  # 2
            spans.append(_span(buf, pos, after))
        elif key == 0x0A:  # 1
            if scope is not None:
                raise _Unusual  # merged by protobuf
            scope = (pos, after)
        else:  # 3
            schema = (pos, after)
        pos = after
    out = {}
    if scope is not None:
        fields = _fields(buf, *scope, _SCOPE)
        scope_out = {}
        for number, name in ((1, "name"), (2, "version")):
            if (where := fields.get(number)) and where[1] > where[0]:
                scope_out[name] = _text(buf, where)
        out["scope"] = _with_attributes(buf, scope_out, fields.get(3), fields.get(4))
    if spans:
        out["spans"] = spans
    if schema is not None and schema[1] > schema[0]:
        out["schemaUrl"] = _text(buf, schema)
    return out


def _with_attributes(buf: bytes, out: dict, attributes: list | None, dropped: int | None) -> dict:
    if attributes:
        out["attributes"] = [_key_value(buf, *where) for where in attributes]
    if dropped and (dropped := dropped & 0xFFFFFFFF):
        out["droppedAttributesCount"] = dropped
    return out


def _span(buf: bytes, pos: int, end: int) -> dict:
    # The hot loop: a request's spans are most of its bytes. Fields kept in locals and
    # told apart by their key's one byte (numbers below 16), the common ones first; a key
    # of more bytes is only the flags' (16) or a field the walk leaves to protobuf.
    trace_id = span_id = trace_state = parent_span_id = name = b""
    kind = start = stop = dropped_attributes = dropped_events = dropped_links = flags = 0
    attributes = events = links = status = None
    # As an SDK writes a child span: ids, parent and name, kind, start and end, each key
    # and size one byte; read at once, the fields after it by the loop.
    if end - pos >= 60 and buf[pos + 28:pos + 30] == b"\x22\x08" and buf[pos:pos + 2] == b"\x0a\x10" \
            and buf[pos + 18:pos + 20] == b"\x12\x08" and buf[pos + 38] == 0x2A and buf[pos + 39] < 0x80:
        after = pos + 40 + buf[pos + 39]
        if after + 20 <= end and buf[after] == 0x30 and buf[after + 1] < 0x80 and buf[after + 2] == 0x39 \
                and buf[after + 11] == 0x41:
            trace_id, span_id = buf[pos + 2:pos + 18], buf[pos + 20:pos + 28]
            parent_span_id, name = buf[pos + 30:pos + 38], buf[pos + 40:after]
            kind = buf[after + 1]
            start, stop = _START_END.unpack_from(buf, after + 3)
            pos = after + 20
    # An SDK ends a span with its status, most often empty, and its flags: taken as the
    # last of each, the loop stops before them (and gives up on another status or flags).
    # Were these bytes the end of another field, that field would run past the loop's end.
    flags_last = end - pos >= 8 and buf[end - 8:end - 4] == b"\x7a\x00\x85\x01"
    if flags_last:
        status = {}
        (flags,) = _FIXED32.unpack_from(buf, end - 4)
        end -= 8
    while pos < end:
        key = buf[pos]
        if key & 7 == 2 and key < 0x80:  # length-delimited
            size = buf[pos + 1]
            if size < 0x80:
                pos += 2
            else:
                size, pos = read_varint(buf, pos + 1)
            after = pos + size
            if key == 0x0A:  # 1
                trace_id = buf[pos:after]
            elif key == 0x12:  # 2
                span_id = buf[pos:after]
            elif key == 0x22:  # 4
                parent_span_id = buf[pos:after]
            elif key == 0x2A:  # 5
                name = buf[pos:after]
            elif key == 0x4A:  # 9
                if attributes is None:
                    attributes = []
                attributes.append(_attribute(buf, pos, after))
            elif key == 0x7A:  # 15
                if status is not None:
                    raise _Unusual
                status = _status(buf, pos, after) if size else {}
            elif key == 0x5A:  # 11
                if events is None:
                    events = []
                events.append(_event(buf, pos, after))
            elif key == 0x6A:  # 13
                if links is None:
                    links = []
                links.append(_link(buf, pos, after))
            elif key == 0x1A:  # 3
                trace_state = buf[pos:after]
            else:
                raise _Unusual
            pos = after
        elif key == 0x39:  # 7, fixed64; most often 8 (fixed64) right after it
            if buf[pos + 9:pos + 10] == b"\x41":
                start, stop = _START_END.unpack_from(buf, pos + 1)
                pos += 18
            else:
                (start,) = _FIXED64.unpack_from(buf, pos + 1)
                pos += 9
        elif key == 0x41:  # 8, fixed64
            (stop,) = _FIXED64.unpack_from(buf, pos + 1)
            pos += 9
        elif key == 0x30 or key == 0x50 or key == 0x60 or key == 0x70:  # 6, 10, 12, 14: varints
            value = buf[pos + 1]
            if value < 0x80:
                pos += 2
            else:
                value, pos = read_varint(buf, pos + 1)
            if key == 0x30:
                kind = value
            elif key == 0x50:
                dropped_attributes = value
            elif key == 0x60:
                dropped_events = value
            else:
                dropped_links = value
        elif key == 0x85 and buf[pos + 1] == 0x01 and not flags_last:  # 16, fixed32
            (flags,) = _FIXED32.unpack_from(buf, pos + 2)
            pos += 6
        else:
            raise _Unusual
    if pos != end:
        raise _Unusual
    out = {}
    if trace_id:
        out["traceId"] = trace_id.hex()
    if span_id:
        out["spanId"] = span_id.hex()
    if trace_state:
        out["traceState"] = trace_state.decode("utf-8")
    if parent_span_id:
        out["parentSpanId"] = parent_span_id.hex()
    if name:
        out["name"] = name.decode("utf-8")
    if kind and (kind := _int32(kind)):
        out["kind"] = kind
    if start:
        out["startTimeUnixNano"] = str(start)
    if stop:
        out["endTimeUnixNano"] = str(stop)
    if attributes:
        out["attributes"] = attributes
    if dropped_attributes and (dropped_attributes := dropped_attributes & 0xFFFFFFFF):
        out["droppedAttributesCount"] = dropped_attributes
    if events:
        out["events"] = events
    if dropped_events and (dropped_events := dropped_events & 0xFFFFFFFF):
        out["droppedEventsCount"] = dropped_events
    if links:
        out["links"] = links
    if dropped_links and (dropped_links := dropped_links & 0xFFFFFFFF):
        out["droppedLinksCount"] = dropped_links
    if status is not None:
        out["status"] = status
    if flags:
        out["flags"] = flags
    return out


def _event(buf: bytes, pos: int, end: int) -> dict:
    fields = _fields(buf, pos, end, _EVENT)
    out = {}
    if time := fields.get(1):
        out["timeUnixNano"] = str(time)
    if (name := fields.get(2)) and name[1] > name[0]:
        out["name"] = _text(buf, name)
    return _with_attributes(buf, out, fields.get(3), fields.get(4))


def _link(buf: bytes, pos: int, end: int) -> dict:
    # As common as spans (an engine's stage links to the one before): the ids and flags
    # as an SDK writes them read at once, anything else the slow way.
    if end - pos == 33 and buf[pos:pos + 2] == b"\x0a\x10" and buf[pos + 18:pos + 20] == b"\x12\x08" \
            and buf[pos + 28] == 0x35:
        out = {"traceId": buf[pos + 2:pos + 18].hex(), "spanId": buf[pos + 20:pos + 28].hex()}
        (flags,) = _FIXED32.unpack_from(buf, pos + 29)
        if flags:
            out["flags"] = flags
        return out
    fields = _fields(buf, pos, end, _LINK)
    out = {}
    for number, name in ((1, "traceId"), (2, "spanId")):
        if (where := fields.get(number)) and where[1] > where[0]:
            out[name] = buf[where[0]:where[1]].hex()
    if (trace_state := fields.get(3)) and trace_state[1] > trace_state[0]:
        out["traceState"] = _text(buf, trace_state)
    _with_attributes(buf, out, fields.get(4), fields.get(5))
    if flags := fields.get(6):
        out["flags"] = flags
    return out


def _status(buf: bytes, pos: int, end: int) -> dict:
    fields = _fields(buf, pos, end, _STATUS)
    out = {}
    if (message := fields.get(2)) and message[1] > message[0]:
        out["message"] = _text(buf, message)
    if (code := fields.get(3)) and (code := _int32(code)):
        out["code"] = code
    return out


def _attribute(buf: bytes, pos: int, end: int) -> dict:
    """A span's attribute, read once for each encoding seen lately: an engine repeats
    most of them span after span (its host, its pid, a stage's batch size)."""
    if end - pos > _SEEN_ATTRIBUTE_BYTES:
        return _key_value(buf, pos, end)
    encoded = buf[pos:end]
    attribute = _SEEN_ATTRIBUTES.get(encoded)
    if attribute is None:
        attribute = _key_value(encoded, 0, len(encoded))
        if len(_SEEN_ATTRIBUTES) >= _SEEN_ATTRIBUTES_HELD:
            _SEEN_ATTRIBUTES.clear()
        _SEEN_ATTRIBUTES[encoded] = attribute
    return attribute


# Shared: the same dict stands in every span with that attribute, so a document is
# written out (orjson), never changed.
_SEEN_ATTRIBUTES: dict[bytes, dict] = {}
_SEEN_ATTRIBUTES_HELD, _SEEN_ATTRIBUTE_BYTES = 4096, 256


def _key_value(buf: bytes, pos: int, end: int) -> dict:
    # Most often: the key (field 1), then the value (field 2), one byte of size each.
    out = {}
    value = None
    while pos < end:
        key = buf[pos]
        if key != 0x0A and key != 0x12:  # neither a key nor a value
            raise _Unusual
        size = buf[pos + 1]
        pos += 2
        if size > 0x7F:
            size, pos = read_varint(buf, pos - 1)
        after = pos + size
        if key == 0x0A:
            if size:
                out["key"] = buf[pos:after].decode("utf-8")
            else:
                out.pop("key", None)
        elif value is None:
            value = _any_value(buf, pos, after)
        else:  # a value twice: merged by protobuf
            raise _Unusual
        pos = after
    if value is not None:
        out["value"] = value
    return out


def _any_value(buf: bytes, pos: int, end: int) -> dict:
    if pos == end:
        return {}
    key = buf[pos]
    pos += 1
    if key & 7 == 2:
        size = buf[pos]
        pos += 1
        if size > 0x7F:
            size, pos = read_varint(buf, pos - 1)
        after = pos + size
        if after != end:
            raise _Unusual  # more than one member
        if key == 0x0A:
            return {"stringValue": buf[pos:after].decode("utf-8")}
        if key == 0x2A:
            return {"arrayValue": _values(buf, pos, after, _any_value)}
        if key == 0x32:
            return {"kvlistValue": _values(buf, pos, after, _key_value)}
        if key == 0x3A:
            return {"bytesValue": base64.b64encode(buf[pos:after]).decode("ascii")}
        raise _Unusual
    if key == 0x18 or key == 0x10:
        value = buf[pos]
        pos += 1
        if value > 0x7F:
            value, pos = read_varint(buf, pos - 1)
        if pos != end:
            raise _Unusual
        value &= 0xFFFFFFFFFFFFFFFF  # protobuf keeps a varint's low 64 bits, for a bool too
        if key == 0x10:
            return {"boolValue": value != 0}
        return {"intValue": str(as_int64(value))}
    if key == 0x21 and pos + 8 == end:
        (value,) = _DOUBLE.unpack_from(buf, pos)
        return {"doubleValue": double_value(value)}
    raise _Unusual


def _values(buf: bytes, pos: int, end: int, read) -> dict:
    values = _messages(buf, pos, end, 1, read)
    return {"values": values} if values else {}


# The fields the walk writes, by message and number: an installed message without one of
# them (an older opentelemetry-proto) sends every request protobuf's way, which would leave
# it out. Fields the walk does not know make it give the request to protobuf (_Unusual).
_WALKED_FIELDS = {
    ResourceSpans: {1, 2, 3}, Resource: {1, 2}, ScopeSpans: {1, 2, 3}, InstrumentationScope: {1, 2, 3, 4},
    Span: set(range(1, 17)), Span.Event: {1, 2, 3, 4}, Span.Link: {1, 2, 3, 4, 5, 6}, Status: {2, 3},
    KeyValue: {1, 2}, AnyValue: {1, 2, 3, 4, 5, 6, 7}, ArrayValue: {1}, KeyValueList: {1},
}
_WALK_KNOWS_THE_SCHEMA = all(numbers <= {field.number for field in message.DESCRIPTOR.fields}
                             for message, numbers in _WALKED_FIELDS.items())


def _reference(request) -> dict:
    out = MessageToDict(request, use_integers_for_enums=True)
    for resource_spans in out.get("resourceSpans", ()):
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                _hex_ids(span)
                for link in span.get("links", ()):
                    _hex_ids(link)
    return out


def _hex_ids(item: dict) -> None:
    for key in _ID_FIELDS:
        if key in item:
            item[key] = base64.b64decode(item[key]).hex()
