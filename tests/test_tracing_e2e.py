"""Tracing end to end through the composition root: the proxy's spans reach a real
OTLP receiver (gRPC and HTTP/protobuf) with the right links, kinds, attributes,
events and end times; a collector that is down or black-holing costs nothing but
dropped spans."""

from __future__ import annotations

import asyncio
import time

import pytest

from traceproxy.proxy import tracecontext as tc

from .otlp_receiver import OtlpGrpcReceiver, OtlpHttpReceiver
from .support import RawClient, admin_get, header_value, wait_until

TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
BODY = b'{"model": "llama-70b", "stream": true, "max_tokens": 3, "messages": []}'
EVENTS = [b'data: {"choices": [{"delta": {"content": "a"}, "finish_reason": null}]}\n\n',
          b'data: {"choices": [{"delta": {}, "finish_reason": "stop"}], '
          b'"usage": {"prompt_tokens": 7, "completion_tokens": 3}}\n\n',
          b"data: [DONE]\n\n"]


def _sse_upstream(last_write_wall_ns: list):
    async def handler(reader, writer, upstream):
        await reader.read_request()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for event in EVENTS:
            await asyncio.sleep(0.05)
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
        last_write_wall_ns.append(time.time_ns())
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read(1)

    return handler


@pytest.mark.parametrize("receiver_cls,protocol", [(OtlpHttpReceiver, "http/protobuf"), (OtlpGrpcReceiver, "grpc")],
                         ids=["http-protobuf", "grpc"])
def test_spans_reach_the_collector_linked_and_ended_at_the_last_byte(receiver_cls, protocol, scripted_upstream,
                                                                     start_proxy):
    last_write: list[int] = []
    up = scripted_upstream(_sse_upstream(last_write))
    with receiver_cls() as receiver:
        # An http:// endpoint means plaintext for gRPC too (the OTel SDK's rule).
        proxy = start_proxy(up.url, **{"tracing.exporter": "otlp", "tracing.otlp_endpoint": receiver.endpoint,
                                       "tracing.otlp_protocol": protocol})
        resp = RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", body=BODY,
                                               headers=[("traceparent", f"00-{TRACE}-{CLIENT_SPAN}-01")])
        assert resp.complete
        spans = receiver.wait_for_spans(2, timeout=15)
    server = next(s for s in spans if s.span.kind == 2)
    client = next(s for s in spans if s.span.kind == 3)
    assert server.trace_id == client.trace_id == TRACE
    assert server.parent_span_id == CLIENT_SPAN  # continued from the client
    assert client.parent_span_id == server.span_id
    sent = tc.parse_traceparent(header_value(bytes(up.received[0]), b"traceparent"))
    assert "%016x" % sent.parent_span_id == client.span_id  # the engine's parent is our CLIENT span
    assert resp.headers["traceresponse"] == f"00-{TRACE}-{server.span_id}-01"
    # Ended at the last byte, not at the response headers:
    assert server.span.end_time_unix_nano >= last_write[0]
    assert client.span.end_time_unix_nano >= last_write[0]
    events = [e.name for e in server.span.events]
    assert events[0] == "first_downstream_rx_byte" and events[-1] == "last_downstream_tx_byte"
    attrs = server.attributes
    assert attrs["http.request.method"] == "POST" and attrs["url.path"] == "/v1/chat/completions"
    assert attrs["http.response.status_code"] == 200 and attrs["traceproxy.outcome"] == "OK"
    assert attrs["gen_ai.request.model"] == "llama-70b" and attrs["gen_ai.usage.output_tokens"] == 3
    assert attrs["gen_ai.response.finish_reasons"] == ["stop"] and attrs["traceproxy.response.done_seen"] is True
    assert client.attributes["server.port"] == up.port
    assert server.resource["service.name"] == "traceproxy"


@pytest.mark.parametrize("mode", ["down", "black_hole"])
def test_a_collector_in_trouble_never_slows_or_breaks_proxying(mode, fast_upstream, start_proxy):
    receiver = OtlpHttpReceiver(mode="black_hole" if mode == "black_hole" else "ok").start()
    endpoint = receiver.endpoint
    if mode == "down":
        receiver.stop()
    try:
        proxy = start_proxy(fast_upstream().url, **{"tracing.exporter": "otlp", "tracing.otlp_endpoint": endpoint,
                                                    "tracing.otlp_protocol": "http/protobuf",
                                                    "tracing.queue_spans": 64})
        client = RawClient(proxy.port)
        for _ in range(400):
            resp = client.roundtrip("POST", "/v1/chat/completions", body=b'{"stream": true, "max_tokens": 2}')
            assert resp.status == 200 and resp.complete
        # Healthy requests: once the queue is half full they are shed; either way the loss is counted.
        assert wait_until(lambda: proxy.tracing.shed["backlog"] > 0, timeout=10)
        metrics = admin_get(proxy, "/metrics")
        shed = next(line for line in metrics.splitlines()
                    if line.startswith('traceproxy_spans_shed_total{reason="backlog"}'))
        assert float(shed.split()[-1]) > 0
    finally:
        receiver.stop()
