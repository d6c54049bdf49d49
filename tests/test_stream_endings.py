"""How an event stream ended, judged from its events end to end: an in-band error is an
upstream failure blamed on the engine (USE), whatever the stream did after it, and a
client that leaves at data: [DONE] had its stream however the [DONE] was read."""

from __future__ import annotations

import asyncio
import socket

import h11

from .fake_transport import ProxyHarness
from .otlp_receiver import OtlpHttpReceiver
from .support import RawClient, admin_get, ended, wait_until

SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
TOKENS = [b'data: {"choices":[{"index":0,"delta":{"content":"t%d"},"finish_reason":null}]}\n\n' % i
          for i in range(3)]
# What smg 1.13 sends when decode's connection fails mid-stream.
SMG_ERROR = (b'data: {"error":{"message":"Stream error: error decoding response body: unexpected EOF",'
             b'"type":"stream_error"}}\n\n')
DONE = b"data: [DONE]\n\n"
POST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nx-request-id: %s\r\nContent-Length: 2\r\n\r\n{}")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


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


def test_an_in_band_error_then_done_is_an_engine_failure_and_the_client_gets_it_unchanged(scripted_upstream,
                                                                                         start_proxy):
    events = TOKENS + [SMG_ERROR, DONE]
    with OtlpHttpReceiver() as receiver:
        proxy = start_proxy(scripted_upstream(sends(*(chunk(e) for e in events))).url,
                            **{"tracing.exporter": "otlp", "tracing.otlp_endpoint": receiver.endpoint,
                               "tracing.otlp_protocol": "http/protobuf"})
        done = ended(proxy)
        response = RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", body=b"{}")
        assert response.status == 200 and response.complete and response.body == b"".join(events)
        assert wait_until(lambda: done)
        record = done[0]
        assert record.outcome.code == "USE" and record.outcome.blame.value == "engine"
        assert record.error == ("the upstream reported in its event stream that the response failed: "
                                "Stream error: error decoding response body: unexpected EOF")
        assert 'traceproxy_requests_total{status="200",outcome="USE",blame="engine"} 1' in admin_get(proxy, "/metrics")
        assert wait_until(lambda: receiver.find(trace_id=record.trace_id), timeout=10)
        server = next(s for s in receiver.find(trace_id=record.trace_id) if s.span.kind == 2)  # SERVER
        assert server.span.status.code == 2 and "unexpected EOF" in server.span.status.message  # ERROR
        assert server.attributes["traceproxy.outcome"] == "USE"


def test_a_client_that_leaves_after_an_in_band_error_did_not_fail_the_request(scripted_upstream, start_proxy):
    # The openai SDK raises at the error event and closes: the upstream had said the
    # response failed, so the request is not the client's disconnect.
    proxy = start_proxy(scripted_upstream(sends(*(chunk(e) for e in TOKENS + [SMG_ERROR]), then_end=False)).url)
    done = ended(proxy)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(POST % b"leaves-1")
        read_body_until(sock, b"stream_error")
    assert wait_until(lambda: done)
    assert done[0].outcome.code == "USE"
    assert "unexpected EOF; then client closed the connection" in done[0].error


def test_a_client_that_leaves_at_done_after_an_in_band_error_did_not_have_a_whole_response(scripted_upstream,
                                                                                         start_proxy):
    proxy = start_proxy(scripted_upstream(sends(*(chunk(e) for e in TOKENS + [SMG_ERROR, DONE]),
                                                then_end=False)).url)
    done = ended(proxy)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(POST % b"leaves-2")
        read_body_until(sock, DONE)
    assert wait_until(lambda: done)
    assert done[0].outcome.code == "USE"


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


def test_a_head_request_to_an_event_stream_is_answered_ok_not_as_a_stream_without_its_end():
    # The head of an event stream, and no body, as HEAD asks: there are no events to miss.
    with ProxyHarness() as h:
        h.client_sends(b"HEAD /v1/events HTTP/1.1\r\nHost: a.test\r\n\r\n")
        h.upstream_sends(SSE_HEAD)
        assert h.outcomes == [("/v1/events", "OK", 200)]
        assert h.done.records[0].stream_events is None
