"""The benchmark's OTLP sink: ``python -m traceproxy.bench.sink_proc --port-file F [--stats-file F]``.

A stand-in collector for the ``proxy-traced`` target, in its own process so its
work is not charged to the proxy. ``POST /v1/traces`` (OTLP over http/protobuf)
is answered 200 with an empty ``application/x-protobuf`` body, which is an empty
``ExportTraceServiceResponse``; every request is counted with its bytes and spans
(the body is decoded as an ``ExportTraceServiceRequest``, gzip or deflate first if
so encoded). ``GET /stats`` answers the counts as JSON; on SIGTERM they are also
written to ``--stats-file`` before the process exits.
"""

from __future__ import annotations

import argparse
import gzip
import json
import signal
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .procs import write_json_file, write_port_file

TRACES_PATH = "/v1/traces"
PROTOBUF = "application/x-protobuf"


class Counts:
    """What the sink received; updated by the handler threads under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.bytes = 0  # request bodies as received (compressed, if they were)
        self.spans = 0
        self.undecodable = 0
        self.other = 0  # requests to anything but POST /v1/traces or GET /stats

    def add(self, size: int, spans: int | None) -> None:
        with self._lock:
            self.requests += 1
            self.bytes += size
            if spans is None:
                self.undecodable += 1
            else:
                self.spans += spans

    def add_other(self) -> None:
        with self._lock:
            self.other += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {"requests": self.requests, "bytes": self.bytes, "spans": self.spans,
                    "undecodable": self.undecodable, "other": self.other}


def count_spans(body: bytes, encoding: str) -> int | None:
    """Spans in one OTLP/protobuf export request, or None when it does not decode."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    try:
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        request = ExportTraceServiceRequest.FromString(body)
    except Exception:  # corrupt body or compression: counted, never fatal
        return None
    return sum(len(scope.spans) for resource in request.resource_spans for scope in resource.scope_spans)


class SinkHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the OTLP exporter's HTTP session expects
    server: "SinkServer"

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.server.counts.add_other()
            self._answer(411, close=True)
            return
        body = self.rfile.read(int(length))
        if self.path.split("?", 1)[0] != TRACES_PATH:
            self.server.counts.add_other()
            self._answer(404)
            return
        encoding = (self.headers.get("Content-Encoding") or "").strip().lower()
        self.server.counts.add(len(body), count_spans(body, encoding))
        self._answer(200, content_type=PROTOBUF)

    def do_GET(self) -> None:  # noqa: N802
        if self.path != "/stats":
            self.server.counts.add_other()
            self._answer(404)
            return
        self._answer(200, json.dumps(self.server.counts.snapshot()).encode(), "application/json")

    def _answer(self, status: int, body: bytes = b"", content_type: str = "text/plain",
                close: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if body:
            self.wfile.write(body)

    def log_message(self, format, *args) -> None:  # noqa: A002 - quiet: thousands of exports
        pass


class SinkServer(ThreadingHTTPServer):
    daemon_threads = True  # idle keep-alive connections must not hold up the exit

    def __init__(self, address: tuple[str, int]) -> None:
        super().__init__(address, SinkHandler)
        self.counts = Counts()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="traceproxy.bench.sink_proc")
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--stats-file", help="where to write the final counts as JSON on SIGTERM")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = SinkServer(("127.0.0.1", 0))
    serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    serving.start()
    write_port_file(args.port_file, server.server_address[1])
    while not stop.wait(1.0):
        pass
    if args.stats_file:
        write_json_file(args.stats_file, server.counts.snapshot())
    server.shutdown()
    server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
