"""``traceproxy diagnose ID``: one request's life, read back from its spans.

Given a trace id (32 hex digits) or a request id (the ``x-request-id`` the proxy
returned or kept), find the request's spans and print its timeline: the lifecycle
marks in order with the gap from the row above and from the start, the bytes,
the keep-alive ledger (client connection and request sequence, idle gap; per
upstream attempt: connection new or reused, idle age, request number), every
upstream attempt (resends), the stalls, and the outcome with its blame and error;
then the spans of other services below the proxy's (a router's, the engines' under
it, at any depth) where the source holds them, and the trace id to search the
engines' logs by: the one key every router passes on to both engines (vllm-router
replaces the request id they see with its own). The engines' own stage spans (SGLang
``--enable-trace``, relayed by traceproxy's engine span receiver or written by a
collector) are merged into the timeline, each stage's end a line, and the report says
which PD component, stage and worker had the request when the spans were written
(``diagnose_engines``).

Two sources, mapped to the same ``Span`` shape:

* the local span file (``[tracing] exporter = "file"``): OTLP/JSON lines, one
  ``ExportTraceServiceRequest`` per line with hex ids. Read in two passes, each
  parsing only the lines that contain what is looked for: the first finds the
  trace ids of the request, the second every span of those traces;
* Jaeger's HTTP query API: ``GET /api/traces/{trace id}``, or for a request id
  ``GET /api/traces?service=...&tags={"traceproxy.request_id": ID}``.

A request still hung when the spans were written has no SERVER span yet (it is
exported when the request ends) but has its stall span, exported the moment the
stall was detected; the timeline then says so, starts at the request's first byte
(dated by the request's age the stall span carries), and shows when each stall's wait
began and when it was detected.

Which span file: ``--spans PATH``, else ``TRACEPROXY_TRACING_FILE_PATH`` (the variable
``serve`` reads for ``[tracing] file_path``), else serve's default. A relative path is
taken from the current folder, as serve takes it from its own: run from another folder,
the command says which absolute path it looked in and how to point it elsewhere.

Where the engines had a request when it ended: the proxy knew it then (the live join's
``engine_stage``) and wrote it on the request's access log line, not on its spans; a
request whose client left before any stall fired has no stall span to carry it. So the
access log is read too when it is a file: ``--access-log PATH``, else
``TRACEPROXY_ACCESS_LOG_PATH`` (``[access_log] path``), else serve's default (stdout: not
read), found as the span file is.

Anything can be appended to a span file, so no line of it is trusted. A time that is not
fixed64 nanoseconds since the epoch (out of range, not a whole number) is unknown: its
span or event is kept, shown with "time unknown" or "-" where the time would count, and
sorted after every known time. An attribute of another type than the proxy writes is
shown as it is written. What cannot be read at all is skipped: a line that is not an
OTLP traces document (torn, foreign, nested past the parser), a span or event whose id
or name is not a string, the rest of its line kept; and what was skipped of the lines
naming the request is counted and said, found or not. A miss in a file with no span
document in it (an access log, a binary) asks whether it is the span file.

Exit status: 0 found, 1 not found, 2 usage or I/O error.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from . import diagnose_engines
from .config import SCHEMA
from .diagnose_engines import time_order
from .lifecycle.marks import Mark
from .observe import semconv as sc

# The span file is serve's [tracing] file_path: its default, and the variable that sets it.
_FILE_PATH_SETTING = next(s for s in SCHEMA if s.dotted == "tracing.file_path")
DEFAULT_SPANS = _FILE_PATH_SETTING.default
SPANS_ENV = _FILE_PATH_SETTING.env
# The access log is serve's [access_log] path: "-" (stdout) or "" (off) are no file to read.
_ACCESS_LOG_SETTING = next(s for s in SCHEMA if s.dotted == "access_log.path")
DEFAULT_ACCESS_LOG = _ACCESS_LOG_SETTING.default
ACCESS_LOG_ENV = _ACCESS_LOG_SETTING.env
NOT_A_FILE = ("", "-")
DEFAULT_SERVICE = "traceproxy"
JAEGER_TIMEOUT_S = 10.0
JAEGER_LIMIT = 20
JAEGER_LOOKBACK_S = 2 * 24 * 3600
FOUND, NOT_FOUND, ERROR = 0, 1, 2
# OTLP times are fixed64 nanoseconds since the epoch; a time outside that range is no time
# anyone recorded (its line was mangled): it is read as unknown.
MAX_TIME_NS = 2**64 - 1

_HEX32 = re.compile(r"^[0-9a-fA-F]{32}$")
_OTLP_KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
_OTLP_STATUS = {0: "unset", 1: "ok", 2: "error"}
_MARK_ORDER = {m.label: int(m) for m in Mark}
STALL_EVENT, STALL_RESOLVED_EVENT = "stall", "stall_resolved"
# A stall span's own start is when the stall's wait began, which can be long after its
# request began (a body sent late, a stream gone silent): the span says how long the
# request had been in the proxy when the stall was detected (sc.STALL_REQUEST_AGE), and
# so when it began.


class DiagnoseError(Exception):
    """Usage or I/O trouble: a missing file, an unreachable Jaeger (exit status 2)."""


@dataclass(frozen=True)
class SpanFile:
    """The span file to read, absolute, and what named it."""

    path: Path
    named_by: str  # "--spans", "env TRACEPROXY_TRACING_FILE_PATH" or "the default"

    def __str__(self) -> str:
        return f"{self.path} ({self.named_by})"


def span_file(flag: str | None, environ=None) -> SpanFile:
    """``--spans``, else the environment variable serve reads, else serve's default;
    relative to the current folder."""
    path, named_by = _named_path(flag, "--spans", SPANS_ENV, DEFAULT_SPANS, environ)
    return _absolute(path, named_by)


def access_log_file(flag: str | None, environ=None) -> SpanFile | None:
    """``--access-log``, else the variable serve reads, else serve's default, as the span
    file is found; None when that is stdout or off (no file to read)."""
    path, named_by = _named_path(flag, "--access-log", ACCESS_LOG_ENV, DEFAULT_ACCESS_LOG, environ)
    return None if path.strip() in NOT_A_FILE else _absolute(path, named_by)


def _named_path(flag: str | None, flag_name: str, env: str, default: str, environ) -> tuple[str, str]:
    environ = os.environ if environ is None else environ
    from_env = (environ.get(env) or "").strip()
    if flag is not None:
        return flag, flag_name
    if from_env:
        return from_env, f"env {env}"
    return default, "the default"


def _absolute(path: str, named_by: str) -> SpanFile:
    if not os.path.isabs(path):
        named_by += f" {path}, from the current folder"
    return SpanFile(Path(os.path.abspath(path)), named_by)


def pointing_lines() -> list[str]:
    """How to point the command at the file serve writes, or at Jaeger."""
    return [f"  traceproxy serve writes [tracing] file_path (default {DEFAULT_SPANS}) relative to the folder it "
            "was started in, when [tracing] exporter is \"file\" (or \"auto\" with no OTLP endpoint).",
            f"  Point diagnose at that file with --spans PATH or {SPANS_ENV}=PATH, "
            "or at Jaeger's query API with --jaeger URL."]


@dataclass
class Event:
    name: str
    time_ns: int | None  # None: unknown (a span file's time that is no fixed64 time)
    attributes: dict = field(default_factory=dict)


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: str  # server, client, internal, ...
    start_ns: int | None  # None: unknown, as an event's time
    end_ns: int | None
    attributes: dict = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    status: str = "unset"
    status_message: str = ""
    service: str = ""


@dataclass
class RequestSpans:
    """The spans of one request: its SERVER span (None while still in flight), its
    CLIENT span per upstream attempt, its stall spans, and the spans of other services
    below the attempts at any depth (a router's, the engines' under it), where the
    source holds them: Jaeger, or a span file a collector wrote for every service."""

    trace_id: str
    server_span_id: str
    server: Span | None = None
    attempts: list[Span] = field(default_factory=list)
    stalls: list[Span] = field(default_factory=list)
    downstream: list[Span] = field(default_factory=list)  # depth first, each parent before its children
    depth: dict[str, int] = field(default_factory=dict)  # span id -> 1 for an attempt's child, 2 below it, ...
    engine: list[Span] = field(default_factory=list)  # the engines' stage and thread spans of its trace, by end
    access_log: dict | None = None  # its access log line, when the access log is a file that has it

    @property
    def start_ns(self) -> int | None:
        return self.server.start_ns if self.server is not None else self.in_flight_start()[0]

    def in_flight_start(self) -> tuple[int | None, bool]:
        """When a request with no SERVER span began (None: unknown), and whether that is its
        own start (its first byte). Without the request's age in its stall spans (a file
        written by a proxy that did not record it), the earliest moment known is when its
        first stall's wait began."""
        starts = [stall.end_ns - age for stall in self.stalls
                  if stall.end_ns is not None and (age := _seconds_as_ns(stall.attributes.get(sc.STALL_REQUEST_AGE)))
                  is not None]
        if starts:
            return min(starts), True
        return min((s.start_ns for s in self.stalls + self.attempts if s.start_ns is not None), default=None), False

    @property
    def request_id(self) -> str:
        for span in ([self.server] if self.server else []) + self.stalls:
            if span.attributes.get(sc.REQUEST_ID):
                return str(span.attributes[sc.REQUEST_ID])
        return ""


def is_trace_id(ident: str) -> bool:
    return bool(_HEX32.match(ident))


def _typed(value, kinds):
    """``value`` when it is of ``kinds`` and, a number, a finite one a float holds; else None.
    The span file is written by whatever wrote it: an attribute can hold any type, and a
    value of another type than the proxy writes is shown as written, never counted with
    (a bool is not a number, though Python counts it an int; a string is not one either)."""
    if isinstance(value, bool) or not isinstance(value, kinds):
        return None
    try:
        finite = not isinstance(value, (int, float)) or math.isfinite(value)
    except OverflowError:  # an int past what a float holds
        finite = False
    return value if finite else None


def _seconds_as_ns(value) -> int | None:
    """A duration attribute (seconds) in nanoseconds, when it is a number of seconds that
    can be counted with: finite in nanoseconds too, not negative."""
    seconds = _typed(value, (int, float))
    if seconds is None or seconds < 0 or not math.isfinite(ns := seconds * 1e9):
        return None
    return round(ns)


def _elapsed(later: int | None, earlier: int | None) -> int | None:
    """From ``earlier`` to ``later``; None when either time is unknown."""
    return None if later is None or earlier is None else later - earlier


# ----------------------------------------------------------------------------------
# OTLP/JSON (the local span file)
# ----------------------------------------------------------------------------------
def otlp_value(value: dict):
    """One OTLP/JSON ``AnyValue`` -> a Python value. An int or double that does not read as
    one is kept as it is written: the report shows it, and no count is made of it."""
    if not isinstance(value, dict):
        return None
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        number = whole_number(value["intValue"])
        return value["intValue"] if number is None else number
    if "doubleValue" in value:
        return _double(value["doubleValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [otlp_value(v) for v in value["arrayValue"].get("values", ())]
    if "kvlistValue" in value:
        return otlp_attributes(value["kvlistValue"].get("values", ()))
    return value.get("bytesValue")


def whole_number(written) -> int | None:
    """An integer (int64, fixed64) as OTLP/JSON writes one: a decimal string, or a JSON
    number, a float only when it holds a whole number (1.7e18); None when it is not one."""
    if isinstance(written, float):
        return int(written) if written.is_integer() else None  # is_integer: False for inf and nan
    if isinstance(written, int) and not isinstance(written, bool):
        return written
    if isinstance(written, str):
        try:
            return int(written)
        except ValueError:  # not a number, or past the digits int() reads
            return None
    return None


def _double(written):
    """A double as OTLP/JSON writes one (a number, or a string such as "2.5", "Infinity");
    anything else as it is written."""
    if isinstance(written, bool) or not isinstance(written, (str, int, float)):
        return written
    try:
        return float(written)
    except (ValueError, OverflowError):  # "x"; an int past what a float holds
        return written


def otlp_attributes(items: Iterable[dict]) -> dict:
    return {item["key"]: otlp_value(item.get("value", {})) for item in items if "key" in item}


def otlp_spans(document: dict) -> Iterator[Span]:
    """Every span of one ``ExportTraceServiceRequest`` that can be read (see ``_readable_span``).
    A document not of that shape raises ValueError, TypeError or AttributeError."""
    for raw, service in _raw_spans(document):
        span, _ = _readable_span(raw, service)
        if span is not None:
            yield span


def _raw_spans(document: dict) -> Iterator[tuple[object, str]]:
    """(the span as written, its service) for each span of the document."""
    for resource_spans in document.get("resourceSpans", ()):
        resource = otlp_attributes(resource_spans.get("resource", {}).get("attributes", ()))
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for raw in scope_spans.get("spans", ()):
                yield raw, service


def _raw_spans_of(document) -> list[tuple[object, str]] | None:
    """The spans of a line's document as written; None when it is not an OTLP traces
    document (JSON of another shape, such as an access log line)."""
    if not isinstance(document, dict) or not isinstance(document.get("resourceSpans"), list):
        return None
    try:
        return list(_raw_spans(document))
    except (ValueError, TypeError, AttributeError, RecursionError):  # RecursionError: values nested past the stack
        return None


def _readable_span(raw, service: str) -> tuple[Span | None, list[int]]:
    """The span, None when it cannot be read (an id or name that is not a string): it alone
    is skipped, the line's other spans kept, as a line is a batch of many requests' spans;
    and the indexes of the span's events that could not be read, dropped from it."""
    try:
        return _otlp_span(raw, service)
    except (ValueError, TypeError, AttributeError, RecursionError):
        return None, []


def otlp_time(written) -> int | None:
    """A fixed64 time in nanoseconds since the epoch, as OTLP/JSON writes it (a decimal
    string, or a number); None, unknown, when it is not one or outside what fixed64 holds."""
    ns = whole_number(written)
    return ns if ns is not None and 0 <= ns <= MAX_TIME_NS else None


def _otlp_span(raw: dict, service: str) -> tuple[Span, list[int]]:
    status = raw.get("status", {})
    name = raw.get("name", "")
    if not isinstance(name, str):  # names are looked up in tables of stages and marks
        raise TypeError(f"a span name that is not a string: {name!r}")
    events = [_readable_event(event) for event in raw.get("events", ())]
    span = Span(
        trace_id=raw.get("traceId", "").lower(),
        span_id=raw.get("spanId", "").lower(),
        parent_id=raw.get("parentSpanId", "").lower(),
        name=name,
        kind=_OTLP_KINDS.get(raw.get("kind", 0), "unspecified"),
        start_ns=otlp_time(raw.get("startTimeUnixNano", 0)),
        end_ns=otlp_time(raw.get("endTimeUnixNano", 0)),
        attributes=otlp_attributes(raw.get("attributes", ())),
        events=[event for event in events if event is not None],
        status=_OTLP_STATUS.get(status.get("code", 0), "unset"),
        status_message=status.get("message", ""),
        service=service,
    )
    return span, [index for index, event in enumerate(events) if event is None]


def _readable_event(raw) -> Event | None:
    """The event, or None when it cannot be read (a name that is not a string, attributes
    of no shape): it alone is dropped, its span and the span's other marks kept."""
    try:
        name = raw.get("name", "")
        if not isinstance(name, str):  # event names are looked up in the table of marks
            return None
        return Event(name, otlp_time(raw.get("timeUnixNano", 0)), otlp_attributes(raw.get("attributes", ())))
    except (ValueError, TypeError, AttributeError, RecursionError):
        return None


def _json_lines_with(path: Path, needles) -> Iterator[tuple[int, object]]:
    """(line number, JSON document) for the lines of ``path`` that contain any needle; None
    for a torn or foreign line (the file is the proxy's, but anything can be appended to
    it). Only those lines are parsed: the files are large and the wanted lines few."""
    with open(path, encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if not any(needle in line for needle in needles):
                continue
            try:
                document = json.loads(line)
            except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
                document = None
            yield number, document


@dataclass
class Unread:
    """What the scans of the span file skipped of what names the request (its id, or its
    trace's): lines that are not an OTLP traces document, spans and events that could not
    be read. Each is kept by where it is in the file, so one that both scans read (a line
    holds the request id and its trace id) is counted once."""

    lines: set[int] = field(default_factory=set)  # line numbers
    spans: set[tuple[int, int]] = field(default_factory=set)  # (line, span of the line)
    events: set[tuple[int, int, int]] = field(default_factory=set)  # (line, span, event of the span)

    def words(self) -> str:
        """``1 line, 2 spans and 1 event``; "" when nothing was skipped."""
        parts = [f"{count} {what}{'s' if count > 1 else ''}" for count, what in
                 ((len(self.lines), "line"), (len(self.spans), "span"), (len(self.events), "event")) if count]
        return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else "".join(parts)


def _scan_file(path: Path, needles: set[str], unread: Unread) -> Iterator[Span]:
    """Spans of the lines that contain any needle; what of them names a needle and cannot
    be read is added to ``unread``."""
    for number, document in _json_lines_with(path, needles):
        raws = _raw_spans_of(document)
        if raws is None:  # JSON of another shape is skipped like a torn line
            unread.lines.add(number)
            continue
        for index, (raw, service) in enumerate(raws):
            span, dropped_events = _readable_span(raw, service)
            if (span is None or dropped_events) and _names_any(raw, needles):
                if span is None:
                    unread.spans.add((number, index))
                unread.events.update((number, index, event) for event in dropped_events)
            if span is not None:
                yield span


def _names_any(raw, needles) -> bool:
    """Whether a span as written names a needle (the request id, its trace id): whether
    what could not be read of it may be the request's. True when that cannot be told."""
    try:
        text = json.dumps(raw)
    except (ValueError, TypeError, RecursionError):
        return True
    return any(needle in text for needle in needles)


def file_spans(path: str | Path, ident: str, unread: Unread | None = None) -> list[Span]:
    """The spans of every trace that holds the request ``ident`` (trace id or request id).
    ``unread``: what could not be read of the lines naming ``ident`` or those traces."""
    path, unread = Path(path), Unread() if unread is None else unread
    if not path.is_file():
        raise DiagnoseError(f"no span file at {path} (the proxy writes it with [tracing] exporter = \"file\")")
    try:
        wanted = json.dumps(ident)[1:-1]  # as the id appears inside a JSON string
        traces = {s.trace_id for s in _scan_file(path, {wanted, ident.lower()}, unread) if _mentions(s, ident)}
        if not traces:
            return []
        return [s for s in _scan_file(path, traces, unread) if s.trace_id in traces]
    except OSError as exc:
        raise DiagnoseError(f"cannot read {path}: {exc}") from None


def access_log_lines(path: str | Path, trace_ids: set[str]) -> dict[str, dict]:
    """trace id -> the last access log line of that trace (a resent request's last word);
    a torn or foreign line is skipped. Only lines holding one of the ids are parsed."""
    path = Path(path)
    if not path.is_file():
        raise DiagnoseError(f"no access log at {path}")
    found: dict[str, dict] = {}
    try:
        for _, entry in _json_lines_with(path, trace_ids):
            if isinstance(entry, dict) and isinstance(entry.get("trace_id"), str) and entry["trace_id"] in trace_ids:
                found[entry["trace_id"]] = entry
    except OSError as exc:
        raise DiagnoseError(f"cannot read {path}: {exc}") from None
    return found


def _mentions(span: Span, ident: str) -> bool:
    return span.trace_id == ident.lower() or span.attributes.get(sc.REQUEST_ID) == ident


# ----------------------------------------------------------------------------------
# Jaeger's HTTP query API
# ----------------------------------------------------------------------------------
def jaeger_value(tag: dict):
    value = tag.get("value")
    kind = tag.get("type", "string")
    if kind == "int64" and not isinstance(value, bool):
        return int(value)
    if kind == "float64":
        return float(value)
    if kind == "bool" and isinstance(value, str):
        return value.lower() == "true"
    return value


def jaeger_tags(tags: Iterable[dict]) -> dict:
    return {t["key"]: jaeger_value(t) for t in tags if isinstance(t, dict) and "key" in t}


def jaeger_spans(document: dict) -> list[Span]:
    """Every span of a Jaeger ``/api/traces`` answer (``data[].spans[]``)."""
    spans = []
    for trace in document.get("data") or ():
        processes = trace.get("processes") or {}
        for raw in trace.get("spans") or ():
            service = (processes.get(raw.get("processID")) or {}).get("serviceName", "")
            spans.append(_jaeger_span(raw, service))
    return spans


def _jaeger_span(raw: dict, service: str) -> Span:
    tags = jaeger_tags(raw.get("tags") or ())
    parent = next((r.get("spanID", "") for r in raw.get("references") or () if r.get("refType") == "CHILD_OF"), "")
    start_ns = int(raw.get("startTime", 0)) * 1000
    kind = str(tags.pop("span.kind", "internal")).lower()
    status = str(tags.pop("otel.status_code", "")).lower() or ("error" if tags.get("error") is True else "unset")
    message = str(tags.pop("otel.status_description", ""))
    return Span(
        trace_id=str(raw.get("traceID", "")).lower().zfill(32),
        span_id=str(raw.get("spanID", "")).lower().zfill(16),
        parent_id=str(parent).lower().zfill(16) if parent else "",
        name=raw.get("operationName", ""),
        kind=kind,
        start_ns=start_ns,
        end_ns=start_ns + int(raw.get("duration", 0)) * 1000,
        attributes=tags,
        events=[_jaeger_event(log) for log in raw.get("logs") or ()],
        status=status,
        status_message=message,
        service=service,
    )


def _jaeger_event(log: dict) -> Event:
    fields = jaeger_tags(log.get("fields") or ())
    name = str(fields.pop("event", ""))
    return Event(name, int(log.get("timestamp", 0)) * 1000, fields)


def fetch_jaeger(base_url: str, ident: str, service: str = DEFAULT_SERVICE) -> list[Span]:
    """The spans Jaeger holds for the trace id or request id ``ident``; raises DiagnoseError."""
    if not _is_http_url(base_url):
        raise DiagnoseError(f"--jaeger takes the query API's http(s) URL, such as http://127.0.0.1:16686, "
                            f"not {base_url!r}")
    base = base_url.rstrip("/")
    if is_trace_id(ident):
        found = _jaeger_get(f"{base}/api/traces/{ident.lower()}")
        if found:
            return found
    tags = json.dumps({sc.REQUEST_ID: ident})
    now_us = int(time.time() * 1e6)
    query = urllib.parse.urlencode({"service": service, "tags": tags, "limit": JAEGER_LIMIT,
                                    "start": now_us - JAEGER_LOOKBACK_S * 1_000_000, "end": now_us})
    return _jaeger_get(f"{base}/api/traces?{query}")


def _is_http_url(url: str) -> bool:
    """An http(s) URL with a host, a numeric port if any, and nothing a request line cannot carry."""
    if any(c.isspace() or not c.isprintable() for c in url):
        return False
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # raises ValueError for a port that is not a number in range
    except ValueError:  # such as an unclosed IPv6 bracket
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _jaeger_get(url: str) -> list[Span]:
    try:
        with _opener(url).open(url, timeout=JAEGER_TIMEOUT_S) as answer:
            body = answer.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return []
        raise DiagnoseError(f"Jaeger answered HTTP {exc.code} for {url}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise DiagnoseError(f"cannot reach Jaeger at {url}: {getattr(exc, 'reason', exc)}") from None
    try:
        document = json.loads(body)
    except ValueError:
        raise DiagnoseError(f"Jaeger's answer for {url} is not JSON") from None
    try:
        return jaeger_spans(document) if isinstance(document, dict) else []
    except (ValueError, TypeError, AttributeError):
        raise DiagnoseError(f"Jaeger's answer for {url} is not a traces document") from None


def _opener(url: str) -> urllib.request.OpenerDirector:
    """No environment proxy for a loopback Jaeger; the usual opener otherwise."""
    host = urllib.parse.urlsplit(url).hostname or ""
    try:
        local = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = False
    return urllib.request.build_opener(urllib.request.ProxyHandler({})) if local else urllib.request.build_opener()


# ----------------------------------------------------------------------------------
# Which spans belong to the request
# ----------------------------------------------------------------------------------
def _is_proxy_server(span: Span) -> bool:
    return span.kind == "server" and sc.REQUEST_ID in span.attributes


def _is_stall(span: Span) -> bool:
    return sc.STALL_OUTCOME in span.attributes and sc.REQUEST_ID in span.attributes


def find_requests(spans: list[Span], ident: str) -> list[RequestSpans]:
    """The requests ``ident`` names (all the proxy's requests of a trace, or those
    with that request id), oldest first."""
    requests: dict[tuple[str, str], RequestSpans] = {}
    for span in spans:
        if (_is_proxy_server(span) or _is_stall(span)) and _mentions(span, ident):
            server_id = span.span_id if _is_proxy_server(span) else span.parent_id
            found = requests.setdefault((span.trace_id, server_id), RequestSpans(span.trace_id, server_id))
            if _is_proxy_server(span):
                found.server = span
            else:
                found.stalls.append(span)
    for found in requests.values():
        _attach_children(found, spans)
    return sorted(requests.values(), key=lambda r: time_order(r.start_ns))


def _attach_children(found: RequestSpans, spans: list[Span]) -> None:
    same_trace = [s for s in spans if s.trace_id == found.trace_id]
    # A request that stalled mid-head was given an id for its stall span, and then
    # took the client's own when its head came: whichever id found it, its SERVER
    # span and its stall spans are the ones of its span id.
    if found.server is None:
        found.server = next((s for s in same_trace if _is_proxy_server(s) and s.span_id == found.server_span_id),
                            None)
    known = {id(s) for s in found.stalls}
    found.stalls += [s for s in same_trace
                     if _is_stall(s) and s.parent_id == found.server_span_id and id(s) not in known]
    found.stalls.sort(key=lambda s: time_order(s.start_ns))
    found.attempts = sorted((s for s in same_trace if s.kind == "client" and s.parent_id == found.server_span_id),
                            key=_attempt_order)
    found.downstream, found.depth = _descendants(found.attempts, same_trace)
    found.engine = diagnose_engines.engine_spans(same_trace, found.trace_id)
    found.stalls.sort(key=lambda s: time_order(s.end_ns))


def _descendants(roots: list[Span], spans: list[Span]) -> tuple[list[Span], dict[str, int]]:
    """Every span below ``roots`` at any depth, depth first (siblings by start, an unknown
    start last), with its depth.

    A router that traces (smg with --enable-trace) puts its own span between the proxy's
    CLIENT span and the engines'. Each span id is taken once: a file may repeat a span,
    and parent ids that loop must not loop here."""
    children: dict[str, list[Span]] = {}
    for span in spans:
        children.setdefault(span.parent_id, []).append(span)
    seen = {root.span_id for root in roots}
    found: list[Span] = []
    depth: dict[str, int] = {}
    stack = [(1, span) for root in reversed(roots)
             for span in sorted(children.get(root.span_id, ()), key=_by_start, reverse=True)]
    while stack:
        level, span = stack.pop()
        if span.span_id in seen:
            continue
        seen.add(span.span_id)
        found.append(span)
        depth[span.span_id] = level
        stack += [(level + 1, child) for child in
                  sorted(children.get(span.span_id, ()), key=_by_start, reverse=True)]
    return found, depth


def _by_start(span: Span) -> tuple[bool, int]:
    return time_order(span.start_ns)


def _attempt_order(span: Span) -> tuple[int, bool, int]:
    """By resend count (one that is not a whole number counts as the first), then start."""
    return _typed(span.attributes.get(sc.HTTP_REQUEST_RESEND_COUNT, 0), int) or 0, *time_order(span.start_ns)


# ----------------------------------------------------------------------------------
# Formatting: RequestSpans -> lines
# ----------------------------------------------------------------------------------
def duration(ns: float | None) -> str:
    if ns is None:
        return "-"
    if abs(ns) < 1e9:
        return f"{ns / 1e6:.3f} ms"
    return f"{ns / 1e9:.3f} s"


def _seconds(value) -> str:
    """A duration attribute (seconds) as a duration; one that is not a number as it is written."""
    if value is None:
        return "-"
    seconds = _typed(value, (int, float))
    return str(value) if seconds is None else duration(seconds * 1e9)


def wall_clock(ns: int | None) -> str:
    """The UTC date of a time in nanoseconds since the epoch; the bare number when no date can
    be made of it (a Jaeger answer's time, or a start worked back from a request's age)."""
    if ns is None:
        return "time unknown"
    try:
        return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f UTC")
    except (OverflowError, ValueError, OSError):
        return f"{ns} ns since the epoch (not a date)"


def request_lines(found: RequestSpans) -> list[str]:
    lines = [f"request {found.request_id or '-'}   trace {found.trace_id}"]
    if found.server is None:
        lines += _in_flight_lines(found)
    else:
        lines += _outcome_lines(found.server)
        lines += _ledger_lines(found.server)
        lines += _byte_lines(found.server)
    lines += [line for attempt in found.attempts for line in _attempt_lines(attempt)]
    lines += _timeline_lines(found)
    lines += _stall_lines(found)
    stalled_at = _ended_stalled_at(found)
    lines += diagnose_engines.summary_lines(found.engine, stalled_at.attributes if stalled_at is not None else None,
                                            _engines_at_end(found))
    lines += _downstream_lines(found)
    lines.append(_join_key_line(found))
    return lines


def _engines_at_end(found: RequestSpans) -> tuple[str, diagnose_engines.EngineStage] | None:
    """(outcome, where the engines had it) as the proxy knew it when the request ended:
    from its SERVER span when that carries it, else from its access log line."""
    server = found.server.attributes if found.server is not None else {}
    stage = diagnose_engines.stage_from_attributes(server)
    if stage is not None:
        return str(server.get(sc.OUTCOME, "-")), stage
    logged = found.access_log or {}
    stage = diagnose_engines.stage_from_dict(logged.get("engine_stage"))
    if stage is not None:
        return str(server.get(sc.OUTCOME) or logged.get("outcome") or "-"), stage
    return None


def _in_flight_lines(found: RequestSpans) -> list[str]:
    lines = ["  not finished when the spans were written: no SERVER span yet, only its stall span(s)"]
    first = found.stalls[0].attributes if found.stalls else {}
    if first:
        lines.append(f"  {first.get(sc.HTTP_REQUEST_METHOD, '-')} {first.get(sc.URL_PATH, '-')}")
        lines.append(f"  client connection {first.get(sc.CLIENT_CONNECTION_ID, '-')}, "
                     f"request {first.get(sc.CLIENT_REQUEST_SEQUENCE, '-')} on it")
        if sc.UPSTREAM_CONNECTION_ID in first:
            reuse = "reused" if first.get(sc.UPSTREAM_CONNECTION_REUSED) else "new"
            lines.append(f"  upstream connection {first[sc.UPSTREAM_CONNECTION_ID]} ({reuse})")
    return lines


def _request_line(server: Span) -> str:
    """Method and path: the span's name carries the path only for the routes it knows
    (names stay few), so an unknown route would show as the bare method."""
    a = server.attributes
    path = a.get(sc.URL_PATH)
    if not path:
        return server.name
    return f"{a.get(sc.HTTP_REQUEST_METHOD) or server.name.split(' ')[0]} {path}"


def _outcome_lines(server: Span) -> list[str]:
    a = server.attributes
    status = a.get(sc.HTTP_RESPONSE_STATUS_CODE)
    lines = [f"  {_request_line(server)} -> {'HTTP ' + str(status) if status else 'no response status'}   "
             f"outcome {a.get(sc.OUTCOME, '-')} ({a.get(sc.OUTCOME_NAME, '-')}), blame {a.get(sc.BLAME, '-')}"]
    cause = _open_stall(server) if a.get(sc.BLAME) == "client" else None
    if cause is not None:
        # A harness that gives up on a hung request ends it DC (blame client); the
        # hang it gave up on is the stall still open when it left. Said straight under
        # the outcome, which alone would send the reader to the client.
        lines.append(f"  the client left while the request was stalled: {cause.get(sc.STALL_OUTCOME, '-')} in "
                     f"{cause.get(sc.STALL_PHASE, '-')}, blame {cause.get(sc.BLAME, '-')}: that is the hang")
    error = a.get(sc.ERROR_MESSAGE) or (server.status_message if server.status == "error" else "")
    if error:
        lines.append(f"  error: {error}")
    return lines


def _open_stall(server: Span) -> dict | None:
    """The attributes of the last stall event not followed by its resolution, if any."""
    stalls, still_open = _paired_stalls(server)
    return stalls[max(still_open)][0] if still_open else None


def _paired_stalls(server: Span) -> tuple[list[tuple[dict, object]], set[int]]:
    """Each stall event's attributes with the duration of the resolution that followed
    it (None: none did), in time order, and the indexes of those still open at the end.
    The same code can stall, resolve and stall again on one request (a stream with two
    long gaps): each resolution belongs to the latest open stall of its code."""
    stalls: list[tuple[dict, object]] = []
    # (code, index in stalls) of the stalls still open. A list, the code compared by
    # equality: a code written as an array or map is no dict key.
    still_open: list[tuple[object, int]] = []
    for event in sorted(server.events, key=lambda e: time_order(e.time_ns)):
        code = event.attributes.get(sc.STALL_OUTCOME)
        same_code = [at for at, (open_code, _) in enumerate(still_open) if open_code == code]
        if event.name == STALL_EVENT:
            if same_code:
                del still_open[same_code[-1]]
            still_open.append((code, len(stalls)))
            stalls.append((event.attributes, None))
        elif event.name == STALL_RESOLVED_EVENT and same_code:
            _, index = still_open.pop(same_code[-1])
            stalls[index] = (stalls[index][0], event.attributes.get(sc.STALL_DURATION))
    return stalls, {index for _, index in still_open}


def _ledger_lines(server: Span) -> list[str]:
    a = server.attributes
    idle = a.get(sc.CLIENT_IDLE_GAP)
    gap = f", idle {_seconds(idle)} before it" if idle is not None else ""
    peer = f" ({a[sc.CLIENT_ADDRESS]}:{a.get(sc.CLIENT_PORT, '-')})" if sc.CLIENT_ADDRESS in a else ""
    return [f"  client connection {a.get(sc.CLIENT_CONNECTION_ID, '-')}{peer}, "
            f"request {a.get(sc.CLIENT_REQUEST_SEQUENCE, '-')} on it{gap}"]


def _byte_lines(server: Span) -> list[str]:
    a = server.attributes
    lines = [f"  bytes: request body {a.get(sc.HTTP_REQUEST_BODY_SIZE, '-')}, "
             f"response body {a.get(sc.HTTP_RESPONSE_BODY_SIZE, '-')}; {a.get(sc.CHUNKS, '-')} upstream chunks, "
             f"largest gap {_seconds(a.get(sc.CHUNK_MAX_GAP))}"]
    genai = []
    if sc.GEN_AI_REQUEST_MODEL in a:
        genai.append(f"model {a[sc.GEN_AI_REQUEST_MODEL]}")
    if a.get(sc.GEN_AI_REQUEST_STREAM):
        genai.append(f"stream, first chunk after {_seconds(a.get(sc.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK))}")
    if sc.GEN_AI_USAGE_INPUT_TOKENS in a or sc.GEN_AI_USAGE_OUTPUT_TOKENS in a:
        genai.append(f"tokens in {a.get(sc.GEN_AI_USAGE_INPUT_TOKENS, '-')} / out "
                     f"{a.get(sc.GEN_AI_USAGE_OUTPUT_TOKENS, '-')}")
    if sc.GEN_AI_RESPONSE_FINISH_REASONS in a:
        genai.append(f"finish {_string_list(a[sc.GEN_AI_RESPONSE_FINISH_REASONS])}")
    if sc.DONE_SEEN in a:
        genai.append("[DONE] seen" if a[sc.DONE_SEEN] else "no [DONE]")
    if genai:
        lines.append("  genai: " + ", ".join(genai))
    return lines


def _string_list(value) -> str:
    """A string-array attribute as ``a, b``: a list from an OTLP/JSON file, or the JSON
    text Jaeger stores an array as (its tags have no array type)."""
    if isinstance(value, str) and value.startswith("["):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    if isinstance(value, (list, tuple)):
        return ", ".join(str(item) for item in value)
    return str(value)


def _attempt_label(attempt: Span) -> str:
    written = attempt.attributes.get(sc.HTTP_REQUEST_RESEND_COUNT, 0)
    resend = _typed(written, int)
    if resend is None:
        return f"attempt (resend {written})"
    return f"attempt {resend + 1}" + (f" (resend {resend})" if resend else "")


def _attempt_lines(attempt: Span) -> list[str]:
    a = attempt.attributes
    if sc.UPSTREAM_CONNECTION_ID not in a:  # its connect failed, or it never got one
        conn = "no connection"
    else:
        conn = f"connection {a[sc.UPSTREAM_CONNECTION_ID]}"
        if a.get(sc.UPSTREAM_CONNECTION_REUSED):
            conn += f" reused, idle {_seconds(a.get(sc.UPSTREAM_CONNECTION_IDLE_AGE))}"
        else:
            conn += " new"
        conn += f", request {a.get(sc.UPSTREAM_CONNECTION_REQUEST_NUMBER, '-')} on it"
    line = f"  upstream {_attempt_label(attempt)}: {conn} -> {a.get(sc.OUTCOME, '-')}"
    if attempt.status == "error" and attempt.status_message:
        line += f" ({attempt.status_message})"
    return [line]


def timeline_entries(found: RequestSpans) -> list[tuple[int | None, str, str]]:
    """(time, what, where) for every mark and stall event, in order; those whose time is
    unknown last."""
    entries = []
    if found.server is not None:
        entries += [(e.time_ns, _event_text(e), "") for e in found.server.events]
    for attempt in found.attempts:
        entries += [(e.time_ns, _event_text(e), _attempt_label(attempt)) for e in attempt.events]
    if found.server is None:
        start, known = found.in_flight_start()
        if known:
            entries.append((start, Mark.FIRST_DOWNSTREAM_RX_BYTE.label, ""))
        for stall in found.stalls:
            code, phase = stall.attributes.get(sc.STALL_OUTCOME), stall.attributes.get(sc.STALL_PHASE, "-")
            entries += [(stall.start_ns, f"stall {code} wait began ({phase})", "stall span"),
                        (stall.end_ns, f"stall detected: {code}", "stall span")]
    entries += diagnose_engines.timeline_entries(found.engine)
    return sorted(entries, key=lambda e: (*time_order(e[0]), _MARK_ORDER.get(e[1], len(_MARK_ORDER))))


def _event_text(event: Event) -> str:
    if event.name == STALL_EVENT:
        return (f"stall {event.attributes.get(sc.STALL_OUTCOME, '-')} "
                f"({event.attributes.get(sc.STALL_PHASE, '-')})")
    if event.name == STALL_RESOLVED_EVENT:
        return f"stall {event.attributes.get(sc.STALL_OUTCOME, '-')} resolved"
    return event.name


def _timeline_lines(found: RequestSpans) -> list[str]:
    entries = timeline_entries(found)
    if not entries:
        return ["  timeline: no marks"]
    if found.server is not None:
        start = found.server.start_ns
        heading = f"start {wall_clock(start)}, took {duration(_elapsed(found.server.end_ns, start))}"
    else:
        start, known = found.in_flight_start()
        last_seen = max((when for when, _, _ in entries if when is not None), default=None)
        heading = (f"start {wall_clock(start)}, still in flight {duration(_elapsed(last_seen, start))} later" if known
                   else f"from its first stall's wait, {wall_clock(start)}: its stall spans do not say when the "
                   "request began")
    lines = [f"  timeline ({heading}):",
             f"    {'from start':>14} {'gap':>14}  mark"]
    # Each gap runs from the row above: a stall's detection or an engine stage's end is a
    # row like a mark, so the column adds up to the "from start" one and the longest wait
    # is the longest stretch in which nothing was seen. Rows of unknown time come last
    # (timeline_entries): they have no gap, and every row above them has its own.
    gaps = [_elapsed(when, previous) for (when, _, _), previous in zip(entries, [start] + [e[0] for e in entries])]
    longest = max((index for index, gap in enumerate(gaps) if gap is not None and gap > 0),
                  key=gaps.__getitem__, default=-1)
    for index, ((when, what, where), gap) in enumerate(zip(entries, gaps)):
        since_start = "time unknown" if when is None else _offset(_elapsed(when, start))
        lines.append(f"    {since_start:>14} {_offset(gap):>14}  {what}"
                     + (f"   [{where}]" if where else "") + ("   <- longest wait" if index == longest else ""))
    return lines


def _offset(ns: int | None) -> str:
    return "-" if ns is None else "+" + duration(ns)


def _stall_lines(found: RequestSpans) -> list[str]:
    stalls = (_stalls_from_events(found.server, found.stalls) if found.server is not None
              else _stalls_from_spans(found.stalls))
    if not stalls:
        return ["  stalls: none"]
    return ["  stalls:"] + [f"    {text}" for text in stalls]


def _stalls_from_events(server: Span, stall_spans: list[Span] = ()) -> list[str]:
    """One line per stall event, with the resolution that followed it, and where the
    engines had the request when it was detected (its stall span says, the event not)."""
    stalls, still_open = _paired_stalls(server)
    ended_ok = server.attributes.get(sc.OUTCOME) == "OK"
    texts = []
    for index, (a, duration) in enumerate(stalls):
        stall_span = _stall_span_of(a, stall_spans)
        engine = _engine_at_stall(stall_span) if stall_span is not None else ""
        if duration is not None:
            state = f"resolved after {_seconds(duration)}"
        elif ended_ok:
            state = "no resolution recorded, and the request then finished OK"
        elif index in still_open:
            state = "not resolved (the request ended stalled)"
        else:
            state = "no resolution recorded"  # a later stall of the same code replaced it (a resend)
        texts.append(f"{a.get(sc.STALL_OUTCOME, '-')} in {a.get(sc.STALL_PHASE, '-')}: detected after "
                     f"{_seconds(a.get(sc.STALL_WAITED))}, blame {a.get(sc.BLAME, '-')}{engine}; {state}")
    return texts


def _stall_span_of(event_attributes: dict, stall_spans: list[Span]) -> Span | None:
    """The stall span exported for a stall event: of its code and phase; the same code can
    stall twice (a stream with two long gaps), each span then taken in turn by its wait."""
    code, phase = event_attributes.get(sc.STALL_OUTCOME), event_attributes.get(sc.STALL_PHASE)
    waited = event_attributes.get(sc.STALL_WAITED)
    same = [s for s in stall_spans if s.attributes.get(sc.STALL_OUTCOME) == code
            and s.attributes.get(sc.STALL_PHASE) == phase]
    exact = [s for s in same if waited is not None and s.attributes.get(sc.STALL_WAITED) == waited]
    return (exact or same or [None])[0]


def _ended_stalled_at(found: RequestSpans) -> Span | None:
    """The stall span of the stall the request ended in (or is still in, with no SERVER
    span yet): the one whose engine facts say where the engines held it."""
    if found.server is None:
        return found.stalls[-1] if found.stalls else None
    if found.server.attributes.get(sc.OUTCOME) == "OK":
        return None
    cause = _open_stall(found.server)
    return _stall_span_of(cause, found.stalls) if cause is not None else None


def _stalls_from_spans(stalls: list[Span]) -> list[str]:
    return [f"{s.attributes.get(sc.STALL_OUTCOME, '-')} ({s.attributes.get(sc.OUTCOME_NAME, '-')}) in "
            f"{s.attributes.get(sc.STALL_PHASE, '-')}: detected after {_seconds(s.attributes.get(sc.STALL_WAITED))}, "
            f"blame {s.attributes.get(sc.BLAME, '-')}{_engine_at_stall(s)} at {wall_clock(s.end_ns)}"
            + (f": {s.status_message}" if s.status_message else "") for s in stalls]


def _engine_at_stall(stall: Span) -> str:
    """`` (kv_transfer: prefill prefill_transfer_kv_cache, sglang pid 7; from spans)``, when the
    stall span says where the engines had the request."""
    a = stall.attributes
    if sc.ENGINE_COMPONENT not in a:
        return ""
    where = " ".join(str(part) for part in (a.get(sc.ENGINE_ROLE), a.get(sc.ENGINE_STAGE)) if part)
    worker = " ".join(str(part) for part in (a.get(sc.ENGINE_WORKER_SERVICE), a.get(sc.ENGINE_WORKER_PID) is not None
                                             and f"pid {a[sc.ENGINE_WORKER_PID]}") if part)
    detail = f"; {a[sc.ENGINE_DETAIL]}" if a.get(sc.ENGINE_DETAIL) else ""
    return (f" ({a[sc.ENGINE_COMPONENT]}: {where}{', ' + worker if worker else ''}{detail}; "
            f"from {a.get(sc.ENGINE_SOURCE, '-')})")


def _downstream_lines(found: RequestSpans) -> list[str]:
    if not found.downstream:
        return []
    return ["  spans below the proxy (router, engines):"] + [
        f"  {'  ' * found.depth.get(s.span_id, 1)}{s.service or '-'}: {s.name}, "
        f"{duration(_elapsed(s.end_ns, s.start_ns))}"
        + (f", status {s.status}" if s.status == "error" else "") for s in found.downstream]


def _join_key_line(found: RequestSpans) -> str:
    """Where to look next: the engines' logs, by trace id. Every router passes the trace
    on to both engines; the request id does not always get through (vllm-router sends the
    engines an x-request-id of its own)."""
    return (f"  engine logs: search by trace id {found.trace_id}, the join key through every router (behind "
            "vllm-router the engines' x-request-id is the router's own, not this request's)")


def report_lines(requests: list[RequestSpans], ident: str, source: str) -> list[str]:
    if not requests:
        return [f"traceproxy diagnose: no request with trace id or request id {ident!r} in {source}"]
    lines = [f"{len(requests)} requests match {ident!r} in {source}"] if len(requests) > 1 else []
    for index, found in enumerate(requests):
        if index:
            lines.append("")
        lines += request_lines(found)
    return lines


# ----------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------
def _not_in_span_file_lines(ident: str, where: SpanFile, unread: Unread) -> list[str]:
    """No such request in the file: why a request can be missing from a span file, or, when
    the file holds no span at all (an access log, a binary, the wrong path), that first;
    and what naming it could not be read, which may have held it."""
    [miss] = report_lines([], ident, str(where))
    skipped = [f"  {line}" for line in _unread_lines(unread, "it")]
    if not _is_empty(where.path) and not holds_spans(where.path):
        return [f"{miss}; no line of it is an OTLP span document: is it the span file?"] + skipped + pointing_lines()
    return [miss] + skipped + ["  A request is written there when it ends, and its stall span at once when it stalls; "
                               "a healthy one may be sampled out ([tracing] healthy_sample_ratio)."] + pointing_lines()


def _unread_lines(unread: Unread, named: str) -> list[str]:
    """What naming the request could not be read and was skipped, in a line; none when nothing was."""
    words = unread.words()
    if not words:
        return []
    return [f"{words} naming {named} could not be read (a line that is not an OTLP span document: torn, foreign; "
            "a span or event whose id or name is not a string): skipped"]


def _is_empty(path: Path) -> bool:
    try:
        return path.stat().st_size == 0
    except OSError:
        return False


def holds_spans(path: str | Path) -> bool:
    """Whether any line of the file is an OTLP/JSON traces document with a span in it, read
    or not: whether it is a span file at all. Stops at the first such line (a span file's
    first); only lines naming ``resourceSpans`` are parsed. True when the file cannot be
    read: nothing is known against it."""
    try:
        return any(_raw_spans_of(document) for _, document in _json_lines_with(Path(path), {'"resourceSpans"'}))
    except OSError:
        return True


def run(ident: str, spans_path: str | None = None, jaeger: str | None = None,
        service: str = DEFAULT_SERVICE, out=None, err=None, environ=None, access_log: str | None = None) -> int:
    """Print the timeline of the request(s) ``ident`` names; the exit status.
    ``spans_path``, ``access_log`` None: the variable serve reads, else serve's default."""
    out, err = out or sys.stdout, err or sys.stderr
    ident = ident.strip()
    if not ident:
        print("traceproxy diagnose: give a trace id or a request id", file=err)
        return ERROR
    for flag, value, what in (("--spans", spans_path, "span file"), ("--access-log", access_log, "access log")):
        if value is not None and not value.strip():
            print(f"traceproxy diagnose: {flag} takes the {what}'s path, not an empty string", file=err)
            return ERROR
    where = None if jaeger else span_file(spans_path, environ)
    unread = Unread()
    try:
        spans = fetch_jaeger(jaeger, ident, service) if jaeger else file_spans(where.path, ident, unread)
    except DiagnoseError as exc:
        if where is not None and where.path.is_dir():
            lines = [f"traceproxy diagnose: {where} is a folder: give the span file in it"] + pointing_lines()
        elif where is not None and not where.path.is_file():
            lines = [f"traceproxy diagnose: no span file at {where}"] + pointing_lines()
        else:
            lines = [f"traceproxy diagnose: {exc}"]
        print("\n".join(lines), file=err)
        return ERROR
    requests = find_requests(spans, ident)
    access = access_log_file(access_log, environ)
    if requests and access is not None:
        try:
            entries = access_log_lines(access.path, {found.trace_id for found in requests})
        except DiagnoseError as exc:
            print(f"traceproxy diagnose: {exc} ({access.named_by}); --access-log PATH or {ACCESS_LOG_ENV}=PATH "
                  "names the file serve writes ([access_log] path)", file=err)
            return ERROR
        for found in requests:
            found.access_log = entries.get(found.trace_id)
    if not requests and where is not None:
        print("\n".join(_not_in_span_file_lines(ident, where, unread)), file=err)
        return NOT_FOUND
    source = f"Jaeger at {jaeger} (service {service})" if jaeger else str(where)
    # Said under the report, found or not: what was skipped may have been part of it.
    lines = report_lines(requests, ident, source) + _unread_lines(unread, f"{ident!r} or its trace")
    print("\n".join(lines), file=out if requests else err)
    return FOUND if requests else NOT_FOUND


def add_arguments(parser) -> None:
    """The ``traceproxy diagnose`` arguments, on an argparse (sub)parser."""
    parser.description = ("Print one request's timeline from its spans: the marks in order with the gaps, "
                          "bytes, the keep-alive ledger, each upstream attempt, stalls, and the outcome with "
                          "its blame. Exit status: 0 found, 1 not found, 2 usage or I/O error.")
    parser.add_argument("id", metavar="ID", help="a trace id (32 hex digits) or a request id (x-request-id)")
    parser.add_argument("--spans", default=None, metavar="PATH",
                        help=f"the proxy's span file, OTLP/JSON lines (default: ${SPANS_ENV} as serve reads it, "
                        f"else {DEFAULT_SPANS}; relative to the current folder)")
    parser.add_argument("--access-log", default=None, metavar="PATH",
                        help=f"the proxy's access log, read for where the engines had the request when it ended "
                        f"(default: ${ACCESS_LOG_ENV} as serve reads it, else {DEFAULT_ACCESS_LOG}; stdout or off: "
                        "not read; relative to the current folder)")
    parser.add_argument("--jaeger", metavar="URL", default=None,
                        help="ask Jaeger's HTTP query API instead (e.g. http://127.0.0.1:16686)")
    parser.add_argument("--service", default=DEFAULT_SERVICE,
                        help="the proxy's service name in Jaeger, for request id searches "
                        f"(default: {DEFAULT_SERVICE})")


def run_args(args) -> int:
    return run(args.id, args.spans, args.jaeger, args.service, access_log=args.access_log)
