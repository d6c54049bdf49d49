"""One emulated SGLang worker exporting its spans: ``python -m traceproxy.bench.span_load --role R --rate N
--url URL --out F --max-seconds S``.

The bench's ``--engine-span-load`` starts two of these, prefill and decode, for every measured
run. The spans are the simulator's own (``traceproxy.sim.otel.RequestTrace``, SGLang's shape:
9 a request from prefill, 25 from decode for 16 tokens), recorded once per role as a template;
each request is the template with a fresh trace id and its times moved to now. They are queued
as requests come and sent as SGLang's ``BatchSpanProcessor`` sends them: 64 an export request,
or whatever is queued every 500 ms, one request at a time over one connection.

The same work is done whatever the destination, so that every target of the bench pays the
emulated engines' own CPU alike: ``--url http://HOST:PORT/v1/traces`` is OTLP/HTTP (a proxy's
receiver, or the bench's discard sink for a target without one), ``--url grpc://HOST:PORT``
OTLP/gRPC. A destination not up yet, or answering anything but success, is counted as not sent
and not retried (the SDK's exporter drops too).

It prints ``ready`` once its template is built, waits for ``go`` on stdin, and exports until
SIGTERM (the bench stops it by its process group when the run's load has ended), stdin closing,
or ``--max-seconds``; then it writes its counts as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import http.client
import os
import random
import signal
import sys
import threading
import time
from urllib.parse import urlsplit

from .procs import write_json_file

BATCH = 64  # SGLANG_OTLP_EXPORTER_MAX_EXPORT_BATCH_SIZE's default
DELAY_S = 0.5  # SGLANG_OTLP_EXPORTER_SCHEDULE_DELAY_MILLIS's default
DECODE_STEPS = 16  # S5's requests: 16 tokens
SEND_TIMEOUT_S = 2.0  # under the bench's grace between SIGTERM and SIGKILL, so a stuck export cannot outlast it
FAILURES_LOGGED = 3  # the first few failed exports are said on stderr (the bench's log of this process)
MAX_QUEUE = 2048  # the BatchSpanProcessor's queue; past it spans are dropped, as the SDK drops them
PREFILL_STAGES = ("prefill_prepare", "prefill_bootstrap", "prefill_waiting")
DECODE_STAGES = ("decode_prepare", "decode_bootstrap", "decode_transferred", "decode_waiting")


def template(role: str):
    """One request's spans of ``role``, as the simulator ends and exports them: (resource, spans
    in the order they end, the earliest start)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from ..sim.otel import SERVICE_NAME, RequestTrace, WorkerTracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    step, t = 1_000_000, time.time_ns()
    trace = RequestTrace(WorkerTracing(role, provider), "%032x" % random.getrandbits(128), random.getrandbits(63),
                         {}, role, start_ns=t)
    for name in PREFILL_STAGES if role == "prefill" else DECODE_STAGES:
        trace.stage(name, t, t + step)
        t += step
    forward = "prefill_forward" if role == "prefill" else "decode_forward"
    trace.open(forward, t)
    nested = ["chunked_prefill"] if role == "prefill" else ["fake_output"] + ["decode_loop"] * DECODE_STEPS
    for name in nested:
        trace.stage(name, t, t + step, {"decode_ct": 1} if name == "decode_loop" else None)
        t += step
    trace.close(forward, t)
    if role == "prefill":
        trace.stage("prefill_transfer_kv_cache", t, t + step)
        t += step
    trace.finish(t)
    [resource_spans] = encode_spans(exporter.get_finished_spans()).resource_spans
    spans = sorted((span for scope in resource_spans.scope_spans for span in scope.spans),
                   key=lambda span: span.end_time_unix_nano)
    return resource_spans, spans, min(span.start_time_unix_nano for span in spans)


_failures = 0


def _say_failure(what: str) -> None:
    global _failures
    _failures += 1
    if _failures <= FAILURES_LOGGED:
        print(f"span_load: an export failed at {time.monotonic():.3f}: {what}", file=sys.stderr, flush=True)


class HttpSender:
    """OTLP/HTTP over one keep-alive connection, reopened after a failure."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port, self.path = parts.hostname, parts.port, parts.path or "/v1/traces"
        self.conn: http.client.HTTPConnection | None = None

    def send(self, body: bytes) -> bool:
        try:
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=SEND_TIMEOUT_S)
            self.conn.request("POST", self.path, body, {"Content-Type": "application/x-protobuf"})
            answer = self.conn.getresponse()
            answer.read()
            if answer.status != 200:
                _say_failure(f"answered {answer.status}")
            return answer.status == 200
        except (OSError, http.client.HTTPException) as exc:
            _say_failure(repr(exc))
            self.close()
            return False

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.conn = None


class GrpcSender:
    """OTLP/gRPC's TraceService/Export, unary, on one channel."""

    def __init__(self, url: str) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub

        self.grpc = grpc
        self.channel = grpc.insecure_channel(urlsplit(url).netloc)
        self.export = TraceServiceStub(self.channel).Export

    def send(self, request) -> bool:
        try:
            self.export(request, timeout=SEND_TIMEOUT_S)
            return True
        except self.grpc.RpcError as exc:
            _say_failure(repr(exc))
            return False

    def close(self) -> None:
        self.channel.close()


class Load:
    def __init__(self, role: str, rate: float, url: str) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.role, self.rate = role, rate
        self.resource_spans, self.spans, self.base = template(role)
        self.request_type = ExportTraceServiceRequest
        self.grpc = url.startswith("grpc://")
        self.sender = GrpcSender(url) if self.grpc else HttpSender(url)
        self.queue: list = []
        self.counts = {"requests": 0, "spans_sent": 0, "spans_not_sent": 0, "spans_dropped": 0, "exports_failed": 0}

    def add_request(self) -> None:
        """One request's spans, with a trace id of its own and times moved to now."""
        if len(self.queue) + len(self.spans) > MAX_QUEUE:
            self.counts["spans_dropped"] += len(self.spans)
            return
        trace_id = random.getrandbits(128).to_bytes(16, "big")
        shift = time.time_ns() - self.base
        for span in self.spans:
            copy = type(span)()
            copy.CopyFrom(span)
            copy.trace_id = trace_id
            copy.start_time_unix_nano += shift
            copy.end_time_unix_nano += shift
            self.queue.append(copy)
        self.counts["requests"] += 1

    def export_batch(self) -> None:
        batch, self.queue = self.queue[:BATCH], self.queue[BATCH:]
        request = self.request_type()
        resource_spans = request.resource_spans.add()
        resource_spans.resource.CopyFrom(self.resource_spans.resource)
        scope = resource_spans.scope_spans.add()
        scope.scope.CopyFrom(self.resource_spans.scope_spans[0].scope)
        scope.spans.extend(batch)
        sent = self.sender.send(request if self.grpc else request.SerializeToString())
        self.counts["spans_sent" if sent else "spans_not_sent"] += len(batch)
        if not sent:
            self.counts["exports_failed"] += 1

    def run(self, stop: "Stop", max_seconds: float) -> float:
        """Export until ``stop`` or ``max_seconds``; the seconds it ran."""
        start = time.monotonic()
        next_request = last_flush = start
        while not stop.is_set():
            now = time.monotonic()
            if now - start >= max_seconds:
                break
            while next_request <= now:  # the requests due by now
                self.add_request()
                next_request += 1.0 / self.rate
            while len(self.queue) >= BATCH or (self.queue and now - last_flush >= DELAY_S):
                last_flush = now
                self.export_batch()
            time.sleep(max(0.0, min(next_request - time.monotonic(), 0.005)))
        self.sender.close()
        return time.monotonic() - start


class Stop:
    """Set from a signal handler or the stdin thread; read by the loop. A plain flag: a
    ``threading.Event`` set from a signal handler deadlocks when the signal lands while the
    loop holds the event's lock (in its ``wait``), and the process then ignores SIGTERM."""

    def __init__(self) -> None:
        self.stopped = False

    def set(self) -> None:
        self.stopped = True

    def is_set(self) -> bool:
        return self.stopped


def _stop_on_signal_or_eof(stop: Stop) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def watch_stdin() -> None:  # the bench gone: stdin closes
        # os.read, not sys.stdin: a daemon thread blocked inside sys.stdin's buffer holds its
        # lock, and the interpreter's exit, closing stdin, would wait for it forever.
        while os.read(0, 4096):
            pass
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()


def _wait_for_go() -> bool:
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(0, 64)
        if not chunk:
            return False
        line += chunk
    return line.strip() == b"go"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="traceproxy.bench.span_load")
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    parser.add_argument("--rate", type=float, required=True, help="requests a second whose spans are exported")
    parser.add_argument("--url", required=True, help="http://HOST:PORT/v1/traces or grpc://HOST:PORT")
    parser.add_argument("--out", required=True, help="where to write the counts as JSON")
    parser.add_argument("--max-seconds", type=float, default=120.0)
    args = parser.parse_args(argv)
    if not 0 < args.rate <= 100_000:
        parser.error("--rate must be > 0 and at most 100000")
    load = Load(args.role, args.rate, args.url)
    print("ready", flush=True)
    if not _wait_for_go():
        return 1
    stop = Stop()
    _stop_on_signal_or_eof(stop)
    cpu0 = time.process_time()
    elapsed = load.run(stop, args.max_seconds)
    result = {"role": args.role, "rate": args.rate, "protocol": "grpc" if load.grpc else "http",
              "elapsed": elapsed, "cpu_s": time.process_time() - cpu0, "pid": os.getpid(), **load.counts}
    write_json_file(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
