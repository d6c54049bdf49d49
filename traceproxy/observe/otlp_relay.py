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

The document is built by walking the parsed messages field by field (``_span`` and the
rest), not by ``MessageToDict``, whose descriptor-driven walk cost the exporter process
ten times as much a span (it was the largest cost of relaying to a file).
``reference_document`` is that route, kept for what the walk does not know and for
``tests/test_otlp_relay.py``, which compares the two.

Hazards:
- The walk knows the OTLP messages' fields by name, in field-number order (a span's
  ``flags``, field 16, comes after ``status``). When the installed OTLP messages have a
  field it does not know (a newer opentelemetry-proto), every request takes the
  reference route (``_WALK_KNOWS_THE_SCHEMA``), so nothing is left out silently.
- Fields on the wire that the installed messages do not know are left out by both.
"""

from __future__ import annotations

import base64
import math

import orjson
from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue, ArrayValue, InstrumentationScope, KeyValue, KeyValueList,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def line(payload: bytes) -> bytes:
    """One compact OTLP/JSON line in UTF-8, without its newline."""
    return orjson.dumps(document(payload))


def json_line(payload: bytes) -> str:
    """``line`` as text."""
    return line(payload).decode("utf-8")


def document(payload: bytes) -> dict:
    request = ExportTraceServiceRequest.FromString(payload)
    if not _WALK_KNOWS_THE_SCHEMA:
        return _reference(request)
    resource_spans = [_resource_spans(item) for item in request.resource_spans]
    if None in resource_spans:  # something only the reference writes (a resource's entity refs)
        return _reference(request)
    return {"resourceSpans": resource_spans} if resource_spans else {}


def reference_document(payload: bytes) -> dict:
    """``document`` through protobuf's own JSON mapping: the slow route, the same document."""
    return _reference(ExportTraceServiceRequest.FromString(payload))


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


# ------------------------------------------------------------------ the walk
# Each function writes one message's fields in field-number order, leaving out those at
# their default, as MessageToDict does. HasField is asked only of sub-messages, whose
# presence (set, even if empty) the mapping writes.

def _resource_spans(item) -> dict | None:
    out = {}
    if item.HasField("resource"):
        resource = item.resource
        if len(resource.entity_refs):
            return None
        out["resource"] = _with_attributes({}, resource.attributes, resource.dropped_attributes_count)
    if item.scope_spans:
        out["scopeSpans"] = [_scope_spans(scope_spans) for scope_spans in item.scope_spans]
    if item.schema_url:
        out["schemaUrl"] = item.schema_url
    return out


def _scope_spans(item) -> dict:
    out = {}
    if item.HasField("scope"):
        scope = item.scope
        fields = {}
        if scope.name:
            fields["name"] = scope.name
        if scope.version:
            fields["version"] = scope.version
        out["scope"] = _with_attributes(fields, scope.attributes, scope.dropped_attributes_count)
    if item.spans:
        out["spans"] = [_span(span) for span in item.spans]
    if item.schema_url:
        out["schemaUrl"] = item.schema_url
    return out


def _span(span) -> dict:
    out = {}
    if value := span.trace_id:
        out["traceId"] = value.hex()
    if value := span.span_id:
        out["spanId"] = value.hex()
    if value := span.trace_state:
        out["traceState"] = value
    if value := span.parent_span_id:
        out["parentSpanId"] = value.hex()
    if value := span.name:
        out["name"] = value
    if value := span.kind:
        out["kind"] = value
    if value := span.start_time_unix_nano:
        out["startTimeUnixNano"] = str(value)
    if value := span.end_time_unix_nano:
        out["endTimeUnixNano"] = str(value)
    if value := span.attributes:
        out["attributes"] = _key_values(value)
    if value := span.dropped_attributes_count:
        out["droppedAttributesCount"] = value
    if value := span.events:
        out["events"] = [_event(event) for event in value]
    if value := span.dropped_events_count:
        out["droppedEventsCount"] = value
    if value := span.links:
        out["links"] = [_link(link) for link in value]
    if value := span.dropped_links_count:
        out["droppedLinksCount"] = value
    if span.HasField("status"):
        out["status"] = _status(span.status)
    if value := span.flags:
        out["flags"] = value
    return out


def _event(event) -> dict:
    out = {}
    if value := event.time_unix_nano:
        out["timeUnixNano"] = str(value)
    if value := event.name:
        out["name"] = value
    return _with_attributes(out, event.attributes, event.dropped_attributes_count)


def _link(link) -> dict:
    out = {}
    if value := link.trace_id:
        out["traceId"] = value.hex()
    if value := link.span_id:
        out["spanId"] = value.hex()
    if value := link.trace_state:
        out["traceState"] = value
    _with_attributes(out, link.attributes, link.dropped_attributes_count)
    if value := link.flags:
        out["flags"] = value
    return out


def _status(status) -> dict:
    out = {}
    if value := status.message:
        out["message"] = value
    if value := status.code:
        out["code"] = value
    return out


def _with_attributes(out: dict, attributes, dropped: int) -> dict:
    if attributes:
        out["attributes"] = _key_values(attributes)
    if dropped:
        out["droppedAttributesCount"] = dropped
    return out


def _key_values(attributes) -> list[dict]:
    return [_key_value(kv) for kv in attributes]


def _key_value(kv) -> dict:
    out = {"key": kv.key} if kv.key else {}
    if kv.HasField("value"):
        out["value"] = _any_value(kv.value)
    if _HAS_KEY_STRINDEX and kv.key_strindex:
        out["keyStrindex"] = kv.key_strindex
    return out


def _any_value(value) -> dict:
    which = value.WhichOneof("value")
    if which == "string_value":  # most attributes: tested first
        return {"stringValue": value.string_value}
    if which is None:
        return {}
    json_name, convert = _ANY_VALUE[which]
    return {json_name: convert(getattr(value, which))}


def _int64(value: int) -> str:
    return str(value)


def _double(value: float):
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def _array(array) -> dict:
    return {"values": [_any_value(item) for item in array.values]} if array.values else {}


def _kvlist(kvlist) -> dict:
    return {"values": _key_values(kvlist.values)} if kvlist.values else {}


def _bytes(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


def _same(value):
    return value


_ANY_VALUE = {
    "bool_value": ("boolValue", _same),
    "int_value": ("intValue", _int64),
    "double_value": ("doubleValue", _double),
    "array_value": ("arrayValue", _array),
    "kvlist_value": ("kvlistValue", _kvlist),
    "bytes_value": ("bytesValue", _bytes),
    "string_value_strindex": ("stringValueStrindex", _same),
}

# The fields the walk writes, per message; anything else installed sends every request the
# reference way. (Those marked optional are in newer messages only.)
_WALKED_FIELDS = {
    ExportTraceServiceRequest: {"resource_spans"},
    ResourceSpans: {"resource", "scope_spans", "schema_url"},
    Resource: {"attributes", "dropped_attributes_count", "entity_refs"},
    ScopeSpans: {"scope", "spans", "schema_url"},
    InstrumentationScope: {"name", "version", "attributes", "dropped_attributes_count"},
    Span: {"trace_id", "span_id", "trace_state", "parent_span_id", "flags", "name", "kind",
           "start_time_unix_nano", "end_time_unix_nano", "attributes", "dropped_attributes_count", "events",
           "dropped_events_count", "links", "dropped_links_count", "status"},
    Span.Event: {"time_unix_nano", "name", "attributes", "dropped_attributes_count"},
    Span.Link: {"trace_id", "span_id", "trace_state", "attributes", "dropped_attributes_count", "flags"},
    Status: {"message", "code"},
    KeyValue: {"key", "value", "key_strindex"},
    AnyValue: {"string_value", *_ANY_VALUE},
    ArrayValue: {"values"},
    KeyValueList: {"values"},
}
_WALK_KNOWS_THE_SCHEMA = all({field.name for field in message.DESCRIPTOR.fields} <= known
                             for message, known in _WALKED_FIELDS.items())
_HAS_KEY_STRINDEX = "key_strindex" in KeyValue.DESCRIPTOR.fields_by_name


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
