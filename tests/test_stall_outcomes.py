"""One test per stall outcome, end to end: a fault-injecting upstream or client, then,
while the request is still stuck, the stall span in a real OTLP receiver, the entry in
/debug/inflight, the metric and the log line all carry the same verdict and blame."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import pytest

from .otlp_receiver import OtlpHttpReceiver
from .support import RawClient, admin_get, answers_in_parts, never_answers, streams_without_end, wait_until

FAST = {"stall.client_headers": 0.3, "stall.client_body": 0.3, "stall.pool_wait": 0.3, "stall.first_byte": 0.3,
        "stall.stream_gap": 0.3, "stall.client_drain": 0.3}


@pytest.fixture
def receiver():
    with OtlpHttpReceiver() as rx:
        yield rx


_one_token_then_silence = answers_in_parts(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n7\r\ntoken-1\r\n")


async def _answers_after_a_while(reader, writer, upstream):
    while True:
        await reader.read_request()
        await asyncio.sleep(3)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()


def _backlogged_listener():
    """A loopback listener that never accepts, its queue full: connects to it hang."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    for _ in range(8):
        filler = socket.socket()
        filler.setblocking(False)
        try:
            filler.connect(listener.getsockname())
        except BlockingIOError:
            pass
        fillers.append(filler)
    return listener, fillers


# (id, expected code, blame, phase)
SCENARIOS = [
    ("DHS", "client", "awaiting_request_headers"),
    ("DBS", "client", "awaiting_request_body"),
    ("PWS", "proxy", "awaiting_upstream_connection"),
    ("UCS", "engine", "awaiting_upstream_connection"),
    ("FBS", "engine", "awaiting_upstream_headers"),
    ("MSS", "engine", "streaming_response"),
    ("DNR", "client", "streaming_response"),
]


def _start_scenario(code, scripted_upstream, start_proxy, receiver, keep):
    tracing = {"tracing.exporter": "otlp", "tracing.otlp_endpoint": receiver.endpoint,
               "tracing.otlp_protocol": "http/protobuf", **FAST}
    if code == "UCS":
        listener, fillers = _backlogged_listener()
        keep += [listener, *fillers]
        proxy = start_proxy(f"http://127.0.0.1:{listener.getsockname()[1]}", **tracing)
    elif code == "PWS":
        proxy = start_proxy(scripted_upstream(_answers_after_a_while).url, **{**tracing, "pool.max_connections": 1})
        first = RawClient(proxy.port)
        first.request("GET", "/holds-the-only-connection")
        keep.append(first)
        assert wait_until(lambda: proxy.ctx.pool.open_count == 1)
    else:
        handler = {"MSS": _one_token_then_silence, "DNR": streams_without_end}.get(code, never_answers)
        proxy = start_proxy(scripted_upstream(handler).url, **tracing)
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    keep.append(sock)
    if code == "DHS":
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: a\r\n")
    elif code == "DBS":
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nx-request-id: r-DBS\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")
    else:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nx-request-id: r-%s\r\n"
                     b"Content-Length: 2\r\n\r\n{}" % code.encode())
    return proxy


@pytest.mark.parametrize("code,blame,phase", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_stall_is_reported_everywhere_while_the_request_is_stuck(code, blame, phase, scripted_upstream,
                                                                 start_proxy, receiver, caplog):
    caplog.set_level(logging.WARNING, logger="traceproxy.watchdog")
    keep: list = []
    try:
        proxy = _start_scenario(code, scripted_upstream, start_proxy, receiver, keep)
        assert wait_until(lambda: receiver.find(name=f"stall {code} {phase}"), timeout=10)
        stall = receiver.find(name=f"stall {code} {phase}")[0]
        # Exported while the request is still in flight:
        stuck = [r for r in proxy.ctx.in_flight.values() if any(e.code == code for e in r.stalls)]
        assert stuck, "the stall span must arrive while the request is stuck"
        record = stuck[0]
        assert stall.attributes["traceproxy.stall.outcome"] == code
        assert stall.attributes["traceproxy.blame"] == blame
        assert stall.attributes["traceproxy.stall.phase"] == phase
        assert stall.trace_id == "%032x" % record.trace_id and stall.parent_span_id == "%016x" % record.span_id
        entry = next(e for e in json.loads(admin_get(proxy, "/debug/inflight"))["requests"]
                     if any(s["outcome"] == code for s in e["stalls"]))
        assert entry["verdict"]["outcome"] == code and entry["verdict"]["blame"] == blame
        assert entry["verdict"]["stalled"] is True and entry["phase"] == phase
        metrics = admin_get(proxy, "/metrics")
        assert f'traceproxy_stalls_total{{outcome="{code}",blame="{blame}"}} 1' in metrics
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith(f"stall {code}"))
        assert f"blame {blame}" in line and ("%032x" % record.trace_id) in line
    finally:
        for thing in keep:
            thing.close()


def test_proxy_forward_stall_is_blamed_on_the_proxy(scripted_upstream, start_proxy, receiver):
    """PFS only happens if the proxy itself holds bytes back. Inject exactly that fault
    (the client write is swallowed) to prove the watchdog would catch such a bug."""
    proxy = start_proxy(scripted_upstream(_one_token_then_silence).url,
                        **{"tracing.exporter": "otlp", "tracing.otlp_endpoint": receiver.endpoint,
                           "tracing.otlp_protocol": "http/protobuf", **FAST})
    client = RawClient(proxy.port)
    client.request("POST", "/v1/chat/completions", body=b"{}")
    assert wait_until(lambda: any(r.upstream_rx_chunks for r in proxy.ctx.in_flight.values()), timeout=5)
    record = next(iter(proxy.ctx.in_flight.values()))
    record.last_upstream_rx_ns = time.monotonic_ns()  # bytes "arrived" and were never written
    spans = receiver.wait_for_spans(1, timeout=10)
    assert any(s.attributes.get("traceproxy.stall.outcome") == "PFS"
               and s.attributes["traceproxy.blame"] == "proxy" for s in spans)
    client.close()
