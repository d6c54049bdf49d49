"""Bodies pass byte-identical and streamed both ways; client limits hold without
locking anyone out."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import re
import socket
import threading
import time

import pytest

from .support import RawClient, header_value, recv_until, wait_until

MB = 1024 * 1024


def _random_bytes(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_8mb_random_upload_echoed_byte_identical(fast_upstream, start_proxy, chunked):
    proxy = start_proxy(fast_upstream().url)
    body = _random_bytes(8 * MB, seed=1)
    client = RawClient(proxy.port, timeout=30)
    if chunked:
        headers = [("Transfer-Encoding", "chunked")]
        client.request("POST", "/echo", headers=headers, body=body)
        resp = client.response()
    else:
        resp = client.roundtrip("POST", "/echo", body=body)
    assert resp.status == 200 and resp.complete
    assert hashlib.sha256(resp.body).hexdigest() == hashlib.sha256(body).hexdigest()


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_50mb_random_download_byte_identical(scripted_upstream, start_proxy, framing):
    payload = _random_bytes(50 * MB, seed=2)

    async def serve(reader, writer, upstream):
        await reader.read_request()
        if framing == "chunked":
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for start in range(0, len(payload), 1 << 20):
                piece = payload[start:start + (1 << 20)]
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload))
            for start in range(0, len(payload), 1 << 20):
                writer.write(payload[start:start + (1 << 20)])
                await writer.drain()
        await writer.drain()
        await reader.read(1)

    proxy = start_proxy(scripted_upstream(serve).url)
    resp = RawClient(proxy.port, timeout=30).roundtrip("GET", "/weights")
    assert resp.complete
    assert hashlib.sha256(resp.body).hexdigest() == hashlib.sha256(payload).hexdigest()


def test_a_client_still_sending_chunk_framing_or_trailers_is_not_timed_out(fast_upstream, start_proxy):
    # The body timeout runs between reads, as nginx's does: bytes that carry no body
    # data (a trailer section sent slowly) are the client sending all the same.
    proxy = start_proxy(fast_upstream().url, **{"timeouts.client_body": 1.0})
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: a\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"3\r\nabc\r\n0\r\nX-Trailer: ")
        for byte in b"slowly":  # 1.2 s in all, each gap far under the timeout
            time.sleep(0.2)
            sock.sendall(bytes([byte]))
        sock.sendall(b"\r\n\r\n")
        reply = recv_until(sock, b"abc")
    assert reply.startswith(b"HTTP/1.1 200 "), reply


def test_chunk_extensions_past_the_header_limit_sent_slowly_are_accepted(fast_upstream, start_proxy):
    # Only a trailer section is held to limits.max_header_bytes, never chunk framing:
    # extensions are read and dropped (the body goes upstream re-chunked), so how they
    # arrive changes nothing. Over the limit, a read at a time, they once got 431.
    proxy = start_proxy(fast_upstream().url, **{"limits.max_header_bytes": 1024})
    extension = b";ext=" + b"e" * 1995
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: a\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"3\r\nabc\r\n0")
        for start in range(0, len(extension), 500):  # separate reads
            time.sleep(0.05)
            sock.sendall(extension[start:start + 500])
        sock.sendall(b"\r\nX-Checksum: 1\r\n\r\n")
        reply = recv_until(sock, b"abc")
    assert reply.startswith(b"HTTP/1.1 200 "), reply


def test_request_body_stalled_client_gets_408(fast_upstream, start_proxy):
    up = fast_upstream()
    proxy = start_proxy(up.url, **{"timeouts.client_body": 0.3})
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\nonly a few")
        reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 408 ") and b'"DBT"' in reply
        # How long the client was silent, counted from its last byte (10 of 100 sent).
        assert re.search(rb"request body silent for 0\.[3-9] s after 10 bytes", reply), reply
    assert wait_until(lambda: not proxy.ctx.in_flight)


def test_at_the_connection_cap_the_longest_idle_connection_makes_room(fast_upstream, start_proxy):
    proxy = start_proxy(fast_upstream().url, **{"limits.max_client_connections": 20})
    idle = [RawClient(proxy.port) for _ in range(20)]
    for client in idle:
        assert client.roundtrip("GET", "/health").status == 200
    newcomer = RawClient(proxy.port)
    assert newcomer.roundtrip("GET", "/health").status == 200
    assert idle[0].is_closed_by_peer(wait=2)  # the oldest idle one was closed
    assert idle[-1].roundtrip("GET", "/health").status == 200
    for client in idle + [newcomer]:
        client.close()


def test_at_the_cap_with_no_idle_connection_new_clients_get_503(scripted_upstream, start_proxy, loop_thread):
    release = asyncio.Event()

    async def held(reader, writer, upstream):
        await reader.read_request()
        await release.wait()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()

    ended = []

    class Ends:
        def on_done(self, record):
            ended.append(record)

    proxy = start_proxy(scripted_upstream(held).url, observers=[Ends()], **{"limits.max_client_connections": 3})
    busy = [RawClient(proxy.port) for _ in range(3)]
    for client in busy:
        client.request("GET", "/")
    assert wait_until(lambda: len(proxy.ctx.in_flight) == 3)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 503 ") and b'"DO"' in reply
    # A refusal like any other: its ids on the reply, and an ended request to count and trace.
    assert header_value(reply, b"x-request-id") and header_value(reply, b"traceresponse")
    assert wait_until(lambda: [r.outcome.code for r in ended] == ["DO"])
    loop_thread.call(release.set)
    assert all(c.response().status == 200 for c in busy)


def test_thousands_of_idle_keepalive_clients_do_not_lock_out_a_new_one(fast_upstream, start_proxy):
    proxy = start_proxy(fast_upstream().url)
    idle: list[socket.socket] = []
    try:
        for _ in range(2000):
            idle.append(socket.create_connection(("127.0.0.1", proxy.port), timeout=5))
        assert wait_until(lambda: len(proxy.ctx.connections) == 2000, timeout=10)
        resp = RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", body=b'{"stream": true}')
        assert resp.status == 200 and resp.complete
    finally:
        for sock in idle:
            sock.close()


def _push_for(sock: socket.socket, seconds: float, limit: int) -> int:
    """Bytes of a body the proxy lets the client send within ``seconds``."""
    sock.setblocking(False)
    block, sent = b"u" * 65536, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and sent < limit:
        try:
            sent += sock.send(block)
        except BlockingIOError:
            time.sleep(0.01)
    return sent


def test_upload_to_an_upstream_that_stops_reading_applies_backpressure(scripted_upstream, start_proxy):
    async def reads_head_only(reader, writer, upstream):
        await reader.read_head()
        await asyncio.sleep(30)  # and never reads the body

    proxy = start_proxy(scripted_upstream(reads_head_only).url)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n" % (200 * MB))
        sent = _push_for(sock, 1.5, 200 * MB)
    assert sent < 48 * MB, f"the proxy accepted {sent // MB} MB the upstream never read"


def test_a_connection_pooled_while_its_writes_are_paused_holds_back_the_next_body(scripted_upstream, start_proxy):
    # /one is resent on a fresh connection in one write, far past what the kernel
    # takes (the upstream's receive buffer is small); the upstream answers it at once,
    # unread, and keeps the connection. /two reuses it while the upstream reads
    # nothing: the pause must carry over, or /two's body piles up in the proxy.
    async def answers_before_reading(reader, writer, upstream):
        head = await reader.read_head()
        if b"/warm" in head:  # answered; then /one, read whole and closed unanswered: the proxy resends it
            await reader.readexactly(1)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            await reader.read_request()
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")  # /one resent: its body unread
        await writer.drain()
        await asyncio.sleep(30)  # and nothing more is read

    up = scripted_upstream(answers_before_reading)
    up.set_receive_buffer(65536)
    proxy = start_proxy(up.url, **{"pool.retry_buffer_bytes": 16 * MB})
    client = RawClient(proxy.port)
    assert client.roundtrip("POST", "/warm", body=b"w").status == 200
    assert client.roundtrip("POST", "/one", body=b"o" * (8 * MB)).status == 200
    assert b"/one" in up.received[-1]  # resent on a connection of its own
    client.sock.sendall(b"POST /two HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n" % (200 * MB))
    sent = _push_for(client.sock, 1.5, 200 * MB)
    two = [r for r in list(proxy.ctx.in_flight.values()) if r.target == "/two"]
    client.sock.close()
    assert two and two[0].attempts[-1].reused, "/two did not reuse the paused connection: the test proves nothing"
    assert sent < 48 * MB, f"the proxy accepted {sent // MB} MB of /two the upstream never read"


def test_sse_events_are_forwarded_as_they_arrive(scripted_upstream, start_proxy, loop_thread):
    """The upstream sends the next event only after the client has seen the previous
    one: any buffering in the proxy turns this into a hang."""
    seen = [threading.Event() for _ in range(3)]

    async def lockstep(reader, writer, upstream):
        await reader.read_request()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i, event in enumerate(seen):
            payload = b"data: token%d\n\n" % i
            writer.write(b"%x\r\n%s\r\n" % (len(payload), payload))
            await writer.drain()
            for _ in range(500):  # bounded: 5 s
                if event.is_set():
                    break
                await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    proxy = start_proxy(scripted_upstream(lockstep).url)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=3) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}")
        received = b""
        for i, event in enumerate(seen):
            # Times out (fails) if the proxy holds the event back.
            received = recv_until(sock, b"data: token%d" % i, received)
            event.set()


def test_a_large_request_that_failed_leaves_its_connection_readable(start_proxy, dead_upstream):
    # Its body was held for a connection (reading paused past 256 KiB); the upstream
    # refused. The retry on the same keep-alive connection, as SDKs send it after a
    # 502, must be read and answered, not left unread until the idle timeout.
    proxy = start_proxy(dead_upstream)
    client = RawClient(proxy.port, timeout=5)
    body = b'{"prompt": "' + b"x" * 300_000 + b'"}'
    for _ in range(2):
        resp = client.roundtrip("POST", "/v1/completions", body=body)
        assert resp.status == 502 and resp.headers["x-traceproxy-outcome"] == "UF"


def test_a_request_pipelined_behind_a_closing_connection_is_never_sent_upstream(scripted_upstream, start_proxy):
    # A failed before its body was read; the proxy answered 502 and closes once that
    # body has been drained, which happens within the read that also holds B. B can
    # never be answered there, and the client resends it on a new connection (RFC 9112
    # section 9.3.2): started upstream too, a POST would run twice.
    async def handler(reader, writer, upstream):
        while True:
            head = await reader.read_head()
            if head.startswith(b"POST /a "):
                return  # A fails before any response byte
            await reader.readexactly(int(header_value(head, b"content-length")))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    up = scripted_upstream(handler)
    proxy = start_proxy(up.url)
    body_size = 8 * MB + 1000  # past what the proxy drains after its early answer: it closes then
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n" % body_size)
        reply = recv_until(sock, b"\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 502 ") and b"Connection: close" in reply
        with contextlib.suppress(ConnectionError):
            sock.sendall(b"x" * body_size + b"POST /b HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n\r\nbbbb")
        rest = b""
        with contextlib.suppress(ConnectionError):
            while chunk := sock.recv(65536):
                rest += chunk
    assert b"HTTP/1.1 200" not in rest  # B was not answered: the connection closed
    assert not wait_until(lambda: any(b"POST /b " in bytes(seen) for seen in up.received), timeout=0.5), \
        "B was run upstream, though its client never got the answer and will resend it"


@contextlib.contextmanager
def _stream_to_a_full_client(proxy, receive_buffer: int = 4096):
    """A streamed request from a client with a small receive buffer; yields its socket
    once the proxy's writes to it are paused (its connection is full)."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}")
        assert wait_until(lambda: any(r.downstream_paused_since_ns for r in proxy.ctx.in_flight.values()))
        yield sock


async def _streams_big_events(reader, writer, upstream):
    """An SSE stream of 4 KiB events, written as fast as the proxy takes them."""
    await reader.read_request()
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    event = b"data: " + b"t" * 4096 + b"\n\n"
    with contextlib.suppress(ConnectionError):
        for _ in range(100_000):  # bounded; the proxy lets go long before
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()


def test_a_client_half_close_while_its_response_is_backed_up_lets_the_engine_go(scripted_upstream, start_proxy):
    # The client stops reading a long stream, then sends FIN: the proxy's writes can
    # never drain, so a graceful close would never finish and the engine would keep
    # the request. The upstream must see its connection end within a second.
    up = scripted_upstream(_streams_big_events)
    proxy = start_proxy(up.url)
    with _stream_to_a_full_client(proxy) as sock:
        sock.shutdown(socket.SHUT_WR)
        shut = time.monotonic()
        assert up.closed.wait(5)
        assert time.monotonic() - shut < 1.0
    assert wait_until(lambda: not proxy.ctx.in_flight)


def test_a_slow_upload_is_not_charged_to_the_upstream_header_timeout(scripted_upstream, start_proxy):
    # The client sends its body a byte every 0.2 s, never silent for the body timeout (1 s);
    # the upstream answers once it has the whole body. The header timeout counts from
    # the last request byte, so it is not the engine's fault that this took 1.2 s.
    async def answers_after_body(reader, writer, upstream):
        await reader.read_request()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    proxy = start_proxy(scripted_upstream(answers_after_body).url,
                        **{"timeouts.upstream_headers": 0.5, "timeouts.client_body": 1.0})
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 6\r\n\r\n")
        for byte in b"abcdef":
            time.sleep(0.2)
            sock.sendall(bytes([byte]))
        assert recv_until(sock, b"ok").startswith(b"HTTP/1.1 200 ")


def test_a_client_silent_mid_body_is_blamed_even_when_both_timeouts_are_equal(scripted_upstream, start_proxy):
    async def waits_for_the_body(reader, writer, upstream):
        await reader.read_request()

    proxy = start_proxy(scripted_upstream(waits_for_the_body).url,
                        **{"timeouts.upstream_headers": 0.3, "timeouts.client_body": 0.3})
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\nonly some")
        reply = recv_until(sock, b"}")
    assert reply.startswith(b"HTTP/1.1 408 ") and b'"DBT"' in reply


def test_a_client_silent_mid_body_is_blamed_when_the_header_timeout_is_the_shorter(scripted_upstream, start_proxy):
    # The engine cannot answer before the body ends: a client that went silent
    # mid-body owes the next byte, whichever timeout is shorter.
    async def waits_for_the_body(reader, writer, upstream):
        await reader.read_request()

    proxy = start_proxy(scripted_upstream(waits_for_the_body).url,
                        **{"timeouts.upstream_headers": 0.3, "timeouts.client_body": 0.8})
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\nonly some")
        reply = recv_until(sock, b"}")
    assert reply.startswith(b"HTTP/1.1 408 ") and b'"DBT"' in reply
    assert time.monotonic() - started >= 0.7


def test_a_client_that_stops_reading_is_cut_after_the_send_timeout(scripted_upstream, start_proxy):
    # Its request held an upstream connection (and a slot under pool.max_connections)
    # for as long as it did not read, which could be forever.
    up = scripted_upstream(_streams_big_events)
    proxy = start_proxy(up.url, **{"timeouts.client_send": 0.5})
    # Not before the timeout: counted from before the request, which is surely before the
    # client last took bytes (from when this thread sees the pause, a late look undercounts).
    sent = time.monotonic()
    with _stream_to_a_full_client(proxy):
        paused = time.monotonic()
        assert up.closed.wait(5)  # the engine is let go
        assert time.monotonic() - sent >= 0.5 and time.monotonic() - paused < 2.5
        assert wait_until(lambda: not proxy.ctx.in_flight and not proxy.ctx.connections)


class _FullTransport(asyncio.Transport):
    """A client transport whose client stopped reading: its written bytes never drain."""

    def __init__(self):
        super().__init__()
        self.closed = self.aborted = False

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 40000) if name == "peername" else default

    def get_write_buffer_size(self):
        return 16384

    def is_closing(self):
        return self.closed or self.aborted

    def close(self):
        self.closed = True  # a real transport closes only once it has flushed

    def abort(self):
        self.aborted = True


def test_a_client_that_reads_nothing_holds_back_the_upstream_not_the_proxys_memory(scripted_upstream, start_proxy):
    up = scripted_upstream(_streams_big_events)
    proxy = start_proxy(up.url)
    with _stream_to_a_full_client(proxy):
        time.sleep(0.5)  # the upstream writes as fast as the proxy takes its bytes
        (client,) = proxy.ctx.connections
        assert client.transport.get_write_buffer_size() < 1 * MB
        (record,) = proxy.ctx.in_flight.values()
        assert record.upstream_rx_body_bytes < 16 * MB


def test_a_slow_client_that_keeps_reading_is_not_cut_by_the_send_timeout(scripted_upstream, start_proxy):
    # Its connection stays full for long (the kernel lets the proxy write again only
    # once a third of the send buffer is free), but it takes bytes all the while.
    up = scripted_upstream(_streams_big_events)
    proxy = start_proxy(up.url, **{"timeouts.client_send": 0.5})
    with _stream_to_a_full_client(proxy, receive_buffer=8192) as sock:
        received, started = 0, time.monotonic()
        while time.monotonic() - started < 2.0:  # 2 s of reading 8 KiB every 50 ms
            received += len(sock.recv(8192))
            time.sleep(0.05)
        assert received > 100_000 and not up.closed.is_set()
        assert [r.outcome for r in proxy.ctx.in_flight.values()] == [None]


def test_a_close_cut_short_by_the_send_timeout_is_a_reset_not_an_end(start_proxy, loop_thread):
    # A close-delimited response ends where the connection ends: a FIN after what the
    # kernel still holds would make the client take a cut body for a whole one.
    from traceproxy.proxy.downstream import ClientConnection

    proxy = start_proxy("http://127.0.0.1:9", **{"timeouts.client_send": 0.3})
    listener = socket.create_server(("127.0.0.1", 0))
    with listener, socket.socket() as client_side:
        client_side.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client_side.connect(listener.getsockname())
        accepted, _ = listener.accept()

        async def write_then_close():
            _, connection = await asyncio.get_running_loop().connect_accepted_socket(
                lambda: ClientConnection(proxy.ctx), accepted)
            connection.write(b"HTTP/1.0 200 OK\r\n\r\n" + b"b" * 8 * MB)
            connection.close()

        loop_thread.run(write_then_close())
        time.sleep(1.0)  # the client reads nothing past the send timeout
        received, ended = _read_to_the_end(client_side)
    assert ended == "reset" and len(received) < 8 * MB


def test_a_close_waiting_on_a_client_that_never_reads_ends_after_the_send_timeout(start_proxy, loop_thread):
    from traceproxy.proxy.downstream import ClientConnection

    proxy = start_proxy("http://127.0.0.1:9", **{"timeouts.client_send": 0.3})
    transport = _FullTransport()

    async def close_with_bytes_unread():
        client = ClientConnection(proxy.ctx)
        client.connection_made(transport)
        client.close()

    loop_thread.run(close_with_bytes_unread())
    assert transport.closed and not transport.aborted
    assert wait_until(lambda: transport.aborted, timeout=2)


def _read_to_the_end(sock: socket.socket) -> tuple[bytes, str]:
    """Everything the proxy sends, and how the connection ended: eof or reset."""
    received = b""
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            return received, "reset"
        if not data:
            return received, "eof"
        received += data


def _upload_in_background(sock: socket.socket, size: int) -> threading.Thread:
    def upload():
        with contextlib.suppress(OSError):
            for _ in range(size // 65536):
                sock.sendall(b"x" * 65536)

    sender = threading.Thread(target=upload, daemon=True)
    sender.start()
    return sender


def test_an_answer_before_the_upload_ends_reaches_the_client_whole(scripted_upstream, start_proxy):
    # The engine refuses the body at its head (413) while the client is still uploading.
    # Closing with the upload unread would make the kernel reset the connection, and
    # the reset destroys the part of the answer the client has not read yet.
    answer = b"r" * 2_000_000

    async def refuses_at_the_head(reader, writer, upstream):
        await reader.read_head()
        writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: %d\r\n\r\n%s" % (len(answer), answer))
        await writer.drain()
        await asyncio.sleep(5)  # never reads the body

    proxy = start_proxy(scripted_upstream(refuses_at_the_head).url)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n" % (50 * MB))
        _upload_in_background(sock, 50 * MB)
        time.sleep(0.5)  # the client reads its answer only later, as one busy uploading does
        received, ended = _read_to_the_end(sock)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ") and header_value(head, b"connection") == b"close"
    assert ended == "eof" and body == answer


def test_a_lingering_close_ends_at_the_clients_fin_or_after_its_limit(fast_upstream, start_proxy):
    from traceproxy.proxy.downstream import LINGER_SECONDS

    proxy = start_proxy(fast_upstream().url, **{"limits.max_header_bytes": 4096})
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: a\r\nX-Long: " + b"v" * 8192)
        assert recv_until(sock, b"}").startswith(b"HTTP/1.1 431 ")
        assert sock.recv(1) == b""  # the proxy's FIN, right after its answer
        assert len(proxy.ctx.connections) == 1  # still reading what the client sends
        sock.shutdown(socket.SHUT_WR)
        assert wait_until(lambda: not proxy.ctx.connections, timeout=1)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: a\r\nX-Long: " + b"v" * 8192)
        assert recv_until(sock, b"}").startswith(b"HTTP/1.1 431 ")
        started = time.monotonic()
        for _ in range(int(LINGER_SECONDS * 20) + 40):  # keeps sending, never a FIN
            try:
                sock.sendall(b"v" * 1024)
            except OSError:
                break
            time.sleep(0.05)
        assert LINGER_SECONDS - 0.2 <= time.monotonic() - started < LINGER_SECONDS + 1.5
