"""Strict, safe parsing of client input: nothing ambiguous is ever forwarded, the
client gets a 4xx with a reason and the connection is closed, and the proxy keeps
serving everyone else."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest

from .support import RawClient, header_value, never_answers, raw_exchange, recv_until, wait_until

GOOD = b"GET /health HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"

# (id, raw request, expected status)
BAD_REQUESTS = [
    ("cl-and-te", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    ("te-and-cl", b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n", 400),
    ("conflicting-cl", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!", 400),
    # Identical duplicates are refused as well (llhttp refuses them before our own
    # checks, which would accept them): RFC 9112 allows either, and refusing is safer.
    ("cl-duplicate-same-value", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello", 400),
    ("cl-list-same-value", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 5\r\n\r\nhello", 400),
    ("cl-list-conflict", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 6\r\n\r\nhello!", 400),
    ("cl-not-a-number", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5x\r\n\r\nhello", 400),
    ("cl-negative", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n", 400),
    # Past a signed 64-bit integer (nginx's limit too): an upstream could read another length.
    ("cl-past-int64", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 9223372036854775808\r\n\r\n", 400),
    ("cl-max-uint64", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 18446744073709551615\r\n\r\n", 400),
    ("te-gzip", b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n", 400),
    ("te-chunked-not-last", b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, gzip\r\n\r\n", 400),
    ("te-double-chunked", b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, chunked\r\n\r\n0\r\n\r\n", 400),
    ("te-obfuscated-x", b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n", 400),
    ("te-obfuscated-space-before-colon", b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n", 400),
    ("te-obfuscated-vertical-tab", b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding:\x0bchunked\r\n\r\n0\r\n\r\n", 400),
    ("te-on-http10", b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    ("bad-chunk-size", b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n", 400),
    ("chunk-size-overflow", b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\nx\r\n", 400),
    ("control-char-in-value", b"GET / HTTP/1.1\r\nHost: a\r\nX-Bad: a\x01b\r\n\r\n", 400),
    ("nul-in-value", b"GET / HTTP/1.1\r\nHost: a\r\nX-Bad: a\x00b\r\n\r\n", 400),
    ("control-char-in-name", b"GET / HTTP/1.1\r\nHost: a\r\nX\x01Bad: v\r\n\r\n", 400),
    ("line-without-colon", b"GET / HTTP/1.1\r\nHost: a\r\nNoColonHere\r\n\r\n", 400),
    ("bare-lf-in-header", b"GET / HTTP/1.1\r\nHost: a\r\nX-A: 1\nX-B: 2\r\n\r\n", 400),
    ("obs-fold", b"GET / HTTP/1.1\r\nHost: a\r\nX-A: 1\r\n folded\r\n\r\n", 400),
    ("missing-host-http11", b"GET / HTTP/1.1\r\nX-A: 1\r\n\r\n", 400),
    ("two-hosts", b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    ("garbage", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400),
    ("bad-version", b"GET / HTTP/9.9\r\nHost: a\r\n\r\n", 400),
    ("http2-version", b"GET / HTTP/2.0\r\nHost: a\r\n\r\n", 505),
    ("http09-version", b"GET / HTTP/0.9\r\nHost: a\r\n\r\n", 505),
    ("no-version", b"GET /\r\n\r\n", 505),
    ("http2-preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),
    # llhttp also reads RTSP and ICE request lines, and gives their versions as HTTP's.
    ("rtsp-protocol", b"POST /v1/chat/completions RTSP/1.0\r\nHost: a\r\nContent-Length: 0\r\n\r\n", 400),
    ("rtsp-method-and-protocol", b"DESCRIBE /v1/models RTSP/1.0\r\nHost: a\r\n\r\n", 400),
    ("ice-protocol", b"SOURCE /v1/models ICE/1.0\r\nHost: a\r\n\r\n", 400),
    ("rtsp-after-empty-lines", b"\r\n\r\nGET /v1/models RTSP/1.0\r\nHost: a\r\n\r\n", 400),
    ("host-with-space-and-path", b"GET / HTTP/1.1\r\nHost: a b/c@evil\r\n\r\n", 400),
    ("host-with-path", b"GET / HTTP/1.1\r\nHost: good.example/../@evil.example\r\n\r\n", 400),
    ("host-with-userinfo", b"GET / HTTP/1.1\r\nHost: user@good.example\r\n\r\n", 400),
    ("absolute-form-with-userinfo", b"GET http://user@good.example/ HTTP/1.1\r\nHost: a\r\n\r\n", 400),
    ("absolute-form-without-host", b"GET http:///path HTTP/1.1\r\nHost: a\r\n\r\n", 400),
    ("connect", b"CONNECT good.example:443 HTTP/1.1\r\nHost: good.example:443\r\n\r\n", 501),
    ("unsupported-expect", b"POST / HTTP/1.1\r\nHost: a\r\nExpect: teapot\r\nContent-Length: 0\r\n\r\n", 417),
    # Every Expect line counts, whichever comes last.
    ("unsupported-expect-after-100-continue",
     b"POST / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nExpect: teapot\r\nContent-Length: 1\r\n\r\n", 417),
    ("unsupported-expect-before-100-continue",
     b"POST / HTTP/1.1\r\nHost: a\r\nExpect: teapot\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n", 417),
    ("websocket-upgrade", b"GET /ws HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n", 501),
    # A method llhttp cannot carry is not implemented here (RFC 9110 section 9.1);
    # bytes that are not a method at all are a bad request.
    ("unknown-method", b"FROB /v1/models HTTP/1.1\r\nHost: a\r\n\r\n", 501),
    ("method-not-a-token", b"G(T /v1/models HTTP/1.1\r\nHost: a\r\n\r\n", 400),
    ("asterisk-form-not-options", b"GET * HTTP/1.1\r\nHost: a\r\n\r\n", 400),
    ("absolute-form-other-scheme", b"GET ftp://good.example/x HTTP/1.1\r\nHost: a\r\n\r\n", 400),
]


@pytest.mark.parametrize("raw,status", [(r, s) for _, r, s in BAD_REQUESTS], ids=[i for i, _, _ in BAD_REQUESTS])
def test_bad_request_rejected_closed_and_never_forwarded(fast_upstream, start_proxy, raw, status):
    up = fast_upstream()
    proxy = start_proxy(up.url)
    reply = raw_exchange(proxy.port, raw)  # returns once the proxy closed the connection
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), reply
    assert header_value(head, b"connection") == b"close"
    assert header_value(head, b"x-traceproxy-outcome") == b"DPE"
    error = json.loads(body)["error"]
    assert error["code"] == "DPE" and error["message"]
    assert up.requests == 0  # nothing ambiguous reached the upstream
    assert raw_exchange(proxy.port, GOOD).startswith(b"HTTP/1.1 200")  # still serving


def test_oversized_head_gets_431(fast_upstream, start_proxy):
    up = fast_upstream()
    proxy = start_proxy(up.url, **{"limits.max_header_bytes": 4096})
    raw = b"GET / HTTP/1.1\r\nHost: a\r\n" + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"v" * 100) for i in range(60)) + b"\r\n"
    assert raw_exchange(proxy.port, raw).startswith(b"HTTP/1.1 431 ")
    assert up.requests == 0


def test_head_over_the_limit_only_with_its_last_read_gets_431(fast_upstream, start_proxy):
    # Each read is under the limit; the read that completes the head takes it over.
    up = fast_upstream()
    proxy = start_proxy(up.url, **{"limits.max_header_bytes": 4096})
    lines = [b"X-Pad-%d: %s\r\n" % (i, b"v" * 100) for i in range(50)]
    first = b"GET / HTTP/1.1\r\nHost: a\r\n" + b"".join(lines[:25])
    second = b"".join(lines[25:]) + b"\r\n"
    assert len(first) < 4096 and len(second) < 4096
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(first)
        assert wait_until(lambda: proxy.ctx.in_flight)  # the first read was parsed on its own
        sock.sendall(second)
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 431 ")
    assert up.requests == 0


def test_endless_header_value_cut_off_with_431(fast_upstream, start_proxy):
    proxy = start_proxy(fast_upstream().url, **{"limits.max_header_bytes": 4096})
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: a\r\nX-Endless: ")
        for _ in range(64):  # never ends the header; the proxy must stop us
            try:
                sock.sendall(b"v" * 1024)
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.002)  # separate reads, as a slow sender's arrive
        try:
            reply = recv_until(sock, b"}")
        except ConnectionResetError:
            reply = b""
    # The refusal itself, not just a closed connection: the client is told why.
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), reply
    assert b"request head exceeds 4096 bytes" in body


def test_endless_trailer_value_cut_off_with_431(scripted_upstream, start_proxy):
    # The trailer section comes after the head was checked; httptools gathers its
    # values just the same, so it is held to the same limit.
    proxy = start_proxy(scripted_upstream(never_answers).url, **{"limits.max_header_bytes": 1024})
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nX-Trailer: ")
        assert wait_until(lambda: proxy.ctx.in_flight)
        for _ in range(64):  # never ends the trailer; the proxy must stop us
            try:
                sock.sendall(b"v" * 512)
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.002)  # separate reads
        try:
            reply = recv_until(sock, b"}")
        except ConnectionResetError:
            reply = b""
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), reply
    assert b"trailers exceed 1024 bytes" in body
    assert wait_until(lambda: not proxy.ctx.in_flight)


def test_trailers_over_the_limit_in_the_read_that_ends_the_body_get_431(fast_upstream, start_proxy):
    # The whole trailer section in one read: llhttp hands its fields over as header lines.
    proxy = start_proxy(fast_upstream().url, **{"limits.max_header_bytes": 1024})
    trailers = b"".join(b"X-T%d: %s\r\n" % (i, b"v" * 100) for i in range(30))
    reply = raw_exchange(proxy.port, b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
                                     b"3\r\nabc\r\n0\r\n" + trailers + b"\r\n")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), reply
    assert b"trailers exceed 1024 bytes" in body
    assert wait_until(lambda: not proxy.ctx.in_flight)


def test_chunked_body_of_many_small_chunks_is_not_mistaken_for_long_trailers(fast_upstream, start_proxy):
    proxy = start_proxy(fast_upstream().url, **{"limits.max_header_bytes": 1024})
    data = bytes(97 + i % 26 for i in range(2000))
    chunks = b"".join(b"1;ext=%d\r\n%c\r\n" % (i, byte) for i, byte in enumerate(data))
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: a\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + chunks + b"0\r\nX-Trailer: 1\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200 ") and data in reply


def test_whitespace_padding_counts_toward_the_head_limit(fast_upstream, start_proxy):
    # llhttp strips the whitespace around values; the limit is on the bytes sent.
    up = fast_upstream()
    proxy = start_proxy(up.url, **{"limits.max_header_bytes": 1024})
    raw = (b"GET / HTTP/1.1\r\nHost: a\r\n" + b"".join(b"X-%d:%sv\r\n" % (i, b" " * 500) for i in range(20))
           + b"\r\n")
    assert raw_exchange(proxy.port, raw).startswith(b"HTTP/1.1 431 ")
    assert up.requests == 0


def test_a_body_before_a_pipelined_head_is_not_counted_as_head(fast_upstream, start_proxy):
    # One read holds a whole POST with a body larger than the head limit and the start
    # of the next request's head; the rest of that head comes in a later read.
    proxy = start_proxy(fast_upstream().url, **{"limits.max_header_bytes": 1024})
    body = b"x" * 20_000
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                     + b"GET /heal")
        time.sleep(0.2)
        sock.sendall(b"th HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.count(b"HTTP/1.1 200 ") == 2 and b" 431 " not in reply


def _statuses_until_closed(sock: socket.socket) -> list[bytes]:
    """The status codes of every response on ``sock``, read until the proxy closes it."""
    reply = b""
    for _ in range(100):  # bounded: a few short responses
        chunk = sock.recv(65536)
        if not chunk:
            break
        reply += chunk
    return re.findall(rb"HTTP/1\.1 (\d{3}) ", reply)  # an echoed body ends without CRLF


def test_a_head_begun_behind_another_request_in_a_read_is_held_to_the_limit(fast_upstream, start_proxy):
    # The first read ends a whole request and begins an oversized head; the rest of it,
    # itself well under the limit, comes in a later read.
    up = fast_upstream()
    proxy = start_proxy(up.url, **{"limits.max_header_bytes": 4096})
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: a\r\n\r\nGET /big HTTP/1.1\r\nHost: a\r\nX-Big: " + b"v" * 3000)
        assert wait_until(lambda: up.requests == 1)
        time.sleep(0.2)
        sock.sendall(b"v" * 3000 + b"\r\nConnection: close\r\n\r\n")
        assert _statuses_until_closed(sock) == [b"200", b"431"]
    assert up.requests == 1


def test_oversized_target_gets_414(fast_upstream, start_proxy):
    up = fast_upstream()
    proxy = start_proxy(up.url, **{"limits.max_target_bytes": 256})
    raw = b"GET /" + b"a" * 300 + b" HTTP/1.1\r\nHost: a\r\n\r\n"
    assert raw_exchange(proxy.port, raw).startswith(b"HTTP/1.1 414 ")
    assert up.requests == 0


def test_slow_header_sender_gets_408(fast_upstream, start_proxy):
    proxy = start_proxy(fast_upstream().url, **{"timeouts.client_headers": 0.3})
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: a\r\n")
        reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 408 ")
        assert b'"DHT"' in reply
        assert sock.recv(65536) == b""  # and closed


def test_slow_head_of_a_second_keepalive_request_gets_408(fast_upstream, start_proxy):
    # The head timer is armed only when a head does not arrive whole: a partial
    # head after a complete exchange must still run against it.
    proxy = start_proxy(fast_upstream().url, **{"timeouts.client_headers": 0.3})
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n")
        assert recv_until(sock, b"\r\n\r\n").startswith(b"HTTP/1.1 200 ")
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: a\r\n")
        assert b"HTTP/1.1 408 " in recv_until(sock, b'"DHT"')
        assert time.monotonic() - started < 3


def test_silent_new_connection_closed_after_header_timeout(fast_upstream, start_proxy):
    proxy = start_proxy(fast_upstream().url, **{"timeouts.client_headers": 0.3})
    client = RawClient(proxy.port)
    started = time.monotonic()
    assert client.is_closed_by_peer(wait=3)
    assert time.monotonic() - started < 3


def test_bad_request_behind_a_good_pipelined_one_is_answered_after_it(fast_upstream, start_proxy):
    up = fast_upstream()
    proxy = start_proxy(up.url)
    raw = GOOD.replace(b"Connection: close\r\n", b"") + b"GET / HTTP/1.1\r\nHost: a\r\nBad Header\r\n\r\n"
    reply = raw_exchange(proxy.port, raw)
    first, _, rest = reply.partition(b"HTTP/1.1 400 ")
    assert first.startswith(b"HTTP/1.1 200 ") and rest
    assert up.requests == 1


KEEP = GOOD.replace(b"Connection: close\r\n", b"")
RTSP = b"GET /health RTSP/1.0\r\nHost: a\r\n\r\n"


@pytest.mark.parametrize("before", [
    KEEP,  # where its head begins is found from the one before it
    KEEP + KEEP,  # the third in a read: where its head begins is not known
    b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",  # nor here
], ids=["second-in-a-read", "third-in-a-read", "behind-a-chunked-body"])
def test_a_pipelined_request_of_another_protocol_is_refused_in_turn(fast_upstream, start_proxy, before):
    up = fast_upstream()
    proxy = start_proxy(up.url)
    reply = raw_exchange(proxy.port, before + RTSP)
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", reply)  # an echoed body ends without CRLF
    answered = before.count(b"HTTP/1.1\r\n")
    assert statuses == [b"200"] * answered + [b"400"], reply
    assert b"not an HTTP request line: protocol 'RTSP/1.0'" in reply
    assert up.requests == answered


@pytest.mark.parametrize("cut", [8, 20, 30, 60])
def test_a_long_request_line_split_across_reads_is_proxied(fast_upstream, start_proxy, cut):
    up = fast_upstream()
    proxy = start_proxy(up.url)
    raw = b"GET /health?padding=" + b"m" * 40 + b" HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(raw[:cut])
        assert wait_until(lambda: proxy.ctx.in_flight)  # the first read was parsed on its own
        sock.sendall(raw[cut:])
        reply = recv_until(sock, b"\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200 "), reply
    assert up.requests == 1


def test_the_words_of_a_request_line_in_an_earlier_body_do_not_refuse_the_next_request(fast_upstream, start_proxy):
    # Behind a chunked body the next head's start is not known: the protocol check
    # looks at every "GET /health " in the read, one of them in that body.
    body = b'{"note": "GET /health to me"}'
    chunked = (b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    up = fast_upstream()
    reply = raw_exchange(start_proxy(up.url).port, chunked + GOOD)
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", reply) == [b"200", b"200"], reply
    assert up.requests == 2


def test_a_request_line_of_another_protocol_split_across_reads_is_refused(fast_upstream, start_proxy):
    up = fast_upstream()
    proxy = start_proxy(up.url)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(RTSP[:16])  # "GET /health RTSP"
        assert wait_until(lambda: proxy.ctx.in_flight)  # the first read was parsed on its own
        sock.sendall(RTSP[16:])
        reply = recv_until(sock, b"}")
    assert reply.startswith(b"HTTP/1.1 400 ") and b"protocol 'RTSP/1.0'" in reply
    assert up.requests == 0


def test_bad_chunk_in_a_pipelined_request_body_is_answered_in_turn(fast_upstream, start_proxy):
    up = fast_upstream()
    proxy = start_proxy(up.url)
    raw = (GOOD.replace(b"Connection: close\r\n", b"")
           + b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\nzz\r\n")
    reply = raw_exchange(proxy.port, raw, timeout=5)
    first, _, rest = reply.partition(b"HTTP/1.1 400 ")
    assert first.startswith(b"HTTP/1.1 200 ") and b'"DPE"' in rest
    assert up.requests == 1
    assert not proxy.ctx.in_flight


def test_bad_chunk_in_the_active_request_body_fails_it_at_once(scripted_upstream, start_proxy):
    async def reads_forever(reader, writer, upstream):
        await reader.read(1 << 20)
        await reader.read(1 << 20)

    proxy = start_proxy(scripted_upstream(reads_forever).url)
    started = time.monotonic()
    reply = raw_exchange(proxy.port, b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
                                     b"3\r\nabc\r\nzz\r\n", timeout=5)
    assert reply.startswith(b"HTTP/1.1 400 ") and b'"DPE"' in reply
    assert time.monotonic() - started < 1.5  # closed at once, no lingering on a dead parser


def test_whitespace_padding_counts_toward_the_head_limit_across_reads(fast_upstream, start_proxy):
    up = fast_upstream()
    proxy = start_proxy(up.url, **{"limits.max_header_bytes": 1024})
    padded = b"".join(b"X-%d:%sv\r\n" % (i, b" " * 500) for i in range(20)) + b"\r\n"
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n")
        assert wait_until(lambda: proxy.ctx.in_flight)  # the first read was parsed on its own
        sock.sendall(padded)
        reply = recv_until(sock, b"\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 431 ")
    assert up.requests == 0


@pytest.mark.parametrize("before", [1, 2], ids=["second-in-the-read", "third-in-the-read"])
@pytest.mark.parametrize("split", [False, True], ids=["in-one-read", "ending-in-a-later-read"])
def test_whitespace_padding_of_a_pipelined_head_counts_toward_the_limit(fast_upstream, start_proxy, split, before):
    # llhttp strips the padding, so only the bytes on the wire show it: each head's
    # start is found right after the request before it, down the read.
    up = fast_upstream()
    proxy = start_proxy(up.url, **{"limits.max_header_bytes": 2048})
    padded = b"GET /health HTTP/1.1\r\nHost: a\r\nX-Pad:" + b" " * 3000 + b"v\r\nConnection: close\r\n\r\n"
    first = b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello" * before + padded
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        if split:
            sock.sendall(first[:-40])
            assert wait_until(lambda: up.requests == before)
            time.sleep(0.1)
            sock.sendall(first[-40:])
        else:
            sock.sendall(first)
        assert _statuses_until_closed(sock) == [b"200"] * before + [b"431"]
    assert up.requests == before


def _head_of(size: int) -> bytes:
    """A GET /health head of exactly ``size`` bytes that closes the connection."""
    start, end = b"GET /health HTTP/1.1\r\nHost: a\r\nX-Pad: ", b"\r\nConnection: close\r\n\r\n"
    return start + b"v" * (size - len(start) - len(end)) + end


@pytest.mark.parametrize("before, size, refused", [
    (b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n\r\n", 2048, False),  # an empty line between: not head
    (b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n\r\n\r\n", 30_000, True),  # nor the end of the next one
    (b"\r\n\r\n", 30_000, True),  # before the read's only request
    # before the read's first request, which must not be taken for that head's end
    (b"\r\n\r\nGET /health HTTP/1.1\r\nHost: a\r\n\r\n", 3000, True),
    (b"\r\n\r\nPOST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 600\r\n\r\n" + b"b" * 600, 2048, False),
], ids=["at-the-limit-after-an-empty-line", "over-after-two-empty-lines", "over-after-leading-empty-lines",
        "over-behind-a-request-after-empty-lines", "at-the-limit-behind-a-body-after-empty-lines"])
def test_empty_lines_before_a_request_line_are_skipped_not_counted(fast_upstream, start_proxy, before, size,
                                                                   refused):
    proxy = start_proxy(fast_upstream().url, **{"limits.max_header_bytes": 2048})
    reply = raw_exchange(proxy.port, before + _head_of(size))
    statuses = [line.split(b" ")[1] for line in reply.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]
    assert statuses[-1] == (b"431" if refused else b"200"), reply[-300:]


def test_a_refused_head_request_gets_no_body_even_when_its_target_is_too_long(fast_upstream, start_proxy):
    proxy = start_proxy(fast_upstream().url, **{"limits.max_target_bytes": 256})
    reply = raw_exchange(proxy.port, b"HEAD /" + b"x" * 300 + b" HTTP/1.1\r\nHost: a\r\n\r\n")
    head, sep, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 414 ") and sep and body == b""


def test_options_asterisk_is_forwarded_as_is(scripted_upstream, start_proxy):
    async def answers(reader, writer, upstream):
        await reader.read_request()
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()

    up = scripted_upstream(answers)
    proxy = start_proxy(up.url)
    reply = raw_exchange(proxy.port, b"OPTIONS * HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 204 ")
    assert wait_until(lambda: up.received and up.received[0].startswith(b"OPTIONS * HTTP/1.1\r\n"))


@pytest.mark.parametrize("host_line", [b"Host: a \r\n", b"Host: a\t\r\n", b"Host: a:80  \r\n"])
def test_whitespace_after_the_host_value_is_not_part_of_it(fast_upstream, start_proxy, host_line):
    # RFC 9112 section 5; llhttp strips the whitespace before a value, not after it.
    proxy = start_proxy(fast_upstream().url)
    reply = raw_exchange(proxy.port, b"GET /health HTTP/1.1\r\n" + host_line + b"Connection: close\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:300]


# A request line without a version is HTTP/0.9's, which has no headers: llhttp reads on
# for them, so "GET /\r\n" alone would wait for the header timeout. It is refused where
# the line ends. Each case: the reads sent, one at a time, and nothing after them.
VERSIONLESS_LINES = [
    ("line-alone", [b"GET /health\r\n"]),
    ("bare-lf", [b"GET /health\n"]),
    ("after-empty-lines", [b"\r\n\r\nGET /health\r\n"]),
    ("with-a-header-line", [b"GET /health\r\nHost: a\r\n"]),
    ("line-end-in-a-later-read", [b"GET /health", b"\r\n"]),
    ("lf-in-a-later-read", [b"GET /health\r", b"\n"]),
    ("line-in-three-reads", [b"GET /hea", b"lth", b"\r\nHost: a\r\n"]),
]


@pytest.mark.parametrize("reads", [r for _, r in VERSIONLESS_LINES], ids=[i for i, _ in VERSIONLESS_LINES])
def test_a_request_line_without_a_version_is_refused_where_it_ends(fast_upstream, start_proxy, reads):
    up = fast_upstream()
    proxy = start_proxy(up.url)  # the header timeout is 30 s: the refusal must not wait for it
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=3) as sock:
        for index, read in enumerate(reads):
            if index:
                assert wait_until(lambda: proxy.ctx.in_flight)  # the reads before were parsed on their own
            sock.sendall(read)
        reply = recv_until(sock, b"}")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 505 "), reply
    assert header_value(head, b"x-traceproxy-outcome") == b"DPE"
    assert b"HTTP/0.9 is not supported" in body
    assert up.requests == 0


def test_a_pipelined_request_line_without_a_version_is_refused_in_turn(fast_upstream, start_proxy):
    up = fast_upstream()
    proxy = start_proxy(up.url)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=3) as sock:
        sock.sendall(KEEP + b"GET /health\r\n")
        assert _statuses_until_closed(sock) == [b"200", b"505"]
    assert up.requests == 1


def test_a_valid_request_split_at_any_byte_is_never_refused(fast_upstream, start_proxy):
    # The versionless check decides only once the request line has ended: a line cut
    # anywhere (before HTTP/, inside it, between CR and LF) is waited for. Each cut is
    # tried as a request of its own, and as one begun behind a whole request in one read.
    up = fast_upstream()
    proxy = start_proxy(up.url)
    good = b"\r\n" + GOOD  # an empty line before a request line is skipped, not a line
    for cut in range(3, len(good)):  # from the method's first byte on: a request has begun
        for before in (b"", KEEP):
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=3) as sock:
                sock.sendall(before + good[:cut])
                assert wait_until(lambda: len(proxy.ctx.in_flight) == 1 and up.requests >= bool(before))
                sock.sendall(good[cut:])
                statuses = _statuses_until_closed(sock)
            assert statuses == [b"200"] * (1 + bool(before)), (cut, before)
