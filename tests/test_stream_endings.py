"""How an event stream ended, judged from its events end to end: a client that leaves at
data: [DONE] had its stream however the [DONE] was read."""

from __future__ import annotations

import asyncio
import socket

import h11

from .support import wait_until

SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
TOKENS = [b'data: {"choices":[{"index":0,"delta":{"content":"t%d"},"finish_reason":null}]}\n\n' % i
          for i in range(3)]
DONE = b"data: [DONE]\n\n"
POST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nx-request-id: %s\r\nContent-Length: 2\r\n\r\n{}")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def ended(proxy) -> list:
    done = []

    class Ended:
        def on_done(self, record):
            done.append(record)

    proxy.fanout.add(Ended())
    return done


def read_body_until(sock: socket.socket, marker: bytes) -> bytes:
    """The response body (de-chunked) as far as ``marker``; bounded by the socket's timeout."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/", headers=[("Host", "a"), ("Content-Length", "2")]))
    conn.send(h11.Data(data=b"{}"))
    conn.send(h11.EndOfMessage())
    body = b""
    while marker not in body:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = sock.recv(65536)
            assert data, f"closed before {marker!r}: {body[-200:]!r}"
            conn.receive_data(data)
        elif isinstance(event, h11.Data):
            body += bytes(event.data)
        else:
            assert isinstance(event, h11.Response), event
    return body


def sends(*writes: bytes, pause: float = 0.0, then_end: bool = True):
    """Reads one request, writes the event-stream head and each of ``writes`` (one
    write each, ``pause`` s apart), the end of the body if ``then_end``, then holds the
    connection until the proxy closes it."""

    async def handler(reader, writer, upstream) -> None:
        await reader.read_request()
        writer.write(SSE_HEAD)
        await writer.drain()
        for data in writes:
            if pause:
                await asyncio.sleep(pause)
            writer.write(data)
            await writer.drain()
        if then_end:
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        await reader.read(1)

    return handler


def test_a_client_leaving_at_done_that_came_a_byte_per_read_had_its_whole_stream(scripted_upstream, start_proxy):
    # The openai SDK closes at data: [DONE]. The [DONE] event came in many reads: what
    # decides is the stream's last event, not the last bytes read.
    last = chunk(DONE)
    writes = [chunk(TOKENS[0]), *(last[i:i + 1] for i in range(len(last)))]
    upstream = scripted_upstream(sends(*writes, pause=0.01, then_end=False))
    proxy = start_proxy(upstream.url)
    done = ended(proxy)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(POST % b"done-1")
        read_body_until(sock, DONE)
    assert wait_until(lambda: done)
    assert done[0].outcome.code == "OK", (done[0].outcome, done[0].error)
    assert done[0].upstream_rx_chunks > 3  # it did come in pieces
