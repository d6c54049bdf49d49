"""SGLang-shaped engine spans as OTLP bytes, for the receiver and join tests.

``Request`` builds one request's spans on one worker as SGLang exports them
(``python/sglang/srt/tracing/trace.py``; the simulated workers export the same): stage
spans under the worker's scheduler-thread span, which with the Req and Bootstrap Room
spans is exported only when the request ends there. ``export_request`` wraps spans in an
``ExportTraceServiceRequest`` with SGLang's resource and scope.
"""

from __future__ import annotations

import os
import random
import time

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

HOST_ID = "0123456789abcdef0123456789abcdef"
STAGES = {
    "prefill": ("prefill_prepare", "prefill_bootstrap", "prefill_waiting", "prefill_forward",
                "prefill_transfer_kv_cache"),
    "decode": ("decode_prepare", "decode_bootstrap", "decode_transferred", "decode_waiting", "decode_forward"),
}
LABELS = {"prefill": "Prefill Scheduler", "decode": "Decode Scheduler", "unified": "Scheduler"}


def span_id() -> bytes:
    return random.getrandbits(64).to_bytes(8, "big") or b"\x00" * 7 + b"\x01"


class Request:
    """One request's spans on one worker: ``stages(n)`` the first n stages ended,
    ``finish()`` the thread, Req and Bootstrap Room spans."""

    def __init__(self, trace_id: int, role: str, pid: int = 4242, host: str = HOST_ID, parent: bytes = b"",
                 room: int = 7, rid: str = "a1b2c3d4e5f6") -> None:
        self.trace_id, self.role, self.pid, self.host = trace_id.to_bytes(16, "big"), role, pid, host
        self.room_id, self.req_id, self.thread_id = span_id(), span_id(), span_id()
        self.parent, self.room, self.rid = parent, room, rid
        self.clock = time.time_ns()  # the engine's wall clock, as the proxy's

    def _span(self, name: str, parent: bytes, own: bytes | None = None, **attributes) -> Span:
        span = Span(trace_id=self.trace_id, span_id=own or span_id(), parent_span_id=parent, name=name, kind=1,
                    start_time_unix_nano=self.clock, end_time_unix_nano=self.clock + 1000)
        for key, value in attributes.items():
            kv = span.attributes.add()
            kv.key = key
            if isinstance(value, int):
                kv.value.int_value = value
            else:
                kv.value.string_value = value
        self.clock += 1000
        return span

    def stages(self, count: int, start: int = 0) -> list[Span]:
        return [self._span(name, self.thread_id) for name in STAGES[self.role][start:count]]

    def nested(self, name: str, forward_id: bytes | None = None, **attributes) -> Span:
        return self._span(name, forward_id or span_id(), **attributes)

    def finish(self) -> list[Span]:
        label = LABELS[self.role]
        return [self._span(f"{label} [TP 0] (host:{self.host[:8]} | pid:{self.pid})", self.req_id, self.thread_id,
                           tp_rank=0, host_id=self.host, pid=self.pid, thread_label=label),
                self._span(f"{self.role} Req {self.rid[:8]}", self.room_id, self.req_id, rid=self.rid),
                self._span(f"Bootstrap Room {hex(self.room)}", self.parent, self.room_id,
                           bootstrap_room=hex(self.room))]


def export_request(spans: list[Span], service: str = "sglang", **resource) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    for key, value in {"service.name": service, "telemetry.sdk.language": "python", **resource}.items():
        kv = resource_spans.resource.attributes.add()
        kv.key = key
        if isinstance(value, int):
            kv.value.int_value = value
        else:
            kv.value.string_value = value
    scope_spans = resource_spans.scope_spans.add()
    scope_spans.scope.name = "sglang server"
    scope_spans.spans.extend(spans)
    return request


def payload(spans: list[Span], **resource) -> bytes:
    return export_request(spans, **resource).SerializeToString()


def random_trace_id() -> int:
    return int.from_bytes(os.urandom(16), "big") or 1
