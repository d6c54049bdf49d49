"""SGLang's request tracing on a simulated worker: the spans SGLang exports, over OTLP.

Theory of operation
-------------------
The shape is SGLang's (``python/sglang/srt/tracing/trace.py``, launched with
``--enable-trace``), for every inference request a worker serves:

    Bootstrap Room 0x<room>                     attribute bootstrap_room = "0x<room>"
    └── <role> Req <rid[:8]>                    attribute rid
        └── <Role> Scheduler [TP 0] (host:<host_id[:8]> | pid:<pid>)
              attributes tp_rank, host_id, pid, thread_label
            ├── <stage>                         one per stage of stages.py, in order
            └── prefill_forward / decode_forward
                └── chunked_prefill / fake_output, decode_loop (decode_ct)

The Bootstrap Room span is the child of the context the request's ``traceparent`` (and
``tracestate``) carries, when it carries a valid one (a router without
``--enable-trace`` forwards the caller's), else the root of a new trace. A request
without a room (a worker used alone) is room 0 and role "" (SGLang's unified mode).
Each stage span is exported when its stage ends; it links to the stage before it. The
thread span, the Req span and the Bootstrap Room span end when the request ends
(``RequestTrace.finish``); a request that ended early leaves the thread span with
status ERROR. While a request hangs, only its ended stages have been exported.

As SGLang: service.name is "sglang" (other resource attributes from
``OTEL_RESOURCE_ATTRIBUTES``), the scope is "sglang server", trace and span ids are 64
random bits, spans go through a ``BatchSpanProcessor`` (its delay and batch size from
``SGLANG_OTLP_EXPORTER_SCHEDULE_DELAY_MILLIS``, default 500, and
``SGLANG_OTLP_EXPORTER_MAX_EXPORT_BATCH_SIZE``, default 64), over OTLP/gRPC unless
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` is ``http/protobuf``.

Export is on only when an endpoint is known: ``--otlp-endpoint`` or the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``; otherwise
``make_tracing`` returns None and nothing is exported. Given explicitly, a gRPC
endpoint is ``HOST:PORT`` or ``http://HOST:PORT``; an HTTP one a base URL (``/v1/traces``
is appended) or the full traces URL, as SGLang's ``--otlp-traces-endpoint`` takes it.
Each worker has its own ``TracerProvider`` (never the global one).
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import uuid
from collections.abc import Mapping
from urllib.parse import urlsplit

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import Link, Span, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .stages import DECODE, PREFILL, UNIFIED

SERVICE_NAME = "sglang"
SCOPE_NAME = "sglang server"
TRACE_HEADERS = ("traceparent", "tracestate")
PROTOCOL_VARIABLE = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
PROTOCOLS = ("grpc", "http/protobuf")
DELAY_VARIABLE = "SGLANG_OTLP_EXPORTER_SCHEDULE_DELAY_MILLIS"
BATCH_VARIABLE = "SGLANG_OTLP_EXPORTER_MAX_EXPORT_BATCH_SIZE"
MAX_QUEUE_SIZE = 2048  # the BatchSpanProcessor's queue: a batch is no larger
THREAD_LABELS = {PREFILL: "Prefill Scheduler", DECODE: "Decode Scheduler", UNIFIED: "Scheduler"}
TP_RANK = 0  # one scheduler per simulated worker

_PROPAGATOR = TraceContextTextMapPropagator()


def configured_endpoint(explicit: str | None) -> str | None:
    return (explicit or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None)


def export_settings(environ: Mapping[str, str] = os.environ) -> tuple[str, int, int]:
    """(protocol, schedule delay in ms, batch size) from the environment, as SGLang reads them;
    a bad value is a ValueError naming its variable."""
    protocol = environ.get(PROTOCOL_VARIABLE) or "grpc"
    if protocol not in PROTOCOLS:
        raise ValueError(f"{PROTOCOL_VARIABLE}={protocol!r} is not supported (use {' or '.join(PROTOCOLS)})")
    return (protocol, _whole_number(environ, DELAY_VARIABLE, 500, 3_600_000),
            _whole_number(environ, BATCH_VARIABLE, 64, MAX_QUEUE_SIZE))


def _whole_number(environ: Mapping[str, str], name: str, default: int, most: int) -> int:
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return default
    if not (raw.strip().isascii() and raw.strip().isdigit() and 0 < int(raw) <= most):
        raise ValueError(f"{name}={raw!r} must be a whole number from 1 to {most}")
    return int(raw)


def check_endpoint(protocol: str, endpoint: str) -> None:
    """An explicit endpoint the exporter of ``protocol`` can use, else a ValueError saying what it takes."""
    if protocol == "http/protobuf":
        if not _http_url(endpoint):
            raise ValueError(f"--otlp-endpoint {endpoint!r}: over http/protobuf, an http(s):// URL such as "
                             "http://127.0.0.1:4318 (or its /v1/traces URL)")
        return
    host, sep, port = endpoint.rpartition(":")
    # A gRPC exporter takes scheme, host and port of a URL and drops its path: a /v1/traces
    # URL would go, silently, to whatever gRPC listens on that port (or nowhere).
    grpc_url = _http_url(endpoint) and urlsplit(endpoint).path in ("", "/")
    if not (grpc_url or (sep and host and "/" not in endpoint and port.isdigit() and 0 < int(port) < 65536)):
        raise ValueError(f"--otlp-endpoint {endpoint!r}: over gRPC, HOST:PORT such as 127.0.0.1:4317 "
                         "(or http://HOST:PORT, no path)")


def _http_url(endpoint: str) -> bool:
    try:
        parts = urlsplit(endpoint)
        return parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a port that is no number from 0 to 65535
        return False


def _exporter(protocol: str, explicit: str | None):
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        # SGLang passes its endpoint with insecure=True; from the environment the
        # exporter reads the endpoint, and whether it is secure, itself.
        return OTLPSpanExporter(endpoint=explicit, insecure=True) if explicit else OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    # From the environment the HTTP exporter appends /v1/traces to OTEL_EXPORTER_OTLP_ENDPOINT itself.
    return OTLPSpanExporter(endpoint=traces_url(explicit)) if explicit else OTLPSpanExporter()


def traces_url(endpoint: str) -> str:
    """A base URL gets ``/v1/traces``; a URL with a path is taken as the traces URL."""
    if urlsplit(endpoint).path in ("", "/"):
        return f"{endpoint.rstrip('/')}/v1/traces"
    return endpoint


class _RandomIds(IdGenerator):
    """SGLang's id generator: 64 random bits for trace and span ids alike."""

    def __init__(self) -> None:
        self._random = random.Random()

    def generate_span_id(self) -> int:
        return self._random.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        return self._random.getrandbits(64) or 1


def host_id() -> str:
    """How SGLang names the host: /etc/machine-id, else the MAC address, else "unknown"."""
    try:
        with open("/etc/machine-id") as f:
            machine_id = f.read().strip()
        if machine_id:
            return machine_id
    except OSError:
        pass
    mac = uuid.getnode()
    return uuid.UUID(int=mac).hex if mac else "unknown"


# How long a stopping worker gives its last spans: an exporter whose destination is gone
# retries for its whole timeout (10 s) with backoff, and the sim must still stop promptly.
SHUTDOWN_TIMEOUT_S = 1.5


class WorkerTracing:
    def __init__(self, role: str, provider: TracerProvider, exporter=None) -> None:
        self.role = role
        self.provider = provider
        self.exporter = exporter
        self.tracer: Tracer = provider.get_tracer(SCOPE_NAME)
        self.host_id = host_id()
        self.pid = os.getpid()  # a scheduler is a process of its own in SGLang; here the sim's

    def request(self, rid: str, room: int | None, headers: Mapping[str, str], mode: str) -> "RequestTrace":
        return RequestTrace(self, rid, room, headers, mode)

    async def shutdown(self) -> None:
        # shutdown() flushes over the network: off the event loop.
        await asyncio.to_thread(self._shutdown)

    def _shutdown(self) -> None:
        """The provider's shutdown sends what is left, for up to SHUTDOWN_TIMEOUT_S; then the
        exporter is shut down under it, which ends a retry in progress (and the provider's
        own call to it then only logs that it already was)."""
        flush = threading.Thread(target=self.provider.shutdown, name="sim-tracing-shutdown", daemon=True)
        flush.start()
        flush.join(SHUTDOWN_TIMEOUT_S)
        if flush.is_alive() and self.exporter is not None:
            self.exporter.shutdown()
            flush.join(SHUTDOWN_TIMEOUT_S)


class RequestTrace:
    """One request's spans on one worker (see the module docstring)."""

    def __init__(self, tracing: WorkerTracing, rid: str, room: int | None, headers: Mapping[str, str],
                 mode: str, start_ns: int | None = None) -> None:
        self.tracer = tracing.tracer
        carrier = {name: headers[name] for name in TRACE_HEADERS if name in headers}
        external: Context = _PROPAGATOR.extract(carrier)
        room_hex = hex(room or 0)
        self.room_span = self.tracer.start_span(f"Bootstrap Room {room_hex}", context=external,
                                                start_time=start_ns, attributes={"bootstrap_room": room_hex})
        role = "" if mode == UNIFIED else mode
        self.req_span = self.tracer.start_span(f"{role} Req {rid[:8]}", context=set_span_in_context(self.room_span),
                                               start_time=start_ns, attributes={"rid": rid})
        label = THREAD_LABELS[mode]
        self.thread_span = self.tracer.start_span(
            f"{label} [TP {TP_RANK}] (host:{tracing.host_id[:8]} | pid:{tracing.pid})",
            context=set_span_in_context(self.req_span), start_time=start_ns,
            attributes={"tp_rank": TP_RANK, "host_id": tracing.host_id, "pid": tracing.pid, "thread_label": label})
        self._open: list[tuple[str, Span]] = []  # the open stages, innermost last
        self._previous = None  # the last top-level stage that ended: the next one links to it
        self.finished = False

    def stage(self, name: str, start_ns: int, end_ns: int, attributes: dict | None = None) -> None:
        """A stage that ran from ``start_ns`` to ``end_ns``, exported now."""
        span = self._start(name, start_ns)
        if attributes:
            span.set_attributes(attributes)
        span.end(end_time=end_ns)
        if not self._open:
            self._previous = span.get_span_context()

    def open(self, name: str, start_ns: int) -> None:
        """A stage that has begun and contains others; ``close`` ends it."""
        self._open.append((name, self._start(name, start_ns)))

    def close(self, name: str, end_ns: int) -> None:
        if self._open and self._open[-1][0] == name:
            _, span = self._open.pop()
            span.end(end_time=end_ns)
            if not self._open:
                self._previous = span.get_span_context()

    def finish(self, end_ns: int, error: str | None = None) -> None:
        """The request ended: its open stages end, then the thread, Req and Bootstrap Room spans."""
        if self.finished:
            return
        self.finished = True
        while self._open:
            self._open.pop()[1].end(end_time=end_ns)
        if error:
            self.thread_span.set_status(Status(StatusCode.ERROR, error))
        for span in (self.thread_span, self.req_span, self.room_span):
            span.end(end_time=end_ns)

    def _start(self, name: str, start_ns: int) -> Span:
        parent = self._open[-1][1] if self._open else self.thread_span
        links = [Link(self._previous)] if self._previous is not None and not self._open else None
        return self.tracer.start_span(name, context=set_span_in_context(parent), start_time=start_ns, links=links)


def make_tracing(role: str, explicit_endpoint: str | None) -> WorkerTracing | None:
    if configured_endpoint(explicit_endpoint) is None:
        return None
    protocol, delay_ms, batch_size = export_settings()
    # Resource.create: OTEL_RESOURCE_ATTRIBUTES adds to it, service.name stays SGLang's.
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}), id_generator=_RandomIds())
    exporter = _exporter(protocol, explicit_endpoint)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=delay_ms,
                                                   max_export_batch_size=batch_size))
    return WorkerTracing(role, provider, exporter)
