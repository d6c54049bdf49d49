"""Real OTLP receivers for tests: the protobuf wire format over HTTP and over gRPC.

Both decode ``ExportTraceServiceRequest`` exactly as a collector would and keep the
spans in a thread-safe list, flattened to ``ReceivedSpan`` records (resource
attributes, scope, the protobuf span, hex ids, decoded attributes).

Modes, switchable while running (``receiver.mode = "..."``):
- ``"ok"``: accept and answer an empty ``ExportTraceServiceResponse``.
- ``"black_hole"``: accept the connection (or the RPC), never answer.
- ``"slow"``: answer ``ok`` after ``delay`` seconds.
- ``"error"``: HTTP 503 / gRPC UNAVAILABLE (both retryable for the OTel exporters).

Usable from synchronous fixtures: ``receiver = OtlpHttpReceiver().start()`` ...
``receiver.stop()``, or ``with OtlpHttpReceiver() as receiver:``. Every wait is
bounded; ``stop()`` releases black-holed requests.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

MODES = ("ok", "black_hole", "slow", "error")
BLACK_HOLE_LIMIT = 60.0  # a black-holed request is released by stop(), or after this
PROTOBUF = "application/x-protobuf"


class ReceivedSpan(NamedTuple):
    resource: dict[str, Any]
    scope_name: str
    scope_version: str
    span: Span
    trace_id: str  # lowercase hex
    span_id: str
    parent_span_id: str  # "" for a root span
    name: str
    attributes: dict[str, Any]
    schema_urls: tuple[str, str] = ("", "")  # the resource spans' and the scope spans'


def hex_id(raw: bytes) -> str:
    return raw.hex()


def any_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return attributes_dict(value.kvlist_value.values)
    return getattr(value, kind) if kind else None


def attributes_dict(key_values) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in key_values}


def flatten(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    received = []
    for resource_spans in request.resource_spans:
        resource = attributes_dict(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            scope = scope_spans.scope
            for span in scope_spans.spans:
                received.append(
                    ReceivedSpan(
                        resource, scope.name, scope.version, span, hex_id(span.trace_id),
                        hex_id(span.span_id), hex_id(span.parent_span_id), span.name,
                        attributes_dict(span.attributes), (resource_spans.schema_url, scope_spans.schema_url),
                    )
                )
    return received


class SpanCollector:
    """Thread-safe store of everything received."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._spans: list[ReceivedSpan] = []
        self.requests = 0  # export requests that reached a handler, whatever the mode

    def count_request(self) -> None:
        with self._changed:
            self.requests += 1

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self._changed:
            self._spans.extend(flatten(request))
            self._changed.notify_all()

    def spans(self) -> list[ReceivedSpan]:
        with self._changed:
            return list(self._spans)

    def wait_for_spans(self, count: int, timeout: float = 10.0) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(self._spans) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"received {len(self._spans)} spans, waited {timeout}s for {count}")
                self._changed.wait(remaining)
            return list(self._spans)

    def find(self, name: str | None = None, trace_id: int | str | None = None) -> list[ReceivedSpan]:
        if isinstance(trace_id, int):
            trace_id = f"{trace_id:032x}"
        return [
            s for s in self.spans()
            if (name is None or s.name == name) and (trace_id is None or s.trace_id == trace_id)
        ]


class _Receiver(SpanCollector):
    def __init__(self, mode: str = "ok", delay: float = 2.0) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.mode, self.delay = mode, delay
        self.port = 0
        self._released = threading.Event()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def hold(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; False when stop() cut it short."""
        return not self._released.wait(seconds)


# ----------------------------------------------------------------------------- HTTP
class OtlpHttpReceiver(_Receiver):
    """``POST /v1/traces`` with ``application/x-protobuf`` (identity, gzip or deflate)."""

    def __init__(self, mode: str = "ok", delay: float = 2.0) -> None:
        super().__init__(mode, delay)
        self.headers_seen: list[dict[str, str]] = []
        self._server: ThreadingHTTPServer | None = None

    @property
    def traces_url(self) -> str:
        return self.endpoint + "/v1/traces"

    def start(self) -> "OtlpHttpReceiver":
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        self._released.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def _handler_for(receiver: OtlpHttpReceiver):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            receiver.count_request()
            receiver.headers_seen.append({k.lower(): v for k, v in self.headers.items()})
            if receiver.mode == "black_hole":
                receiver.hold(BLACK_HOLE_LIMIT)
                self.close_connection = True
                return
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path != "/v1/traces":
                return self._reply(404, b"", "text/plain")
            if (self.headers.get("Content-Type") or "").split(";")[0].strip() != PROTOBUF:
                return self._reply(415, b"", "text/plain")
            if receiver.mode == "slow" and not receiver.hold(receiver.delay):
                self.close_connection = True
                return
            if receiver.mode == "error":
                return self._reply(503, b"unavailable", "text/plain")
            request = trace_service_pb2.ExportTraceServiceRequest.FromString(self._decoded(body))
            receiver.add(request)
            self._reply(200, trace_service_pb2.ExportTraceServiceResponse().SerializeToString(), PROTOBUF)

        def _decoded(self, body: bytes) -> bytes:
            encoding = (self.headers.get("Content-Encoding") or "").strip().lower()
            if encoding == "gzip":
                return gzip.decompress(body)
            if encoding == "deflate":
                return zlib.decompress(body)
            return body

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args) -> None:
            pass

    return Handler


# ----------------------------------------------------------------------------- gRPC
class OtlpGrpcReceiver(_Receiver):
    """``opentelemetry.proto.collector.trace.v1.TraceService/Export`` over insecure gRPC."""

    def __init__(self, mode: str = "ok", delay: float = 2.0) -> None:
        super().__init__(mode, delay)
        self._server: grpc.Server | None = None

    def start(self) -> "OtlpGrpcReceiver":
        self._server = grpc.server(ThreadPoolExecutor(max_workers=8))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        return self

    def stop(self) -> None:
        self._released.set()
        if self._server is not None:
            self._server.stop(grace=0).wait(5)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpGrpcReceiver) -> None:
        self._receiver = receiver

    def Export(self, request, context):
        receiver = self._receiver
        receiver.count_request()
        if receiver.mode == "black_hole":
            deadline = time.monotonic() + BLACK_HOLE_LIMIT
            while context.is_active() and time.monotonic() < deadline and receiver.hold(0.05):
                pass
            context.abort(grpc.StatusCode.UNAVAILABLE, "black hole released")
        if receiver.mode == "slow" and not receiver.hold(receiver.delay):
            context.abort(grpc.StatusCode.UNAVAILABLE, "receiver stopping")
        if receiver.mode == "error":
            context.abort(grpc.StatusCode.UNAVAILABLE, "test receiver in error mode")
        receiver.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()
