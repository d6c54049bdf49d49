"""CPU a span of writing relayed engine requests as span-file lines, against protobuf's
mapping (``MessageToDict`` and ``json.dumps``, the route before ``otlp_relay``'s walk).

Run: ``python3 -m tests.relay_line_cost [REQUESTS]``. The requests are the simulator's
SGLang workers' spans (``traceproxy.sim.otel``: stages linked one to the next, nested
decode loops with a batch size, the thread span's attributes), encoded by the OTel SDK
as its exporter sends them, 512 spans to a request. Best of five rounds, process time.
"""

from __future__ import annotations

import json
import sys
import time

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from traceproxy.observe.otlp_relay import _reference, line
from traceproxy.sim import otel

BATCH = 512
STAGES = ("decode_prepare", "decode_bootstrap", "decode_transferred", "decode_waiting")


def sdk_requests(requests: int) -> tuple[list[bytes], int]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "sglang"}), id_generator=otel._RandomIds())
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing = otel.WorkerTracing("decode", provider)
    clock = time.time_ns()
    for number in range(requests):
        trace = tracing.request(f"{number:032x}", number, {}, "decode")
        for stage in STAGES:
            trace.stage(stage, clock, clock + 1000)
            clock += 1000
        trace.open("decode_forward", clock)
        for _ in range(3):
            trace.stage("decode_loop", clock, clock + 500, {"batch_size": 8})
            clock += 500
        trace.close("decode_forward", clock)
        trace.finish(clock)
    spans = memory.get_finished_spans()
    return [encode_spans(spans[i:i + BATCH]).SerializeToString() for i in range(0, len(spans), BATCH)], len(spans)


def protobuf_line(payload: bytes) -> bytes:
    document = _reference(ExportTraceServiceRequest.FromString(payload))
    return json.dumps(document, separators=(",", ":")).encode("utf-8")


def microseconds_a_span(write, bodies: list[bytes], spans: int) -> float:
    best = float("inf")
    for _ in range(5):
        started = time.process_time()
        for body in bodies:
            write(body)
        best = min(best, time.process_time() - started)
    return best / spans * 1e6


def main(argv: list[str]) -> None:
    bodies, spans = sdk_requests(int(argv[0]) if argv else 300)
    assert all(json.loads(line(body)) == json.loads(protobuf_line(body)) for body in bodies)
    print(f"{spans} spans in {len(bodies)} requests, {sum(map(len, bodies)) / spans:.0f} bytes a span")
    print(f"MessageToDict + json.dumps: {microseconds_a_span(protobuf_line, bodies, spans):.2f} us a span")
    print(f"otlp_relay.line:            {microseconds_a_span(line, bodies, spans):.2f} us a span")


if __name__ == "__main__":
    main(sys.argv[1:])
