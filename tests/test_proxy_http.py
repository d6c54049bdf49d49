"""Byte-level behaviour of the proxy with a raw-socket client: framing, headers,
keep-alive, pipelining, HTTP/1.0, Expect, HEAD. Raw requests are module constants."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from .support import (RawClient, answers_in_turn, answers_partly_then_resets, header_value, raw_exchange, recv_until,
                      wait_until)

HOP_BY_HOP_REQUEST = (
    b"GET /v1/models HTTP/1.1\r\n"
    b"Host: client.example\r\n"
    b"Connection: keep-alive, X-Secret-Hop\r\n"
    b"Keep-Alive: timeout=5\r\n"
    b"X-Secret-Hop: must-not-pass\r\n"
    b"Proxy-Authorization: Basic abc\r\n"
    b"TE: trailers\r\n"
    b"Proxy-Connection: keep-alive\r\n"
    b"Trailer: X-Checksum\r\n"
    b"Upgrade: h2c\r\n"
    b"Upgrade-Insecure-Requests: 1\r\n"
    b"X-Forwarded-For: 10.0.0.1\r\n"
    b"X-End-To-End: kept\r\n"
    b"\r\n"
)

PIPELINED = (
    b"POST /one HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc"
    b"POST /two HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\ndef"
    b"GET /three HTTP/1.1\r\nHost: a\r\n\r\n"
)

HTTP10_REQUEST = b"GET /v1/models HTTP/1.0\r\n\r\n"
HTTP10_KEEPALIVE_REQUEST = b"GET /v1/models HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"


def _capture_one_request(response: bytes):
    async def handler(reader, writer, upstream):
        while True:
            await reader.read_request()
            writer.write(response)
            await writer.drain()

    return handler


OK_EMPTY = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


def test_hop_by_hop_headers_removed_and_forwarding_headers_appended(scripted_upstream, start_proxy):
    up = scripted_upstream(_capture_one_request(OK_EMPTY))
    proxy = start_proxy(up.url)
    client = RawClient(proxy.port)
    client.send(HOP_BY_HOP_REQUEST, expect=("GET",))
    assert client.response().status == 200
    head = bytes(up.received[0]).split(b"\r\n\r\n")[0]
    names = {line.split(b":")[0].lower() for line in head.split(b"\r\n")[1:]}
    assert not names & {b"keep-alive", b"x-secret-hop", b"proxy-authorization", b"te", b"proxy-connection",
                        b"trailer", b"upgrade"}
    assert header_value(head, b"connection") in (None, b"keep-alive")
    assert header_value(head, b"x-end-to-end") == b"kept"
    assert header_value(head, b"upgrade-insecure-requests") == b"1"  # not hop-by-hop
    assert header_value(head, b"host") == b"client.example"
    assert header_value(head, b"x-forwarded-for") == b"10.0.0.1, 127.0.0.1"
    assert header_value(head, b"x-forwarded-proto") == b"http"
    assert header_value(head, b"x-forwarded-host") == b"client.example"


def test_headers_the_proxy_sets_aside_are_dropped_too_when_connection_names_them(scripted_upstream, start_proxy):
    up = scripted_upstream(_capture_one_request(OK_EMPTY))
    proxy = start_proxy(up.url)
    client = RawClient(proxy.port)
    client.send(b"GET / HTTP/1.1\r\nHost: client.example\r\nConnection: Host, X-Forwarded-For, traceparent\r\n"
                b"X-Forwarded-For: 6.6.6.6\r\n"
                b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n\r\n", expect=("GET",))
    assert client.response().status == 200
    head = bytes(up.received[0]).split(b"\r\n\r\n")[0]
    # Host is end to end whatever Connection says: an HTTP/1.1 request needs one.
    assert header_value(head, b"host") == b"client.example"
    assert header_value(head, b"x-forwarded-for") == b"127.0.0.1"  # the client's hop-by-hop copy is gone
    assert b"0af7651916cd43dd8448eb211c80319c" not in head  # a new trace, not the client's


def test_host_replaced_when_preserve_host_is_off(scripted_upstream, start_proxy):
    up = scripted_upstream(_capture_one_request(OK_EMPTY))
    proxy = start_proxy(up.url, **{"forwarding.preserve_host": False})
    RawClient(proxy.port).roundtrip("GET", "/")
    head = bytes(up.received[0])
    assert header_value(head, b"host") == f"127.0.0.1:{up.port}".encode()


def test_hop_by_hop_response_headers_removed_end_to_end_kept(scripted_upstream, start_proxy):
    response = (b"HTTP/1.1 201 Created Just Now\r\nContent-Length: 2\r\nConnection: X-Up-Hop\r\n"
                b"X-Up-Hop: secret\r\nKeep-Alive: timeout=5\r\nX-Model: m1\r\nSet-Cookie: a=1\r\n"
                b"Set-Cookie: b=2\r\n\r\nok")
    up = scripted_upstream(_capture_one_request(response))
    proxy = start_proxy(up.url)
    client = RawClient(proxy.port)
    resp = client.roundtrip("GET", "/")
    assert resp.status == 201 and resp.head.reason == b"Created Just Now"
    assert resp.body == b"ok"
    assert "x-up-hop" not in resp.headers
    assert resp.headers["x-model"] == "m1"
    assert [v for k, v in resp.header_list if k == "set-cookie"] == ["a=1", "b=2"]
    assert resp.headers.get("keep-alive") == "timeout=75"  # ours, not the upstream's


def test_close_delimited_upstream_response_becomes_chunked_for_http11(scripted_upstream, start_proxy):
    async def handler(reader, writer, upstream):
        await reader.read_request()
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nfirst part, ")
        await writer.drain()
        writer.write(b"second part")
        await writer.drain()
        writer.close()

    up = scripted_upstream(handler)
    proxy = start_proxy(up.url)
    client = RawClient(proxy.port)
    resp = client.roundtrip("GET", "/")
    assert resp.headers.get("transfer-encoding") == "chunked"
    assert resp.complete and resp.body == b"first part, second part"
    # The client connection stays usable: its response had a visible end.
    resp2 = client.roundtrip("GET", "/")
    assert resp2.complete and resp2.body == b"first part, second part"


def test_close_delimited_response_to_http10_client_closes_connection(scripted_upstream, start_proxy):
    async def handler(reader, writer, upstream):
        await reader.read_request()
        writer.write(b"HTTP/1.1 200 OK\r\n\r\nuntil close")
        writer.close()

    up = scripted_upstream(handler)
    proxy = start_proxy(up.url)
    raw = raw_exchange(proxy.port, HTTP10_REQUEST)
    head, body = raw.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.0 200")
    assert header_value(head, b"transfer-encoding") is None
    assert header_value(head, b"connection") == b"close"
    assert body == b"until close"


def test_http10_client_keep_alive_only_when_asked(fast_upstream, start_proxy):
    proxy = start_proxy(fast_upstream().url)
    raw = raw_exchange(proxy.port, HTTP10_REQUEST)
    assert raw.startswith(b"HTTP/1.0 200") and header_value(raw, b"connection") == b"close"
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        for _ in range(2):
            sock.sendall(HTTP10_KEEPALIVE_REQUEST)
            data = recv_until(sock, b"\r\n\r\n")
            head, body = data.split(b"\r\n\r\n", 1)
            length = int(header_value(head, b"content-length"))
            while len(body) < length:
                body += sock.recv(65536)
            assert header_value(head, b"connection") == b"keep-alive"


def test_pipelined_requests_answered_in_order(scripted_upstream, start_proxy):
    async def handler(reader, writer, upstream):
        while True:
            head, body = await reader.read_request()
            path = head.split(b" ")[1]
            payload = path + b":" + body
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))
            await writer.drain()

    up = scripted_upstream(handler)
    proxy = start_proxy(up.url)
    client = RawClient(proxy.port)
    client.send(PIPELINED, expect=("POST", "POST", "GET"))
    bodies = [client.response().body for _ in range(3)]
    assert bodies == [b"/one:abc", b"/two:def", b"/three:"]


def test_past_the_pipelining_depth_the_connection_closes_after_the_last_queued_request(fast_upstream,
                                                                                      start_proxy):
    # Each queued request costs a record and an exchange: a read of tiny GETs is not
    # all taken in. Those past the depth go unanswered; the client resends them.
    from traceproxy.proxy.downstream import MAX_PIPELINED

    up = fast_upstream()
    proxy = start_proxy(up.url)
    sent = 3 * MAX_PIPELINED
    reply = raw_exchange(proxy.port, b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n" * sent)
    heads = [part.partition(b"\r\n\r\n")[0] for part in reply.split(b"HTTP/1.1 ")[1:]]
    answered = 1 + MAX_PIPELINED  # the one answered, and the ones queued behind it
    assert len(heads) == answered and all(head.startswith(b"200 ") for head in heads)
    assert header_value(b"HTTP/1.1 " + heads[-1], b"connection") == b"close"
    assert all(header_value(b"HTTP/1.1 " + head, b"connection") != b"close" for head in heads[:-1])
    assert up.requests == answered
    assert wait_until(lambda: not proxy.ctx.in_flight and not proxy.ctx.connections)


def test_pipelined_request_behind_a_truncated_response_gets_no_bytes(scripted_upstream, start_proxy):
    up = scripted_upstream(answers_partly_then_resets(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 40))
    proxy = start_proxy(up.url)
    raw = raw_exchange(proxy.port, b"GET /a HTTP/1.1\r\nHost: a\r\n\r\nGET /b HTTP/1.1\r\nHost: a\r\n\r\n")
    head, body = raw.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200") and header_value(head, b"content-length") == b"100"
    # Short of its length, and nothing after it that the client would read as body.
    assert body == b"x" * 40
    assert up.connections == 1 and b"GET /b" not in bytes(up.received[0])


def test_pipelined_http10_request_behind_a_close_delimited_response_gets_no_bytes(scripted_upstream, start_proxy):
    async def chunked(reader, writer, upstream):
        while True:
            await reader.read_request()
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
            await writer.drain()

    proxy = start_proxy(scripted_upstream(chunked).url)
    raw = raw_exchange(proxy.port, HTTP10_KEEPALIVE_REQUEST * 2)
    head, body = raw.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.0 200") and header_value(head, b"connection") == b"close"
    assert body == b"hello"  # the body ends where the connection ends: nothing may follow it


def test_a_response_finished_during_the_shutdown_grace_says_the_connection_closes(
        scripted_upstream, start_proxy, loop_thread):
    release = threading.Event()

    async def answers_when_released(reader, writer, upstream):
        await reader.read_request()
        for _ in range(500):
            if release.is_set():
                break
            await asyncio.sleep(0.01)
        writer.write(OK_EMPTY)
        await writer.drain()
        await reader.read(1)

    proxy = start_proxy(scripted_upstream(answers_when_released).url)
    client = RawClient(proxy.port)
    client.send(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
    assert wait_until(lambda: proxy.ctx.in_flight)
    stopping = asyncio.run_coroutine_threadsafe(proxy.shutdown(grace=5), loop_thread.loop)
    assert wait_until(lambda: proxy.ctx.shutting_down)
    release.set()
    resp = client.response()
    assert resp.status == 200 and resp.complete
    # Not an invitation to send another request on a connection about to close.
    assert resp.headers.get("connection") == "close" and "keep-alive" not in resp.headers
    assert client.is_closed_by_peer()
    stopping.result(10)


class _Endings:
    def __init__(self):
        self.done = []

    def on_done(self, record):
        self.done.append((record.target, record.outcome.code, record.outcome.blame.value))


def test_when_the_grace_runs_out_every_request_on_a_connection_ends_as_the_proxys_doing(
        scripted_upstream, start_proxy, loop_thread):
    async def never_answers(reader, writer, upstream):
        await reader.read_request()
        await reader.read(1)

    endings = _Endings()
    proxy = start_proxy(scripted_upstream(never_answers).url, observers=[endings])
    client = RawClient(proxy.port)
    # One in progress, one pipelined behind it; and on another connection a head half sent.
    client.send(b"GET /waits HTTP/1.1\r\nHost: a\r\n\r\nGET /behind HTTP/1.1\r\nHost: a\r\n\r\n")
    half = RawClient(proxy.port)
    half.send(b"GET /half HTTP/1.1\r\nHo")
    # And one refused already, its 400 waiting behind a response: its refusal stays its outcome.
    refused = RawClient(proxy.port)
    refused.send(b"GET /waits HTTP/1.1\r\nHost: a\r\n\r\nGET /bad HTTP/1.1\r\nHost: a b\r\n\r\n")
    assert wait_until(lambda: len(proxy.ctx.in_flight) == 5)
    loop_thread.run(proxy.shutdown(grace=0.3))
    resp = client.response()
    assert resp.status == 503 and resp.headers.get("x-traceproxy-outcome") == "LR"
    assert resp.headers.get("connection") == "close"  # not an invitation to wait for /behind
    assert refused.response().status == 503  # its /waits; the 400 of /bad is never sent
    assert client.is_closed_by_peer() and half.is_closed_by_peer() and refused.is_closed_by_peer()
    assert wait_until(lambda: len(endings.done) == 5)
    assert sorted(endings.done) == [("", "LR", "proxy"), ("/bad", "DPE", "client"), ("/behind", "LR", "proxy"),
                                    ("/waits", "LR", "proxy"), ("/waits", "LR", "proxy")]


def _slow_reader_holding_a_finished_response(proxy, loop_thread, size: int) -> socket.socket:
    """A client whose whole response is finished on the proxy's side but still
    waits in its transport, untaken: the transport is let hold it all, unpaused."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", proxy.port))
    assert wait_until(lambda: proxy.ctx.connections)
    connection = next(iter(proxy.ctx.connections))
    loop_thread.call(connection.transport.set_write_buffer_limits, 64 * 1024 * 1024)
    proxy_side = connection.transport.get_extra_info("socket")
    loop_thread.call(proxy_side.setsockopt, socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # the kernel keeps little
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n" % size + b"e" * size)
    assert wait_until(lambda: not proxy.ctx.in_flight and connection.transport.get_write_buffer_size() > 0)
    return sock


def test_shutdown_lets_a_slow_client_take_a_finished_response_within_the_grace(
        fast_upstream, start_proxy, loop_thread):
    proxy = start_proxy(fast_upstream().url)
    size = 2 * 1024 * 1024
    with _slow_reader_holding_a_finished_response(proxy, loop_thread, size) as sock:
        stopping = asyncio.run_coroutine_threadsafe(proxy.shutdown(grace=20), loop_thread.loop)
        time.sleep(0.5)  # the client takes nothing yet
        assert not stopping.done(), "shutdown finished while a client still had bytes to take"
        received = bytearray()
        for _ in range(20_000):  # bounded: the 2 MiB come in far fewer reads
            piece = sock.recv(65536)
            if not piece:
                break
            received += piece
        stopping.result(20)
        assert not proxy.ctx.connections
        head, _, body = bytes(received).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and body == b"e" * size


def test_shutdown_resets_a_client_still_holding_bytes_when_the_grace_ends(fast_upstream, start_proxy, loop_thread):
    proxy = start_proxy(fast_upstream().url)
    with _slow_reader_holding_a_finished_response(proxy, loop_thread, 2 * 1024 * 1024) as sock:
        loop_thread.run(proxy.shutdown(grace=0.3))
        assert not proxy.ctx.connections
        with pytest.raises(ConnectionResetError):  # not a clean end: the response is cut
            for _ in range(2000):  # bounded: far fewer reads than the 2 MiB would need
                if not sock.recv(65536):
                    break


def test_expect_from_an_http10_client_is_ignored(fast_upstream, start_proxy):
    proxy = start_proxy(fast_upstream().url)
    raw = raw_exchange(proxy.port, b"POST /echo HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\nhello")
    assert raw.startswith(b"HTTP/1.0 200"), raw[:60]  # no 1xx to an HTTP/1.0 client
    assert raw.endswith(b"hello")


def test_expect_on_a_request_without_a_body_gets_no_100_continue(fast_upstream, start_proxy):
    proxy = start_proxy(fast_upstream().url)
    raw = raw_exchange(proxy.port, b"GET /v1/models HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n"
                                   b"Connection: close\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 200"), raw[:60]


def test_expect_100_continue_answered_before_body(fast_upstream, start_proxy):
    proxy = start_proxy(fast_upstream().url)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        body = b"x" * 1000
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 1000\r\n\r\n")
        interim = sock.recv(65536)
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(body)
        data = b""
        while not data.endswith(body):
            chunk = sock.recv(65536)
            assert chunk, "connection closed early"
            data += chunk
        assert data.startswith(b"HTTP/1.1 200")


def test_head_request_gets_headers_and_no_body(scripted_upstream, start_proxy):
    up = scripted_upstream(_capture_one_request(b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n"))
    proxy = start_proxy(up.url)
    client = RawClient(proxy.port)
    resp = client.roundtrip("HEAD", "/")
    assert resp.status == 200 and resp.headers["content-length"] == "1234" and resp.body == b""
    # Same connection, same upstream connection, next request fine.
    resp = client.roundtrip("HEAD", "/")
    assert resp.status == 200
    assert up.connections == 1


def test_get_after_head_on_the_same_upstream_connection_reads_its_body(scripted_upstream, start_proxy):
    # The HEAD response declares 1234 bytes that never come: the upstream
    # connection's parser must not be carried over to the next response.
    handler = answers_in_turn(b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n",
                              b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")

    up = scripted_upstream(handler)
    client = RawClient(start_proxy(up.url).port)
    assert client.roundtrip("HEAD", "/").headers["content-length"] == "1234"
    resp = client.roundtrip("GET", "/")
    assert (resp.status, resp.body) == (200, b"hello")
    assert "traceresponse" in resp.headers, "the upstream's bytes reached the client without the proxy framing them"
    assert up.connections == 1


def test_a_body_sent_after_a_head_response_retires_its_upstream_connection(scripted_upstream, start_proxy):
    # The engine answers HEAD as GET: part of the body comes with the head, the rest
    # later. Reused, that connection would hand the rest to the next request as its response.
    async def answers_head_with_a_body(reader, writer, upstream):
        for _ in range(2):
            head, _ = await reader.read_request()
            if head.startswith(b"HEAD "):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3000\r\n\r\n" + b"b" * 1000)
                await writer.drain()
                await asyncio.sleep(0.3)
                writer.write(b"b" * 2000)  # read as the answer to a request sent on this connection meanwhile
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    up = scripted_upstream(answers_head_with_a_body)
    client = RawClient(start_proxy(up.url).port)
    head = client.roundtrip("HEAD", "/v1/models")
    assert head.status == 200 and head.body == b""
    resp = client.roundtrip("GET", "/v1/models")  # within the 0.3 s before the rest comes
    assert (resp.status, resp.body) == (200, b"ok")
    assert up.connections == 2


def test_a_repeated_response_head_then_a_different_one_are_each_framed_by_their_own(scripted_upstream, start_proxy):
    same = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n"
    handler = answers_in_turn(same, same, b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\n\r\nbye",
                              same)

    client = RawClient(start_proxy(scripted_upstream(handler).url).port)
    bodies = [client.roundtrip("GET", f"/{i}") for i in range(4)]
    assert [r.body for r in bodies] == [b"hi", b"hi", b"bye", b"hi"]
    assert bodies[2].headers["content-length"] == "3" and "transfer-encoding" not in bodies[2].headers
    assert bodies[3].headers["transfer-encoding"] == "chunked" and "content-length" not in bodies[3].headers


def test_a_repeated_head_is_taken_for_the_last_one_only_when_every_byte_matches(scripted_upstream, start_proxy):
    # A head that repeats the last one byte for byte skips the per-header parsing
    # (see upstream: Repeated heads); a different status line, a head split over
    # reads and a HEAD response must each still be read as themselves.
    head = b"HTTP/1.1 200 OK\r\nX-A: 1\r\nContent-Length: 2\r\n\r\n"
    busy = b"HTTP/1.1 503 Busy\r\nX-A: 1\r\nContent-Length: 2\r\n\r\n"
    responses = iter([[head + b"ok"], [head + b"ok"], [busy + b"no"], [head[:20], head[20:] + b"ok"], [head],
                      [head + b"ok"]])

    async def handler(reader, writer, upstream):
        while True:
            await reader.read_request()
            for part in next(responses):
                writer.write(part)
                await writer.drain()
                await asyncio.sleep(0.05)

    up = scripted_upstream(handler)
    client = RawClient(start_proxy(up.url).port)
    got = [client.roundtrip(method, f"/{i}") for i, method in enumerate(["GET", "GET", "GET", "GET", "HEAD", "GET"])]
    assert [(r.status, r.body) for r in got] == [(200, b"ok"), (200, b"ok"), (503, b"no"), (200, b"ok"), (200, b""),
                                                 (200, b"ok")]
    assert got[2].head.reason == b"Busy" and all(r.headers["x-a"] == "1" for r in got)
    assert up.connections == 1


def test_empty_lines_before_a_status_line_are_never_taken_for_a_known_head(scripted_upstream, start_proxy):
    # llhttp skips empty lines before a status line: the first empty line of such a
    # read is not the end of a head, and two responses so begun may differ.
    handler = answers_in_turn(b"\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
                              b"\r\n\r\nHTTP/1.1 503 Busy\r\nContent-Length: 2\r\n\r\nno")

    client = RawClient(start_proxy(scripted_upstream(handler).url).port)
    got = [client.roundtrip("GET", f"/{i}") for i in range(2)]
    assert [(r.status, r.body) for r in got] == [(200, b"ok"), (503, b"no")]


def test_no_content_and_not_modified_have_no_body(scripted_upstream, start_proxy):
    # Each bodiless answer is followed by another on the same connection: a stray
    # terminating chunk after either would be read as the start of the next response.
    handler = answers_in_turn(b"HTTP/1.1 304 Not Modified\r\nETag: \"x\"\r\n\r\n", b"HTTP/1.1 204 No Content\r\n\r\n",
                              b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    proxy = start_proxy(scripted_upstream(handler).url)
    client = RawClient(proxy.port)
    resp = client.roundtrip("GET", "/a")
    assert resp.status == 304 and resp.headers["etag"] == '"x"' and resp.body == b""
    assert client.roundtrip("GET", "/b").status == 204
    last = client.roundtrip("GET", "/c")
    assert last.status == 200 and last.body == b"ok"


def test_interim_upstream_responses_are_not_forwarded(scripted_upstream, start_proxy):
    up = scripted_upstream(_capture_one_request(
        b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi"))
    proxy = start_proxy(up.url)
    raw = raw_exchange(proxy.port, b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 200 OK") and raw.endswith(b"hi")


def test_chunked_request_body_forwarded_intact(scripted_upstream, start_proxy):
    async def handler(reader, writer, upstream):
        _, body = await reader.read_request()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()

    proxy = start_proxy(scripted_upstream(handler).url)
    raw = raw_exchange(proxy.port, b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n"
                                   b"Connection: close\r\n\r\n5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n")
    assert raw.endswith(b"\r\n\r\nhello world")


def test_idle_client_connection_closed_after_keepalive_timeout(fast_upstream, start_proxy):
    proxy = start_proxy(fast_upstream().url, **{"timeouts.client_keepalive": 0.3})
    client = RawClient(proxy.port)
    assert client.roundtrip("GET", "/health").status == 200
    assert client.is_closed_by_peer(wait=3)
    assert wait_until(lambda: not proxy.ctx.connections)


def test_absolute_form_target_is_sent_as_a_path_with_its_host(scripted_upstream, start_proxy):
    # RFC 9112 section 3.2.2: the target's authority replaces the Host header, so the
    # proxy and the upstream agree on which host was asked for.
    up = scripted_upstream(_capture_one_request(OK_EMPTY))
    proxy = start_proxy(up.url)
    reply = raw_exchange(proxy.port, b"GET http://internal.example:8080/v1/models?x=1 HTTP/1.1\r\n"
                                     b"Host: public.example\r\nConnection: close\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200 ")
    head = bytes(up.received[0]).split(b"\r\n\r\n")[0]
    assert head.startswith(b"GET /v1/models?x=1 HTTP/1.1\r\n")
    assert header_value(head, b"host") == b"internal.example:8080"
    assert header_value(head, b"x-forwarded-host") == b"internal.example:8080"
    assert b"public.example" not in head


def test_an_h2c_upgrade_offer_is_answered_over_http11(scripted_upstream, start_proxy):
    # What `curl --http2 http://...` sends; a server may ignore the offer (RFC 9113 3.2).
    up = scripted_upstream(_capture_one_request(OK_EMPTY))
    proxy = start_proxy(up.url)
    offer = (b"GET /v1/models HTTP/1.1\r\nHost: a\r\nConnection: Upgrade, HTTP2-Settings\r\n"
             b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n")
    # A second request in the same write: parsing goes on after the offer.
    reply = raw_exchange(proxy.port, offer + b"GET /health HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    assert reply.count(b"HTTP/1.1 200 ") == 2 and b" 101 " not in reply
    sent = bytes(up.received[0])
    assert sent.count(b" HTTP/1.1\r\n") == 2
    assert b"h2c" not in sent.lower() and b"http2-settings" not in sent.lower()


def test_an_h2c_offer_with_a_body_is_refused(fast_upstream, start_proxy):
    up = fast_upstream()
    proxy = start_proxy(up.url)
    reply = raw_exchange(proxy.port, b"POST /echo HTTP/1.1\r\nHost: a\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                                     b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
                                     b"Content-Length: 3\r\n\r\nabc")
    assert reply.startswith(b"HTTP/1.1 501 ") and b"without Upgrade" in reply
    assert up.requests == 0


def test_many_pipelined_h2c_offers_in_one_read_are_answered_up_to_the_pipelining_depth(fast_upstream, start_proxy):
    from traceproxy.proxy.downstream import MAX_PIPELINED

    proxy = start_proxy(fast_upstream().url)
    offer = b"GET /health HTTP/1.1\r\nHost: a\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AA\r\n\r\n"
    count = 1500  # each offer stops llhttp once: parsing goes on without nesting a call per request
    reply = raw_exchange(proxy.port, offer * count, timeout=30)
    assert reply.count(b"HTTP/1.1 200 ") == 1 + MAX_PIPELINED
    assert reply.endswith(b"Connection: close\r\n\r\n")
