"""Closed connections are freed by reference counting, not by the cycle collector.

The proxy runs the cycle collector rarely (``app.YOUNG_COLLECTION_THRESHOLD``) so that
bursts of new streams are not paused by it. That is only sound while what a closed
connection leaves behind is not held in reference cycles: otherwise every closed
connection would wait for the next collection, and make it long.
"""

from __future__ import annotations

import gc
import json
import socket
import struct
import time
import weakref

import pytest

from traceproxy.app import YOUNG_COLLECTION_THRESHOLD

from .support import RawClient, wait_until

STREAM = json.dumps({"model": "m", "stream": True, "max_tokens": 3,
                     "messages": [{"role": "user", "content": "hi"}]}).encode()


def _streamed_turns(port: int, turns: int) -> RawClient:
    client = RawClient(port)
    for _ in range(turns):
        response = client.roundtrip("POST", "/v1/chat/completions",
                                    headers=[("Content-Type", "application/json")], body=STREAM)
        assert response.status == 200 and response.complete and b"[DONE]" in response.body
    return client


def test_a_running_proxy_collects_cycles_rarely(fast_upstream, start_proxy):
    start_proxy(fast_upstream().url)
    assert gc.get_threshold()[0] == YOUNG_COLLECTION_THRESHOLD


def test_closed_client_and_upstream_connections_are_freed_without_the_cycle_collector(
        fast_upstream, start_proxy, loop_thread):
    # The upstream closes idle connections, so the pooled ones close too.
    upstream = fast_upstream(idle_close_after=0.3)
    proxy = start_proxy(upstream.url)
    gc.collect()
    gc.disable()
    try:
        # Two streamed turns per connection: the second response's head repeats the
        # first, so the pooled connection's parser for repeated heads is made too.
        clients = [_streamed_turns(proxy.port, turns=2) for _ in range(3)]
        client_side = loop_thread.call(lambda: [weakref.ref(c) for c in proxy.ctx.connections])
        upstream_side = loop_thread.call(lambda: [weakref.ref(c) for c in proxy.ctx.pool.idle])
        assert len(client_side) == 3 and upstream_side
        for client in clients:
            client.close()
        assert wait_until(lambda: loop_thread.call(lambda: not proxy.ctx.connections and not proxy.ctx.pool.idle))
        still_held = [ref() for ref in client_side + upstream_side if ref() is not None]
        assert still_held == []
    finally:
        gc.enable()


def _send_then_read_to_close(data: bytes):
    def act(port: int) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(data)
            sock.settimeout(5)
            while sock.recv(65536):
                pass
    return act


def _reset_mid_upload(port: int) -> None:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
    time.sleep(0.05)  # the request is on its way upstream, its body still arriving
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _stream_then_leave(port: int) -> None:
    _streamed_turns(port, turns=1).close()


@pytest.mark.parametrize("act", [
    pytest.param(_stream_then_leave, id="keep-alive stream, then close"),
    pytest.param(_send_then_read_to_close(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n"),
                 id="431 refused inside the parser"),
    pytest.param(_send_then_read_to_close(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 40),
                 id="too many pipelined requests"),
    pytest.param(_reset_mid_upload, id="client reset mid-upload"),
])
def test_a_client_connection_is_freed_at_its_close_however_it_ends(act, fast_upstream, start_proxy, loop_thread):
    proxy = start_proxy(fast_upstream().url, **{"pool.keep_warm": 0})
    closed = []
    forget = proxy.ctx.forget

    def note_and_forget(conn):
        closed.append(weakref.ref(conn))
        forget(conn)

    proxy.ctx.forget = note_and_forget
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            act(proxy.port)
        assert wait_until(lambda: len(closed) == 3 and not loop_thread.call(lambda: proxy.ctx.connections))
        # Whatever the proxy still does for them (an upstream answer to read and
        # discard) ends within the loop's next passes.
        assert wait_until(lambda: all(ref() is None for ref in closed), timeout=2)
    finally:
        gc.enable()
