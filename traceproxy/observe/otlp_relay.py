"""Exporter process: an engine's encoded ``ExportTraceServiceRequest``, relayed as it came,
written where the proxy's own spans go when that is not a collector.

To a collector the bytes go as they are (``OtlpSink.export_raw``). The span file holds
OTLP/JSON lines (``otlp_json.py``): the request becomes one line, protobuf's JSON
mapping (``MessageToDict``: lowerCamelCase names in field-number order, enums as
integers, 64-bit integers as decimal strings, fields at their default left out), with
the one exception the Collector's file exporter makes and ``traceproxy diagnose`` reads:
trace and span ids as lowercase hex, not base64. Nothing else of the engine's spans is
changed: the line says what the engine said.
"""

from __future__ import annotations

import base64
import json

from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def document(payload: bytes) -> dict:
    request = ExportTraceServiceRequest.FromString(payload)
    out = MessageToDict(request, use_integers_for_enums=True)
    for resource_spans in out.get("resourceSpans", ()):
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                _hex_ids(span)
                for link in span.get("links", ()):
                    _hex_ids(link)
    return out


def json_line(payload: bytes) -> str:
    """One compact OTLP/JSON line, without its newline."""
    return json.dumps(document(payload), separators=(",", ":"))


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


def _hex_ids(item: dict) -> None:
    for key in _ID_FIELDS:
        if key in item:
            item[key] = base64.b64decode(item[key]).hex()
