"""The lifecycle record as the proxy fills it: marks in order, the keep-alive ledger,
and exactly one ``on_done`` per request whatever way it ended."""

from __future__ import annotations

import asyncio
import collections
import socket
import time
from typing import Callable

import pytest

from traceproxy.lifecycle.flags import Flag
from traceproxy.lifecycle.marks import Mark
from traceproxy.proxy.forward import UPSTREAM_TAIL_SECONDS

from .support import (RawClient, answers_done_then_waits, answers_partly_then_resets, raw_exchange, recv_until,
                      wait_until)


class Recorder:
    def __init__(self) -> None:
        self.started: list = []
        self.marks = collections.defaultdict(list)
        self.done: list = []

    def on_request_start(self, record):
        self.started.append(record)

    def on_mark(self, record, mark):
        self.marks[record.id].append(mark)

    def on_done(self, record):
        self.done.append(record)


def test_healthy_streams_record_marks_in_order_and_the_keepalive_ledger(fast_upstream, start_proxy):
    rec = Recorder()
    proxy = start_proxy(fast_upstream().url, observers=[rec])
    client = RawClient(proxy.port)
    for _ in range(3):
        assert client.roundtrip("POST", "/v1/chat/completions", body=b'{"stream": true, "max_tokens": 5}').complete
    assert wait_until(lambda: len(rec.done) == 3)
    first, second, third = rec.done
    assert [r.sequence for r in rec.done] == [1, 2, 3]
    assert first.idle_gap_ns is None and second.idle_gap_ns > 0
    assert not first.attempt.reused and second.attempt.reused and third.attempt.reused
    assert third.attempt.connection_request_number == 3
    for record in rec.done:
        assert record.outcome is Flag.OK and record.status == 200
        stamped = [record.when(m) for m in (Mark.FIRST_DOWNSTREAM_RX_BYTE, Mark.LAST_DOWNSTREAM_RX_HEADER_BYTE,
                                            Mark.POOL_ACQUIRED, Mark.LAST_UPSTREAM_TX_BYTE,
                                            Mark.LAST_UPSTREAM_RX_HEADER_BYTE, Mark.FIRST_UPSTREAM_RX_BODY_BYTE,
                                            Mark.LAST_UPSTREAM_RX_BYTE, Mark.LAST_DOWNSTREAM_TX_BYTE)]
        assert None not in stamped and stamped == sorted(stamped)
        assert record.upstream_rx_chunks >= 1 and record.upstream_rx_body_bytes == record.downstream_tx_body_bytes
        assert len(rec.marks[record.id]) == len(set(rec.marks[record.id]))
        # Neither connection closed under a healthy keep-alive request.
        assert record.when(Mark.DOWNSTREAM_CLOSED) is None and Mark.UPSTREAM_CLOSED not in record.attempt.marks


def test_pipelined_requests_report_no_idle_gap(fast_upstream, start_proxy):
    rec = Recorder()
    proxy = start_proxy(fast_upstream().url, observers=[rec])
    health = b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n"
    body = b'{"stream": true, "max_tokens": 5}'
    stream = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nx-fake-tps: 25\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(health)
        assert wait_until(lambda: len(rec.done) == 1)
        time.sleep(0.3)
        # The second and third request leave in one write: the third arrives while the
        # second (a 0.2 s stream) is in flight, so the connection was never idle before it.
        sock.sendall(stream + health)
        assert wait_until(lambda: len(rec.done) == 3)
    first, second, third = sorted(rec.done, key=lambda r: r.sequence)
    assert all(r.outcome is Flag.OK for r in (first, second, third))
    assert second.idle_gap_ns >= 250_000_000
    assert third.idle_gap_ns == 0


def test_the_idle_gap_after_a_refused_request_starts_once_its_body_was_read(start_proxy, dead_upstream):
    # The upstream is down: the first request's 502 goes out at once, and the proxy
    # reads the rest of its body (1.2 s of it) before the connection carries on.
    rec = Recorder()
    proxy = start_proxy(dead_upstream, observers=[rec])
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 7\r\n\r\nx")
        assert recv_until(sock, b"}").startswith(b"HTTP/1.1 502 ")
        for byte in b"yyyyyy":
            time.sleep(0.2)
            sock.sendall(bytes([byte]))
        sock.sendall(b"GET /b HTTP/1.1\r\nHost: a\r\n\r\n")  # straight after the body
        assert wait_until(lambda: len(rec.done) == 2)
    first, second = sorted(rec.done, key=lambda r: r.sequence)
    assert first.outcome is Flag.UF and second.sequence == 2
    assert second.idle_gap_ns < 150_000_000, second.idle_gap_ns / 1e9


def test_a_client_that_leaves_at_done_before_the_terminator_ends_ok_and_the_connection_is_kept(
        scripted_upstream, start_proxy):
    # The openai SDK stops reading at data: [DONE] and closes; this engine writes the
    # chunked terminator a moment later. The client had the whole stream.
    events = (b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n', b"data: [DONE]\n\n")
    rec = Recorder()
    up = scripted_upstream(_streams_in_writes(b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events),
                                              b"0\r\n\r\n", requests=3))  # open and waiting after the turns
    proxy = start_proxy(up.url, observers=[rec])
    for turn in range(2):
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}")
            recv_until(sock, b"[DONE]")
        assert wait_until(lambda: len(rec.done) == turn + 1)
    assert [(r.outcome, r.status) for r in rec.done] == [(Flag.OK, 200), (Flag.OK, 200)]
    assert up.connections == 1 and not up.closed.is_set()  # read to its end, then pooled and reused
    for record in rec.done:  # its last byte went to the client before the client left
        assert record.when(Mark.LAST_DOWNSTREAM_TX_BYTE) <= record.when(Mark.DOWNSTREAM_CLOSED)


def test_a_client_that_leaves_at_done_ends_ok_even_when_the_terminator_never_comes(scripted_upstream, start_proxy):
    from traceproxy.proxy.forward import UPSTREAM_TAIL_SECONDS

    rec = Recorder()
    up = scripted_upstream(answers_done_then_waits)
    proxy = start_proxy(up.url, observers=[rec])
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}")
        recv_until(sock, b"[DONE]")
    left = time.monotonic()
    assert up.closed.wait(UPSTREAM_TAIL_SECONDS + 3)
    assert UPSTREAM_TAIL_SECONDS - 0.2 <= time.monotonic() - left
    assert wait_until(lambda: len(rec.done) == 1) and rec.done[0].outcome is Flag.OK


def _streams_in_writes(*writes: bytes, requests: int = 2) -> Callable:
    """An upstream answering each request with an SSE head, then ``writes`` 0.1 s apart."""
    async def stream(reader, writer, upstream):
        for _ in range(requests):
            await reader.read_request()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            for index, chunk in enumerate(writes):
                if index:
                    await asyncio.sleep(0.1)
                writer.write(chunk)
                await writer.drain()

    return stream


def _sse_events(*events: bytes, then: bytes = b"", then_after: float = 0.5) -> Callable:
    """An upstream streaming ``events``, then ``then`` ``then_after`` seconds later, then nothing."""
    async def stream(reader, writer, upstream):
        await reader.read_request()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for event in events:
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
        await asyncio.sleep(then_after)
        writer.write(then)
        await writer.drain()
        await reader.read(1)  # until the proxy closes this connection

    return stream


@pytest.mark.parametrize("events, leave_after", [
    # One choice of two finished; the other goes on.
    ((b'data: {"choices": [{"index": 0, "finish_reason": "stop"}]}\n\n',), b'"stop"'),
    ((b'data: {"choices": [{"delta": {"content": "print(\\"[DONE]\\")"}}]}\n\n',), b"[DONE]"),
], ids=["finish-reason-of-one-choice", "done-inside-content"])
def test_a_client_that_leaves_before_the_streams_end_is_dc_whatever_the_text(scripted_upstream, start_proxy,
                                                                             events, leave_after):
    rec = Recorder()
    more = b'data: {"choices": [{"index": 1, "delta": {"content": "more"}}]}\n\n'
    up = scripted_upstream(_sse_events(*events, then=b"%x\r\n%s\r\n" % (len(more), more), then_after=5.0))
    proxy = start_proxy(up.url, observers=[rec])
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}")
        recv_until(sock, leave_after)
    # Ended (and the engine let go) when the client left, not at the next event 5 s on,
    # nor after the tail wait: read off the proxy's own marks, not this thread's clock.
    assert wait_until(lambda: len(rec.done) == 1, timeout=3) and rec.done[0].outcome is Flag.DC
    [record] = rec.done
    let_go_ns = record.attempts[-1].marks[Mark.UPSTREAM_CLOSED] - record.marks[Mark.DOWNSTREAM_CLOSED]
    assert 0 <= let_go_ns < UPSTREAM_TAIL_SECONDS * 1e9, let_go_ns


def test_a_client_that_leaves_with_done_still_unread_is_dc(scripted_upstream, start_proxy):
    rec = Recorder()
    big = b"data: " + b"x" * 400_000 + b"\n\n"
    up = scripted_upstream(_sse_events(big, b"data: [DONE]\n\n", then=b"0\r\n\r\n"))
    proxy = start_proxy(up.url, observers=[rec])
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}")
        sock.recv(4096)
        time.sleep(0.2)  # [DONE] reached the proxy; the client takes no more of it
    assert wait_until(lambda: len(rec.done) == 1) and rec.done[0].outcome is Flag.DC


def test_a_client_that_leaves_at_a_done_split_across_reads_ends_ok(scripted_upstream, start_proxy):
    rec = Recorder()
    up = scripted_upstream(_streams_in_writes(b"9\r\ndata: [DO\r\n", b"5\r\nNE]\n\n\r\n", b"0\r\n\r\n"))
    proxy = start_proxy(up.url, observers=[rec])
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}")
        recv_until(sock, b"NE]")
    assert wait_until(lambda: len(rec.done) == 1) and rec.done[0].outcome is Flag.OK


def test_what_the_upstream_sends_after_the_client_left_at_done_is_not_judged(scripted_upstream, start_proxy):
    # More events, then a broken chunk: nobody's response, since the client had its whole stream.
    more = b"data: late\n\n"
    rec = Recorder()
    up = scripted_upstream(_sse_events(b"data: [DONE]\n\n",
                                       then=b"%x\r\n%s\r\n" % (len(more), more) * 100 + b"zz\r\n"))
    proxy = start_proxy(up.url, observers=[rec])
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}")
        recv_until(sock, b"[DONE]")
    assert wait_until(lambda: len(rec.done) == 1)
    (record,) = rec.done
    assert record.outcome is Flag.OK and record.downstream_tx_body_bytes == len(b"data: [DONE]\n\n")


def test_a_shutdown_while_waiting_for_the_upstreams_last_bytes_still_ends_the_request(scripted_upstream,
                                                                                     start_proxy, loop_thread):
    rec = Recorder()
    up = scripted_upstream(_sse_events(b"data: [DONE]\n\n"))  # the terminator never comes
    proxy = start_proxy(up.url, observers=[rec])
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}")
        recv_until(sock, b"[DONE]")
    assert wait_until(lambda: proxy.ctx.tail_waits)
    loop_thread.run(proxy.shutdown(grace=0.1))
    assert [r.outcome for r in rec.done] == [Flag.OK]


def test_every_started_request_ends_exactly_once(fast_upstream, start_proxy, dead_upstream):
    rec = Recorder()
    proxy = start_proxy(fast_upstream().url, observers=[rec])
    RawClient(proxy.port).roundtrip("GET", "/health")  # OK
    raw_exchange(proxy.port, b"GET / HTTP/1.1\r\nHost: a\r\nBad\r\n\r\n")  # DPE
    half = socket.create_connection(("127.0.0.1", proxy.port))
    half.sendall(b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nab")
    assert wait_until(lambda: len(rec.started) == 3)
    half.close()  # DC while the body is incomplete
    dead = start_proxy(dead_upstream, observers=[rec])
    RawClient(dead.port).roundtrip("GET", "/")  # UF
    assert wait_until(lambda: len(rec.done) == 4)
    assert sorted(r.outcome.code for r in rec.done) == ["DC", "DPE", "OK", "UF"]
    assert {r.id for r in rec.started} == {r.id for r in rec.done}
    assert not proxy.ctx.in_flight and not dead.ctx.in_flight


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
ONE_EVENT = b"e\r\ndata: token1\n\n\r\n"


def test_a_client_disconnect_is_a_mark_on_the_request_and_its_attempt(fast_upstream, start_proxy):
    rec = Recorder()
    proxy = start_proxy(fast_upstream().url, observers=[rec])
    body = b'{"stream": true, "max_tokens": 50}'
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nx-fake-tps: 20\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        recv_until(sock, b"data: ")
    assert wait_until(lambda: len(rec.done) == 1)
    (record,) = rec.done
    assert record.outcome is Flag.DC
    closed = record.when(Mark.DOWNSTREAM_CLOSED)
    assert closed is not None and record.when(Mark.FIRST_DOWNSTREAM_TX_BODY_BYTE) < closed <= record.end_ns
    # The proxy then let go of the engine's connection: the attempt shows when.
    assert closed <= record.attempt.marks[Mark.UPSTREAM_CLOSED] <= record.end_ns
    assert Mark.DOWNSTREAM_CLOSED in rec.marks[record.id] and Mark.UPSTREAM_CLOSED in rec.marks[record.id]


def test_a_client_gone_during_its_request_head_is_marked_too(fast_upstream, start_proxy):
    rec = Recorder()
    proxy = start_proxy(fast_upstream().url, observers=[rec])
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\n")
        assert wait_until(lambda: len(rec.started) == 1)
    assert wait_until(lambda: len(rec.done) == 1)
    (record,) = rec.done
    assert record.outcome is Flag.DC and record.when(Mark.DOWNSTREAM_CLOSED) is not None


def test_an_upstream_disconnect_is_a_mark_on_the_attempt_only(scripted_upstream, start_proxy):
    rec = Recorder()
    upstream = scripted_upstream(answers_partly_then_resets(SSE_HEAD + ONE_EVENT))
    proxy = start_proxy(upstream.url, observers=[rec])
    response = RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", body=b"{}")
    assert response.status == 200 and not response.complete
    assert wait_until(lambda: len(rec.done) == 1)
    (record,) = rec.done
    assert record.outcome is Flag.UC
    assert record.when(Mark.FIRST_UPSTREAM_RX_BODY_BYTE) < record.attempt.marks[Mark.UPSTREAM_CLOSED] <= record.end_ns
    assert record.when(Mark.DOWNSTREAM_CLOSED) is None  # the client stayed
