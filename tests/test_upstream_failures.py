"""Upstream failures are explicit and distinguishable, and a failure after the response
started is visible to the client as a truncated response, never a complete one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import struct
import time

import pytest

from .support import (RawClient, answers_in_parts, answers_partly_then_resets, header_value, never_answers, recv_until,
                      wait_until)


def _error(resp) -> dict:
    assert resp.headers["content-type"] == "application/json"
    return json.loads(resp.body)["error"]


def test_connect_refused_is_502_uf(start_proxy, dead_upstream):
    proxy = start_proxy(dead_upstream)
    resp = RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", body=b"{}")
    assert resp.status == 502
    assert resp.headers["x-traceproxy-outcome"] == "UF"
    error = _error(resp)
    assert error["code"] == "UF" and error["type"] == "upstream_connection_failure"
    assert "refused" in error["message"]


def test_the_proxys_own_error_for_a_head_request_has_no_body(scripted_upstream, start_proxy, dead_upstream):
    # RFC 9110 section 9.3.2: a body after the head would be read (by a strict client
    # such as h11) as the start of the next response on the keep-alive connection.
    for upstream, overrides, status in ((dead_upstream, {}, 502),
                                        (scripted_upstream(never_answers).url, {"timeouts.upstream_headers": 0.3}, 504)):
        proxy = start_proxy(upstream, **overrides)
        client = RawClient(proxy.port)
        head = client.roundtrip("HEAD", "/v1/models")
        assert head.status == status and head.complete and head.body == b""
        assert int(head.headers["content-length"]) > 0  # what a GET would have received
        after = client.roundtrip("GET", "/v1/models")
        assert after.status == status and after.complete and _error(after)["code"] == head.headers["x-traceproxy-outcome"]


def test_no_response_headers_in_time_is_504_ut(scripted_upstream, start_proxy):
    up = scripted_upstream(never_answers)
    proxy = start_proxy(up.url, **{"timeouts.upstream_headers": 0.3})
    client = RawClient(proxy.port)
    resp = client.roundtrip("GET", "/")
    assert resp.status == 504 and _error(resp)["code"] == "UT"
    assert "no response headers within 0.3 s" in _error(resp)["message"]
    # The stuck upstream connection is closed, not left holding a slot.
    assert wait_until(lambda: len(up.closed_at) == 1, timeout=2)
    # The client connection survives a local error reply.
    assert client.roundtrip("GET", "/").status == 504


def test_a_later_request_on_a_keep_alive_connection_gets_its_own_full_timeout(scripted_upstream, start_proxy):
    """The deadline timer outlives a request and is re-aimed for the next one: the
    second request times out a full upstream_headers after its own start."""

    async def answers_first_only(reader, writer, upstream):
        await reader.read_request()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read_request()
        await reader.read(1)

    up = scripted_upstream(answers_first_only)
    proxy = start_proxy(up.url, **{"timeouts.upstream_headers": 0.6})
    client = RawClient(proxy.port)
    assert client.roundtrip("GET", "/1").status == 200
    time.sleep(0.4)  # the first request's deadline falls during the second one
    started = time.monotonic()
    resp = client.roundtrip("GET", "/2")
    waited = time.monotonic() - started
    assert resp.status == 504 and _error(resp)["code"] == "UT"
    assert 0.55 <= waited < 3


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nhello",  # malformed
    b"SSH-2.0-OpenSSH_9.6\r\n",  # not HTTP at all
    # A valid head, then a bad chunk in the same read: nothing reached the client yet,
    # so it still gets the error rather than a connection closed without a byte.
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"e\r\ndata: token\n\n\r\n",  # chunk size one more than the data
    # What llhttp lets through in a status line: RFC 9110 section 15 allows 100..599,
    # and a reason phrase is tabs, spaces and visible characters (RFC 9112 section 4).
    b"HTTP/1.1 000 OK\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 099 OK\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 O\x00K\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 O\x1bK\r\nContent-Length: 0\r\n\r\n",
    # Past a signed 64-bit integer (llhttp takes up to 2**64 - 1): a client would read another length.
    b"HTTP/1.1 200 OK\r\nContent-Length: 9223372036854775808\r\n\r\nhello",
], ids=["conflicting-lengths", "not-http", "bad-chunk-size-after-head", "chunk-overrun-after-head",
        "status-000", "status-099", "nul-in-reason", "escape-in-reason", "length-past-int64"])
def test_malformed_upstream_response_is_502_upe(reply, scripted_upstream, start_proxy):
    async def garbage(reader, writer, upstream):
        await reader.read_request()
        writer.write(reply)

    proxy = start_proxy(scripted_upstream(garbage).url)
    resp = RawClient(proxy.port).roundtrip("GET", "/")
    assert resp.status == 502 and _error(resp)["code"] == "UPE"


@pytest.mark.parametrize("after_head, fragment", [
    (b"X-Huge: ", b"response head exceeds 4096 bytes"),  # a header value that never ends
    # A trailer value that never ends, which httptools would gather without bound.
    (b"Transfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\nX-Trailer: ", b"trailers exceed 4096 bytes"),
], ids=["head", "trailers"])
def test_an_endless_response_head_or_trailer_is_cut_off(after_head, fragment, scripted_upstream, start_proxy):
    async def endless(reader, writer, upstream):
        await reader.read_request()
        writer.write(b"HTTP/1.1 200 OK\r\n" + after_head)
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            for _ in range(4096):  # 64 MiB at most; the proxy must stop it long before
                await asyncio.sleep(0.001)  # separate reads, as a slow sender's arrive
                writer.write(b"v" * 16384)
                await writer.drain()

    up = scripted_upstream(endless)
    proxy = start_proxy(up.url, **{"limits.max_header_bytes": 4096})
    started = time.monotonic()
    resp = RawClient(proxy.port, timeout=10).roundtrip("GET", "/")
    assert time.monotonic() - started < 5
    if after_head.startswith(b"X-Huge"):
        assert resp.status == 502 and _error(resp)["code"] == "UPE" and fragment.decode() in _error(resp)["message"]
    else:  # the response had started: it is cut short, never ended as if complete
        assert resp.status == 200 and not resp.complete
    assert up.closed.wait(5)


def _answers_in_reads(*parts: bytes):
    async def answer(reader, writer, upstream):
        await reader.read_request()
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.2)  # each part a read of its own

    return answer


def test_a_response_head_over_the_limit_that_ends_in_a_later_read_is_refused(scripted_upstream, start_proxy):
    head = b"HTTP/1.1 200 OK\r\nX-Big: " + b"h" * 6000
    proxy = start_proxy(scripted_upstream(_answers_in_reads(
        head[:3000], head[3000:] + b"\r\nContent-Length: 2\r\n\r\nok")).url, **{"limits.max_header_bytes": 4096})
    resp = RawClient(proxy.port).roundtrip("GET", "/")
    assert resp.status == 502 and "response head exceeds 4096 bytes" in _error(resp)["message"]


def test_a_head_near_the_limit_is_not_counted_as_chunk_framing(scripted_upstream, start_proxy):
    # The read that ends the head carries no body: its bytes are head, not framing.
    head = b"HTTP/1.1 200 OK\r\nX-Big: " + b"h" * 3500 + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
    trailer = b"X-Trailer: " + b"t" * 1500 + b"\r\n"
    proxy = start_proxy(scripted_upstream(_answers_in_reads(
        head, b"0\r\n" + trailer[:700], trailer[700:] + b"\r\n")).url, **{"limits.max_header_bytes": 4096})
    resp = RawClient(proxy.port).roundtrip("GET", "/")
    assert (resp.status, resp.body, resp.complete) == (200, b"", True)


def test_the_header_timeout_runs_from_the_end_of_the_body_when_shorter_than_the_body_timeout(
        scripted_upstream, start_proxy):
    # The timer was aimed at the body deadline while the body was the client's to send;
    # once the body ended, the shorter header deadline must be the one that fires.
    proxy = start_proxy(scripted_upstream(never_answers).url,
                        **{"timeouts.upstream_headers": 0.5, "timeouts.client_body": 5})
    started = time.monotonic()
    resp = RawClient(proxy.port, timeout=10).roundtrip("POST", "/v1/chat/completions", body=b'{"stream": true}')
    assert resp.status == 504 and _error(resp)["code"] == "UT"
    assert time.monotonic() - started < 2


def test_the_header_timeout_counts_from_a_chunked_bodys_end_sent_after_a_pause(scripted_upstream, start_proxy):
    async def answers_a_second_after_the_body(reader, writer, upstream):
        await reader.read_request()
        await asyncio.sleep(1.0)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    proxy = start_proxy(scripted_upstream(answers_a_second_after_the_body).url,
                        **{"timeouts.upstream_headers": 2, "timeouts.client_body": 10})
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n")
        time.sleep(1.5)
        sock.sendall(b"0\r\n\r\n")  # the last request byte: the 2 s count from here
        assert recv_until(sock, b"ok").startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize("reads, status", [
    # A 1xx head and an oversized final head in one read: the final one is refused.
    ((b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nX-Big: " + b"b" * 6000
      + b"\r\nContent-Length: 2\r\n\r\nok",), 502),
    # A 1xx head near the limit, then a small final head: neither is over it.
    ((b"HTTP/1.1 103 Early Hints\r\nLink: " + b"l" * 3000 + b"\r\n\r\n",
      b"HTTP/1.1 200 OK\r\nX-Mid: " + b"m" * 2000 + b"\r\nContent-Length: 2\r\n\r\nok"), 200),
    # 1xx heads in reads of their own, split, or with no reason phrase, before an oversized final head.
    ((b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\n\r\nHTTP/1.1 200 OK\r\nX-Big: "
      + b"b" * 6000 + b"\r\nContent-Length: 2\r\n\r\nok"), 502),
    ((b"HTTP/1.1 100 Cont", b"inue\r\n\r\nHTTP/1.1 200 OK\r\nX-Big: " + b"b" * 6000
      + b"\r\nContent-Length: 2\r\n\r\nok"), 502),
    ((b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nX-Big: " + b"b" * 3000,
      b"b" * 3000 + b"\r\nContent-Length: 2\r\n\r\nok"), 502),
    ((b"HTTP/1.1 100\r\n\r\nHTTP/1.1 200 OK\r\nX-Big: " + b"b" * 6000 + b"\r\nContent-Length: 2\r\n\r\nok",), 502),
    # An empty line before a 1xx status line (llhttp skips it) does not hide the final head.
    ((b"\r\nHTTP/1.1 103 Early Hints\r\n\r\nHTTP/1.1 200 OK\r\nX-Big: " + b"b" * 3000,
      b"b" * 3000 + b"\r\nContent-Length: 2\r\n\r\nok"), 502),
    # A head's empty line over three reads, one of them a single byte.
    ((b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r", b"\n", b"\r\n" + b"b" * 5000), 200),
], ids=["oversized-final-head-after-a-1xx", "1xx-then-a-head-each-under-the-limit", "1xx-heads-in-reads-of-their-own",
        "1xx-split-across-reads", "final-head-split-after-a-1xx", "1xx-without-a-reason", "empty-line-before-a-1xx",
        "end-of-head-over-three-reads"])
def test_the_head_limit_holds_each_head_not_1xx_heads_before_it(reads, status, scripted_upstream, start_proxy):
    proxy = start_proxy(scripted_upstream(_answers_in_reads(*reads)).url, **{"limits.max_header_bytes": 4096})
    assert RawClient(proxy.port).roundtrip("GET", "/").status == status


@pytest.mark.parametrize("coding", [b"gzip", b"gzip, chunked"])
def test_a_transfer_coding_other_than_chunked_is_refused_not_passed_on(coding, scripted_upstream, start_proxy):
    # llhttp hands over such a body still coded, and the coding is named in a hop-by-hop
    # header: passing the body on without it would change what the client receives.
    async def coded(reader, writer, upstream):
        await reader.read_request()
        body = b"5\r\nGZIPB\r\n0\r\n\r\n" if coding.endswith(b"chunked") else b"GZIPBYTES"
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: %s\r\n\r\n%s" % (coding, body))
        await writer.drain()

    proxy = start_proxy(scripted_upstream(coded).url)
    resp = RawClient(proxy.port).roundtrip("GET", "/")
    assert resp.status == 502 and resp.headers["x-traceproxy-outcome"] == "UPE"
    error = _error(resp)
    assert error["code"] == "UPE" and error["type"] == "upstream_protocol_error"
    assert f"Transfer-Encoding '{coding.decode()}'" in error["message"]


def test_truncated_response_to_an_http10_client_ends_in_a_reset(scripted_upstream, start_proxy):
    # An HTTP/1.0 client reads the body until the connection closes: a FIN after the
    # last byte would make a cut-off response look complete.
    dies = answers_partly_then_resets(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", 0.1)
    proxy = start_proxy(scripted_upstream(dies).url)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
        received, ending = b"", None
        for _ in range(100):
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                ending = "reset"
                break
            if not chunk:
                ending = "clean close"
                break
            received += chunk
    assert received.startswith(b"HTTP/1.0 200")
    assert ending == "reset"


def test_upstream_closes_mid_chunked_stream_client_sees_truncation(scripted_upstream, start_proxy):
    dies = answers_partly_then_resets(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                      b"Transfer-Encoding: chunked\r\n\r\ne\r\ndata: token1\n\n\r\n")
    proxy = start_proxy(scripted_upstream(dies).url)
    client = RawClient(proxy.port)
    resp = client.roundtrip("POST", "/v1/chat/completions", body=b"{}")
    assert resp.status == 200
    assert resp.body == b"data: token1\n\n"
    assert not resp.complete  # no terminating chunk: the client can tell
    assert client.is_closed_by_peer()


def test_upstream_closes_short_of_content_length_client_sees_truncation(scripted_upstream, start_proxy):
    async def short(reader, writer, upstream):
        await reader.read_request()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly forty bytes of the hundred promised")
        await writer.drain()
        writer.close()

    proxy = start_proxy(scripted_upstream(short).url)
    resp = RawClient(proxy.port).roundtrip("GET", "/")
    assert resp.status == 200 and resp.headers["content-length"] == "100"
    assert not resp.complete and len(resp.body) < 100


def test_upstream_closes_before_any_byte_on_fresh_connection_is_502_uc_not_retried(scripted_upstream, start_proxy):
    async def hangs_up(reader, writer, upstream):
        await reader.read_request()
        writer.transport.abort()

    up = scripted_upstream(hangs_up)
    proxy = start_proxy(up.url)
    resp = RawClient(proxy.port).roundtrip("POST", "/v1/completions", body=b"{}")
    assert resp.status == 502 and _error(resp)["code"] == "UC"
    assert "new connection" in _error(resp)["message"]
    assert up.connections == 1  # fresh-connection failures are not retried


def test_stream_silent_past_upstream_read_timeout_is_aborted(scripted_upstream, start_proxy):
    stalls = answers_in_parts(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
    proxy = start_proxy(scripted_upstream(stalls).url, **{"timeouts.upstream_read": 0.3})
    resp = RawClient(proxy.port).roundtrip("GET", "/")
    assert resp.status == 200 and resp.body == b"hello" and not resp.complete


def test_client_disconnect_mid_stream_closes_upstream_at_once(scripted_upstream, start_proxy):
    async def slow_stream(reader, writer, upstream):
        await reader.read_request()
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(200):
            writer.write(b"6\r\ntoken%d\r\n" % (i % 10))
            await writer.drain()
            await asyncio.sleep(0.05)

    up = scripted_upstream(slow_stream)
    proxy = start_proxy(up.url)
    client = RawClient(proxy.port)
    client.request("POST", "/v1/chat/completions", body=b"{}")
    assert client.sock.recv(4096).startswith(b"HTTP/1.1 200")
    client.close()
    left = time.monotonic()
    assert up.closed.wait(1.0), "the engine must see its connection close within a second"
    assert up.closed_at[0] - left < 1.0
    assert wait_until(lambda: not proxy.ctx.in_flight, timeout=2)


def test_client_disconnect_while_waiting_for_headers_closes_upstream(scripted_upstream, start_proxy):
    up = scripted_upstream(never_answers)
    proxy = start_proxy(up.url)
    client = RawClient(proxy.port)
    client.request("POST", "/generate", body=b"{}")
    assert wait_until(lambda: up.connections == 1, timeout=2)
    client.close()
    assert up.closed.wait(1.0)


@pytest.mark.parametrize("second", [
    b"GET /two HTTP/1.1\r\nHost: a\r\n\r\n",  # waits its turn
    b"GET /two HTTP/1.1\r\nHost a\r\n\r\n",  # refused once the first is answered
], ids=["pipelined", "pipelined-malformed"])
def test_client_disconnect_while_reading_is_paused_closes_upstream(second, scripted_upstream, start_proxy):
    # With a request queued behind the active one, the proxy stops reading the client:
    # its hang-up must still reach the engine.
    up = scripted_upstream(never_answers)
    proxy = start_proxy(up.url)
    client = RawClient(proxy.port)
    client.send(b"GET /one HTTP/1.1\r\nHost: a\r\n\r\n" + second, expect=("GET", "GET"))
    assert wait_until(lambda: up.connections == 1, timeout=2)
    client.close()
    assert up.closed.wait(1.0), "the engine must see its connection close within a second"
    assert wait_until(lambda: not proxy.ctx.in_flight, timeout=2)


def test_client_reset_during_an_upload_the_upstream_is_not_reading_closes_upstream(scripted_upstream, start_proxy):
    async def reads_head_only(reader, writer, upstream):
        await reader.read_head()
        # Never reads the body, so a FIN from the proxy would sit behind it unseen:
        # watch the socket itself for the end of the connection.
        poller = select.poll()
        poller.register(writer.get_extra_info("socket").fileno(), select.POLLHUP | select.POLLERR | select.POLLRDHUP)
        for _ in range(300):
            if poller.poll(0):
                return
            await asyncio.sleep(0.02)

    up = scripted_upstream(reads_head_only)
    proxy = start_proxy(up.url)
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    sock.sendall(b"POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: 100000000\r\n\r\n")
    sock.setblocking(False)
    block = b"u" * 65536
    for _ in range(2000):  # until every buffer on the way is full: the proxy paused reading
        try:
            sock.send(block)
        except BlockingIOError:
            if wait_until(lambda: any(c.reading_paused for c in list(proxy.ctx.connections)), timeout=0.2):
                break
    # A reset, as from a client killed mid-upload: a FIN would wait behind the unsent bytes.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
    assert up.closed.wait(1.0), "the engine must see its connection close within a second"
    assert wait_until(lambda: not proxy.ctx.in_flight, timeout=2)


def test_response_to_client_that_stops_reading_applies_backpressure(scripted_upstream, start_proxy):
    total = 50 * 1024 * 1024
    written = {"bytes": 0}

    async def big(reader, writer, upstream):
        await reader.read_request()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        block = bytes(range(256)) * 256
        while written["bytes"] < total:
            writer.write(block)
            await writer.drain()
            written["bytes"] += len(block)

    proxy = start_proxy(scripted_upstream(big).url)
    client = RawClient(proxy.port)
    client.request("GET", "/big")
    time.sleep(1.0)  # the client reads nothing: the upstream must be held back
    held_back_at = written["bytes"]
    assert held_back_at < 24 * 1024 * 1024, "proxy buffered instead of pausing the upstream"
    resp = client.response()
    assert resp.complete and len(resp.body) == total
    assert resp.body == (bytes(range(256)) * 256) * (total // 65536)


def _client_write_buffer(proxy) -> int:
    connections = list(proxy.ctx.connections)
    return connections[0].transport.get_write_buffer_size() if connections else 0


def _fills_the_client_buffer_with_its_last_write(proxy_box: dict):
    """An upstream handler: a chunked response sent in pieces until the proxy holds
    some bytes for the client (below the pause mark), then a last piece and the end
    in one read, so that the proxy's final write is the one that pauses the client."""
    async def send(reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = b"a" * 16384
        for _ in range(2000):  # bounded: a client reading nothing fills up within a few
            if _client_write_buffer(proxy_box["proxy"]) >= 16384:
                break
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0.002)
        last = b"z" * 56 * 1024
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(last), last))
        await writer.drain()
    return send


def _client_reading_nothing(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    return sock


def test_a_pipelined_request_waits_while_the_client_has_not_taken_the_response_before_it(
        scripted_upstream, start_proxy):
    """The response before it ended with the write that filled the client's buffer:
    the next request must not start (and be read from the upstream into memory)
    until the client takes that tail."""
    second_total = 40 * 1024 * 1024
    state, box = {"second_bytes": 0, "second_asked": False}, {}
    send_first = _fills_the_client_buffer_with_its_last_write(box)

    async def handler(reader, writer, upstream):
        await reader.read_request()
        await send_first(reader, writer)
        await reader.read_request()
        state["second_asked"] = True
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % second_total)
        block = b"b" * 65536
        deadline = time.monotonic() + 5
        while state["second_bytes"] < second_total and time.monotonic() < deadline:
            writer.write(block)
            await writer.drain()
            state["second_bytes"] += len(block)
        await reader.read(1)

    proxy = box["proxy"] = start_proxy(scripted_upstream(handler).url)
    with _client_reading_nothing(proxy.port) as sock:
        sock.sendall(b"GET /one HTTP/1.1\r\nHost: a\r\n\r\nGET /two HTTP/1.1\r\nHost: a\r\n\r\n")
        time.sleep(2.0)  # the client reads nothing
        assert not state["second_asked"], "the second request went upstream before the first response was taken"
        assert state["second_bytes"] < 24 * 1024 * 1024


def test_a_client_leaving_with_the_last_bytes_untaken_is_a_disconnect(scripted_upstream, start_proxy):
    done, box = [], {}
    send = _fills_the_client_buffer_with_its_last_write(box)

    class Outcomes:
        def on_done(self, record):
            done.append(record.outcome.code)

    async def handler(reader, writer, upstream):
        await reader.read_request()
        await send(reader, writer)
        await reader.read(1)

    proxy = box["proxy"] = start_proxy(scripted_upstream(handler).url, observers=[Outcomes()])
    sock = _client_reading_nothing(proxy.port)
    sock.sendall(b"GET /one HTTP/1.1\r\nHost: a\r\n\r\n")
    time.sleep(1.5)  # reads nothing ...
    assert _client_write_buffer(proxy) > 0 and not done, "the request ended before the client took its tail"
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # ... and goes away
    assert wait_until(lambda: done, timeout=3)
    assert done == ["DC"]


def test_error_before_the_body_arrived_drains_it_and_keeps_the_connection(start_proxy, dead_upstream):
    proxy = start_proxy(dead_upstream)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 20\r\n\r\n")
        reply = sock.recv(65536)  # the 502 comes before the body was sent
        assert reply.startswith(b"HTTP/1.1 502 ") and header_value(reply, b"connection") is None
        sock.sendall(b"x" * 20)  # drained, not mistaken for the next request
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: a\r\n\r\n")
        second = sock.recv(65536)
        assert second.startswith(b"HTTP/1.1 502 ") and b'"UF"' in second


def _sse_upstream(events: bytes):
    async def handler(reader, writer, upstream):
        await reader.read_request()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"%x\r\n%s\r\n0\r\n\r\n" % (len(events), events))
        await writer.drain()
        await reader.read(1)

    return handler


class _Done:
    def __init__(self):
        self.records = []

    def on_done(self, record):
        self.records.append(record)


def test_sse_stream_without_done_or_finish_reason_is_ndn(scripted_upstream, start_proxy):
    done = _Done()
    events = b'data: {"choices": [{"delta": {"content": "a"}, "finish_reason": null}]}\n\n'
    proxy = start_proxy(scripted_upstream(_sse_upstream(events)).url, observers=[done])
    resp = RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", body=b"{}")
    assert resp.complete and resp.body == events  # bytes untouched: the verdict is ours, not the client's
    assert wait_until(lambda: done.records)
    assert done.records[0].outcome.code == "NDN" and done.records[0].outcome.blame.value == "engine"


@pytest.mark.parametrize("events", [
    b'data: {"choices": [{"delta": {}, "finish_reason": "stop"}]}\n\n',
    b'data: {"choices": [{"delta": {"content": "hi"}, "finish_reason": null}]}\n\ndata: [DONE]\n\n',
], ids=["finish-reason", "done"])
def test_sse_stream_with_a_finish_reason_or_done_is_ok(scripted_upstream, start_proxy, events):
    done = _Done()
    proxy = start_proxy(scripted_upstream(_sse_upstream(events)).url, observers=[done])
    assert RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", body=b"{}").complete
    assert wait_until(lambda: done.records) and done.records[0].outcome.code == "OK"
