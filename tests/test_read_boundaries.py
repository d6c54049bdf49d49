"""Where a read ends must not change what the proxy does.

Each test sends one message cut into reads at every byte offset (and one byte per
read), on fake transports (see fake_transport.py), and checks that the upstream is
sent the same bytes, the client gets the same response, and the request ends the
same way as when the message comes in one read. These are the paths that count a
head, a chunk size or a trailer section spanning reads, which real sockets reach
only when TCP happens not to merge the writes.

Values the proxy makes up per request (span ids, a generated request id) are masked
before bytes are compared.
"""

from __future__ import annotations

import pytest

from .fake_transport import ProxyHarness, byte_by_byte, cut_offsets, dechunk, head_and_rest, masked, splits_in_two

HEAD_LIMIT = 1024  # limits.max_header_bytes in the limit tests (its minimum)

OK_2 = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def forwarded(request_line: bytes, *lines: bytes, framing: bytes = b"") -> bytes:
    """The head the proxy sends upstream for a request with ``Host: a.test``, header
    ``lines`` and the body framing line ``framing`` (which it writes last)."""
    return (request_line + b"\r\nHost: a.test\r\n" + b"".join(line + b"\r\n" for line in lines)
            + b"X-Forwarded-For: 192.0.2.10\r\nX-Forwarded-Proto: http\r\nX-Forwarded-Host: a.test\r\n"
            + b"traceparent: <minted>\r\nx-request-id: <minted>\r\n" + (framing + b"\r\n" if framing else b"")
            + b"\r\n")


def answered(body: bytes, *lines: bytes) -> bytes:
    """What the client gets for the upstream's ``200 OK`` with Content-Length and ``body``."""
    return (b"HTTP/1.1 200 OK\r\n" + b"".join(line + b"\r\n" for line in lines)
            + b"x-request-id: <minted>\r\ntraceresponse: <minted>\r\n"
            + b"Content-Length: %d\r\nKeep-Alive: timeout=75\r\n\r\n" % len(body) + body)


def one_or_two_reads(message: bytes) -> list[tuple[bytes, ...]]:
    """``message`` in one read, and in two at every offset (see cut_offsets)."""
    return [(message,), *splits_in_two(message)]


def read_plans(message: bytes) -> list[tuple[bytes, ...]]:
    """``one_or_two_reads``, and one byte per read."""
    return [*one_or_two_reads(message), tuple(byte_by_byte(message))]


def plan_id(plan: tuple[bytes, ...]) -> str:
    return f"{len(plan)} reads, first {len(plan[0])} bytes"


def each_plan(message: bytes, check, plans=read_plans) -> None:
    """``check(reads)`` for every read plan of ``message``; on failure, names the plan."""
    for reads in plans(message):
        try:
            check(reads)
        except AssertionError as failure:
            raise AssertionError(f"{plan_id(reads)}: {failure}") from failure


# ----------------------------------------------------------------------------------
# Request heads
# ----------------------------------------------------------------------------------
GET = b"GET /v1/models?x=1 HTTP/1.1\r\nHost: a.test\r\nUser-Agent: t\r\nAccept: */*\r\n\r\n"


def test_a_request_head_cut_anywhere_is_forwarded_and_answered_the_same():
    def check(reads):
        with ProxyHarness() as h:
            h.client_sends(*reads)
            assert masked(h.upstream().written) == forwarded(b"GET /v1/models?x=1 HTTP/1.1", b"User-Agent: t",
                                                             b"Accept: */*")
            h.upstream_sends(OK_2)
            assert masked(h.client.written) == answered(b"ok")
            assert h.outcomes == [("/v1/models?x=1", "OK", 200)]
            assert "close" not in h.client.calls and "abort" not in h.client.calls

    each_plan(GET, check)


def test_a_request_with_a_length_body_cut_anywhere_sends_the_same_bytes_upstream():
    message = b"POST /v1/chat HTTP/1.1\r\nHost: a.test\r\nContent-Length: 11\r\n\r\nhello world"

    def check(reads):
        with ProxyHarness() as h:
            h.client_sends(*reads)
            assert masked(h.upstream().written) == forwarded(b"POST /v1/chat HTTP/1.1", framing=b"Content-Length: 11") \
                + b"hello world"
            h.upstream_sends(OK_2)
            assert masked(h.client.written) == answered(b"ok")
            assert h.outcomes == [("/v1/chat", "OK", 200)]

    each_plan(message, check)


def test_a_head_behind_empty_lines_cut_anywhere_is_forwarded_without_them():
    # RFC 9112 section 2.2: empty lines before a request line are skipped; their
    # CRLFs are not a head's end, and not part of the head that is counted.
    def check(reads):
        with ProxyHarness() as h:
            h.client_sends(*reads)
            assert masked(h.upstream().written) == forwarded(b"GET /v1/models?x=1 HTTP/1.1", b"User-Agent: t",
                                                             b"Accept: */*")
            h.upstream_sends(OK_2)
            assert h.outcomes == [("/v1/models?x=1", "OK", 200)]

    each_plan(b"\r\n\r\n" + GET, check)


# ----------------------------------------------------------------------------------
# Chunked request bodies and trailers
# ----------------------------------------------------------------------------------
CHUNKED_HEAD = b"POST /v1/chat HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n"
CHUNKED_BODY = b"1A;ext=v\r\nabcdefghijklmnopqrstuvwxyz\r\n5\r\nhello\r\n0\r\n"


def check_chunked_request(reads) -> None:
    with ProxyHarness() as h:
        h.client_sends(*reads)
        head, body = head_and_rest(bytes(h.upstream().written))
        assert masked(head) == forwarded(b"POST /v1/chat HTTP/1.1", framing=b"Transfer-Encoding: chunked")
        # The proxy frames each piece of body data it reads as a chunk of its own,
        # so the framing changes with the reads; what it carries must not.
        data, trailers, after = dechunk(body)
        assert (data, trailers, after) == (b"abcdefghijklmnopqrstuvwxyz" + b"hello", b"", b"")
        assert body.endswith(b"\r\n0\r\n\r\n")  # no empty chunk before the end (it would end the body)
        h.upstream_sends(OK_2)
        assert masked(h.client.written) == answered(b"ok")
        assert h.outcomes == [("/v1/chat", "OK", 200)]


def test_a_chunked_request_body_cut_anywhere_carries_the_same_data():
    # Cuts inside a two-digit chunk size ("1" | "A"), between a size line's CR and LF,
    # inside an extension, and inside the CRLF after a chunk's data.
    each_plan(CHUNKED_HEAD + CHUNKED_BODY + b"\r\n", check_chunked_request)


def test_request_trailers_cut_anywhere_are_dropped_and_the_body_ends():
    # Today's behaviour: the proxy does not forward request trailers; it ends the
    # body with its own last chunk, "0" CRLF CRLF.
    trailers = b"X-Checksum: abc123\r\nX-Tokens: 42\r\n"
    each_plan(CHUNKED_HEAD + CHUNKED_BODY + trailers + b"\r\n", check_chunked_request)


def trailer_section(size: int) -> bytes:
    """Trailer field lines of ``size`` bytes, CRLFs included (the empty line after them not)."""
    return b"X-Pad: " + b"t" * (size - 9) + b"\r\n"


def trailed(head: bytes, trailers: bytes) -> bytes:
    return head + b"5\r\nhello\r\n0\r\n" + trailers + b"\r\n"


def section_plans(message: bytes) -> list[tuple[bytes, ...]]:
    """``read_plans``, and three reads: the middle one from a cut in the framing before
    the trailer section (after the last body data, inside the last chunk's line) to
    each cut after it (see cut_offsets), among them the section with the first byte of
    the empty line that ends it."""
    section_start = message.index(b"\r\n0") + 5
    firsts = [message.index(b"hello") + 5, section_start - 3, section_start - 2, section_start]
    return [*read_plans(message), *((message[:a], message[a:b], message[b:])
                                    for a in firsts for b in cut_offsets(message) if b > a)]


def test_request_trailers_at_the_limit_are_accepted_however_they_are_cut():
    # Only the trailer field lines count: not the CRLF after the last data, nor the
    # last chunk's line, which once counted with them when they spanned three reads.
    def accepted(reads):
        with ProxyHarness(**{"limits.max_header_bytes": HEAD_LIMIT}) as h:
            h.client_sends(*reads)
            h.upstream_sends(OK_2)
            assert h.outcomes == [("/v1/chat", "OK", 200)]

    message = trailed(CHUNKED_HEAD, trailer_section(HEAD_LIMIT))
    accepted((message[:-len(trailer_section(HEAD_LIMIT)) - 7], b"\r\n0\r\n" + trailer_section(HEAD_LIMIT) + b"\r",
              b"\n"))
    each_plan(message, accepted, section_plans)


def test_request_trailers_one_byte_over_the_limit_are_refused_however_they_are_cut():
    def refused(reads):
        with ProxyHarness(**{"limits.max_header_bytes": HEAD_LIMIT}) as h:
            h.client_sends(*reads)
            assert [(code, status) for _, code, status in h.outcomes] == [("DPE", 431)]
            written = bytes(h.client.written)
            assert written.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
            assert b"request trailers exceed %d bytes" % HEAD_LIMIT in written

    each_plan(trailed(CHUNKED_HEAD, trailer_section(HEAD_LIMIT + 1)), refused, section_plans)


def test_chunk_extensions_never_count_toward_the_limit_however_they_are_cut():
    # llhttp reads chunk extensions without keeping them, and the proxy re-chunks the
    # body without them: 2000 bytes of them, on a chunk and on the last chunk, are
    # accepted, as they always were in one read (a byte per read they once got 431).
    extension = b";ext=" + b"e" * 1995
    message = (CHUNKED_HEAD + b"5" + extension + b"\r\nhello\r\n0" + extension + b"\r\n"
               + trailer_section(HEAD_LIMIT) + b"\r\n")

    def accepted(reads):
        with ProxyHarness(**{"limits.max_header_bytes": HEAD_LIMIT}) as h:
            h.client_sends(*reads)
            _, body = head_and_rest(bytes(h.upstream().written))
            assert dechunk(body) == (b"hello", b"", b"")
            h.upstream_sends(OK_2)
            assert h.outcomes == [("/v1/chat", "OK", 200)]

    each_plan(message, accepted)


def lookalike_plans(message: bytes) -> list[tuple[bytes, ...]]:
    """``read_plans``, and three reads: up to the end of the body data (or a byte more),
    then each cut after it (the framing after body data alone in a read)."""
    data_end = message.index(b"X-Short: 1") + 10
    return [*read_plans(message), *((message[:a], message[a:b], message[b:])
                                    for a in (data_end, data_end + 1) for b in cut_offsets(message) if b > a)]


def test_body_data_that_looks_like_trailers_never_counts_however_it_is_cut():
    # A trailer section is found from the bytes (llhttp gives no offsets): body data
    # shaped like a last chunk and a long trailer section is data all the same.
    lookalike = b"\r\n0\r\n" + trailer_section(2 * HEAD_LIMIT) + b"X-Short: 1"
    message = CHUNKED_HEAD + b"%x\r\n%s\r\n0\r\nX-Checksum: abc\r\n\r\n" % (len(lookalike), lookalike)

    def accepted(reads):
        with ProxyHarness(**{"limits.max_header_bytes": HEAD_LIMIT}) as h:
            h.client_sends(*reads)
            _, body = head_and_rest(bytes(h.upstream().written))
            assert dechunk(body) == (lookalike, b"", b"")
            h.upstream_sends(OK_2)
            assert h.outcomes == [("/v1/chat", "OK", 200)]

    each_plan(message, accepted, lookalike_plans)


def test_a_chunked_request_whose_head_is_near_the_limit_is_not_refused_for_its_first_chunk_line():
    # The read that ends the head is not chunk framing or trailers: its head bytes once
    # counted as such when the first chunk's data was still to come in a later read.
    start = b"POST /v1/chat HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\nX-Pad: "
    head = start + b"p" * (HEAD_LIMIT - 8 - len(start) - 4) + b"\r\n\r\n"
    message = head + b"5;ext=v\r\nhello\r\n0\r\n\r\n"

    def accepted(reads):
        with ProxyHarness(**{"limits.max_header_bytes": HEAD_LIMIT}) as h:
            h.client_sends(*reads)
            h.upstream_sends(OK_2)
            assert h.outcomes == [("/v1/chat", "OK", 200)]

    each_plan(message, accepted)


def test_a_request_after_trailers_cut_anywhere_is_answered_after_the_first():
    message = (CHUNKED_HEAD + b"5\r\nhello\r\n0\r\nX-Checksum: abc\r\n\r\n"
               + b"GET /next HTTP/1.1\r\nHost: a.test\r\n\r\n")

    def check(reads):
        with ProxyHarness() as h:
            h.client_sends(*reads)
            h.upstream_sends(OK_2)
            h.upstream_sends(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nnext")
            assert len(h.upstreams) == 1
            upstream = bytes(h.upstream().written)
            head, body = head_and_rest(upstream)
            data, trailers, after = dechunk(body)
            assert (data, trailers) == (b"hello", b"")
            assert masked(after) == forwarded(b"GET /next HTTP/1.1")
            assert masked(h.client.written) == answered(b"ok") + answered(b"next")
            assert h.outcomes == [("/v1/chat", "OK", 200), ("/next", "OK", 200)]

    each_plan(message, check)


# ----------------------------------------------------------------------------------
# Pipelined requests
# ----------------------------------------------------------------------------------
PIPELINED = [
    (b"GET /1 HTTP/1.1\r\nHost: a.test\r\n\r\n", forwarded(b"GET /1 HTTP/1.1"), b"one"),
    (b"POST /2 HTTP/1.1\r\nHost: a.test\r\nContent-Length: 5\r\n\r\nhello",
     forwarded(b"POST /2 HTTP/1.1", framing=b"Content-Length: 5") + b"hello", b"two"),
    (b"GET /3 HTTP/1.1\r\nHost: a.test\r\n\r\n", forwarded(b"GET /3 HTTP/1.1"), b"three"),
]


@pytest.mark.parametrize("count", [2, 3])
def test_pipelined_requests_cut_anywhere_are_forwarded_and_answered_in_order(count):
    requests = PIPELINED[:count]

    def check(reads):
        with ProxyHarness() as h:
            h.client_sends(*reads)
            for turn, (_, sent_upstream, body) in enumerate(requests):
                # The next request goes upstream only once the one before it is answered.
                assert masked(h.upstream().written) == b"".join(sent for _, sent, _ in requests[:turn + 1])
                h.upstream_sends(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            assert len(h.upstreams) == 1  # one connection, reused in turn
            # Reading paused while a request waited its turn, and resumed for the next one.
            assert "pause_reading" in h.client.calls and not h.client.reading_paused
            assert masked(h.client.written) == b"".join(answered(body) for _, _, body in requests)
            assert h.outcomes == [(f"/{n}", "OK", 200) for n in range(1, count + 1)]

    each_plan(b"".join(message for message, _, _ in requests), check)


# ----------------------------------------------------------------------------------
# The head size limit
# ----------------------------------------------------------------------------------
def pad_line(head_size: int, request_line: bytes) -> bytes:
    """The X-Pad header line that makes ``request_line`` + Host + it a head of ``head_size`` bytes."""
    taken = len(request_line + b"\r\nHost: a.test\r\nX-Pad: \r\n\r\n")
    return b"X-Pad: " + b"p" * (head_size - taken)


def head_of_size(size: int, target: bytes = b"/limit") -> bytes:
    request_line = b"GET " + target + b" HTTP/1.1"
    return request_line + b"\r\nHost: a.test\r\n" + pad_line(size, request_line) + b"\r\n\r\n"


def assert_head_refused(written: bytes) -> None:
    head, body = head_and_rest(written)
    assert head.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert b"request head exceeds %d bytes" % HEAD_LIMIT in body


def test_a_head_at_the_limit_is_forwarded_and_one_byte_more_is_refused_however_it_is_cut():
    at_limit, over = head_of_size(HEAD_LIMIT), head_of_size(HEAD_LIMIT + 1)
    assert (len(at_limit), len(over)) == (HEAD_LIMIT, HEAD_LIMIT + 1)

    def forwarded_whole(reads):
        with ProxyHarness(**{"limits.max_header_bytes": HEAD_LIMIT}) as h:
            h.client_sends(*reads)
            request_line = b"GET /limit HTTP/1.1"
            assert masked(h.upstream().written) == forwarded(request_line, pad_line(HEAD_LIMIT, request_line))
            h.upstream_sends(OK_2)
            assert h.outcomes == [("/limit", "OK", 200)]

    def refused(reads):
        with ProxyHarness(**{"limits.max_header_bytes": HEAD_LIMIT}) as h:
            h.client_sends(*reads)
            assert h.upstreams == []  # nothing of it went upstream
            assert_head_refused(bytes(h.client.written))
            assert [(code, status) for _, code, status in h.outcomes] == [("DPE", 431)]

    each_plan(at_limit, forwarded_whole)
    each_plan(over, refused)


def test_a_pipelined_head_at_the_limit_is_answered_and_one_byte_more_is_refused_however_it_is_cut():
    # The second head begins behind the first request in some read: where it begins
    # there is found, not told by llhttp, and is the hard case for counting it.
    first = b"POST /first HTTP/1.1\r\nHost: a.test\r\nContent-Length: 3\r\n\r\nabc"
    at_limit, over = head_of_size(HEAD_LIMIT, b"/second"), head_of_size(HEAD_LIMIT + 1, b"/second")

    def answered_both(reads):
        with ProxyHarness(**{"limits.max_header_bytes": HEAD_LIMIT}) as h:
            h.client_sends(*reads)
            h.upstream_sends(OK_2)
            h.upstream_sends(OK_2)
            assert h.outcomes == [("/first", "OK", 200), ("/second", "OK", 200)]

    def refused_second(reads):
        with ProxyHarness(**{"limits.max_header_bytes": HEAD_LIMIT}) as h:
            h.client_sends(*reads)
            h.upstream_sends(OK_2)
            written, first_response = masked(h.client.written), answered(b"ok")
            assert written.startswith(first_response)
            assert_head_refused(written[len(first_response):])
            assert [(code, status) for _, code, status in h.outcomes] == [("OK", 200), ("DPE", 431)]

    each_plan(first + at_limit, answered_both)
    each_plan(first + over, refused_second)


def test_a_pipelined_head_over_the_limit_by_its_whitespace_is_refused_where_its_start_is_known():
    # llhttp strips the whitespace around a header value, so a head whose start in
    # the read is not known is sized from its lines, without it (a documented
    # shortfall). Its start is known when it comes at a read's first byte, or in the
    # read that began the request before it at its first byte: then it is counted.
    first = b"POST /first HTTP/1.1\r\nHost: a.test\r\nContent-Length: 3\r\n\r\nabc"
    over = head_of_size(HEAD_LIMIT - 2, b"/second").replace(b"X-Pad: ", b"X-Pad:    ")
    assert len(over) == HEAD_LIMIT + 1
    message = first + over
    known_starts = [(message,), (first, over)] + [(message[:at], message[at:])
                                                 for at in cut_offsets(message) if at > len(first)]
    for reads in known_starts:
        with ProxyHarness(**{"limits.max_header_bytes": HEAD_LIMIT}) as h:
            h.client_sends(*reads)
            h.upstream_sends(OK_2)
            assert [(code, status) for _, code, status in h.outcomes] == [("OK", 200), ("DPE", 431)], plan_id(reads)


@pytest.mark.parametrize("read_size", [1, 7, 100, HEAD_LIMIT - 1])
def test_a_head_that_never_ends_is_refused_once_past_the_limit(read_size):
    # httptools gathers a header value until its line ends: a client streaming one
    # endless header must be cut off by the bytes counted per read.
    start = b"GET / HTTP/1.1\r\nHost: a.test\r\nX-Endless: "
    with ProxyHarness(**{"limits.max_header_bytes": HEAD_LIMIT}) as h:
        h.client_sends(start)
        sent = len(start)
        while not h.outcomes and sent <= 4 * HEAD_LIMIT:
            h.client_sends(b"v" * read_size)
            sent += read_size
        assert h.upstreams == []
        assert_head_refused(bytes(h.client.written))
        assert sent <= HEAD_LIMIT + read_size  # refused in the read that went past the limit


@pytest.mark.parametrize("read_size", [1, 7, 100, HEAD_LIMIT - 1])
def test_a_trailer_that_never_ends_is_refused_once_past_the_limit(read_size):
    start = CHUNKED_HEAD + b"5\r\nhello\r\n0\r\nX-Endless: "
    with ProxyHarness(**{"limits.max_header_bytes": HEAD_LIMIT}) as h:
        h.client_sends(start)
        sent = 0
        while not h.outcomes and sent <= 4 * HEAD_LIMIT:
            h.client_sends(b"v" * read_size)
            sent += read_size
        assert [(code, status) for _, code, status in h.outcomes] == [("DPE", 431)]
        assert b"request trailers exceed %d bytes" % HEAD_LIMIT in h.client.written
        assert sent <= HEAD_LIMIT + read_size


# ----------------------------------------------------------------------------------
# The response side
# ----------------------------------------------------------------------------------
def exchange_with_response(reads, request: bytes = GET, h: ProxyHarness | None = None) -> ProxyHarness:
    h = h or ProxyHarness()
    h.client_sends(request)
    h.upstream_sends(*reads)
    return h


def test_a_response_head_cut_anywhere_reaches_the_client_the_same():
    response = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Engine: e1\r\nContent-Length: 8\r\n\r\n"
                b'{"a":1}\n')

    def check(reads):
        with exchange_with_response(reads) as h:
            assert masked(h.client.written) == answered(b'{"a":1}\n', b"Content-Type: application/json",
                                                         b"X-Engine: e1")
            assert h.outcomes == [("/v1/models?x=1", "OK", 200)]
            assert h.upstream().calls == []  # kept for the next request

    each_plan(response, check)


def test_a_repeated_response_head_cut_anywhere_reaches_the_client_the_same():
    # The second response on a connection repeats the first one's head: when its first
    # read starts with those bytes, another parser (no header callbacks) reads it.
    response = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nfirst"
    again = response.replace(b"first", b"again")

    def check(reads):
        with ProxyHarness() as h:
            exchange_with_response((response,), h=h)
            exchange_with_response(reads, h=h)
            assert len(h.upstreams) == 1
            assert masked(h.client.written) == answered(b"first", b"Content-Type: text/plain") + answered(
                b"again", b"Content-Type: text/plain")
            assert h.outcomes == [("/v1/models?x=1", "OK", 200)] * 2

    each_plan(again, check)


CHUNKED_RESPONSE_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def check_chunked_response(reads, data: bytes, *lines: bytes) -> None:
    """The client gets a chunked response with header ``lines`` carrying ``data``; it ends OK."""
    with exchange_with_response(reads) as h:
        head, body = head_and_rest(bytes(h.client.written))
        assert masked(head) == (b"HTTP/1.1 200 OK\r\n" + b"".join(line + b"\r\n" for line in lines)
                                + b"x-request-id: <minted>\r\ntraceresponse: <minted>\r\n"
                                b"Transfer-Encoding: chunked\r\nKeep-Alive: timeout=75\r\n\r\n")
        assert dechunk(body) == (data, b"", b"")
        assert body.endswith(b"\r\n0\r\n\r\n")
        assert h.outcomes == [("/v1/models?x=1", "OK", 200)]
        assert h.upstream().calls == []  # kept for the next request


def test_a_chunked_response_cut_anywhere_carries_the_same_data():
    body = b"1A;ext=v\r\nabcdefghijklmnopqrstuvwxyz\r\n5\r\nhello\r\n0\r\nX-Trailer: t\r\n\r\n"
    each_plan(CHUNKED_RESPONSE_HEAD + body,
              lambda reads: check_chunked_response(reads, b"abcdefghijklmnopqrstuvwxyz" + b"hello"))


def test_interim_responses_cut_anywhere_are_consumed_and_the_final_one_forwarded():
    response = (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n"
                + OK_2)

    def check(reads):
        with exchange_with_response(reads) as h:
            assert masked(h.client.written) == answered(b"ok")
            assert h.outcomes == [("/v1/models?x=1", "OK", 200)]

    each_plan(response, check)


def test_response_trailers_at_the_limit_are_consumed_however_they_are_cut():
    # Response trailers are not forwarded: the client's chunked body ends with the
    # proxy's own last chunk. Only the field lines count (see the request's case).
    def consumed(reads):
        with ProxyHarness(**{"limits.max_header_bytes": HEAD_LIMIT}) as h:
            exchange_with_response(reads, h=h)
            assert dechunk(head_and_rest(bytes(h.client.written))[1]) == (b"hello", b"", b"")
            assert h.outcomes == [("/v1/models?x=1", "OK", 200)]
            assert h.upstream().calls == []  # kept for the next request

    each_plan(trailed(CHUNKED_RESPONSE_HEAD, trailer_section(HEAD_LIMIT)), consumed, section_plans)


def assert_response_refused_for_its_trailers(h: ProxyHarness) -> None:
    """A 502 (UPE) while nothing of the response reached the client, else the response
    cut short (no last chunk, the connection closed); the upstream connection never reused."""
    written = bytes(h.client.written)
    [(_, code, status)] = h.outcomes
    assert code == "UPE" and not written.endswith(b"0\r\n\r\n")
    if written.startswith(b"HTTP/1.1 502 "):
        assert status == 502 and b"response trailers exceed %d bytes" % HEAD_LIMIT in written
    else:
        assert status == 200 and written.startswith(b"HTTP/1.1 200 OK\r\n") and "close" in h.client.calls
    assert h.upstream().calls == ["abort"]


def test_response_trailers_one_byte_over_the_limit_are_a_502_however_they_are_cut():
    def refused(reads):
        with ProxyHarness(**{"limits.max_header_bytes": HEAD_LIMIT}) as h:
            exchange_with_response(reads, h=h)
            assert_response_refused_for_its_trailers(h)

    each_plan(trailed(CHUNKED_RESPONSE_HEAD, trailer_section(HEAD_LIMIT + 1)), refused, section_plans)


def test_response_trailers_past_the_limit_are_a_502_however_they_are_cut():
    # In one or two reads they were once consumed, and the connection pooled.
    def refused(reads):
        with ProxyHarness(**{"limits.max_header_bytes": HEAD_LIMIT}) as h:
            exchange_with_response(reads, h=h)
            assert_response_refused_for_its_trailers(h)

    each_plan(trailed(CHUNKED_RESPONSE_HEAD, trailer_section(3 * HEAD_LIMIT)), refused)


def test_response_chunk_extensions_and_lookalike_data_never_count_however_they_are_cut():
    lookalike = b"\r\n0\r\n" + trailer_section(2 * HEAD_LIMIT) + b"X-Short: 1"
    extension = b";ext=" + b"e" * 1995
    body = (b"%x%s\r\n%s\r\n" % (len(lookalike), extension, lookalike)
            + b"0" + extension + b"\r\nX-Checksum: abc\r\n\r\n")

    def consumed(reads):
        with ProxyHarness(**{"limits.max_header_bytes": HEAD_LIMIT}) as h:
            exchange_with_response(reads, h=h)
            assert dechunk(head_and_rest(bytes(h.client.written))[1]) == (lookalike, b"", b"")
            assert h.outcomes == [("/v1/models?x=1", "OK", 200)]
            assert h.upstream().calls == []

    each_plan(CHUNKED_RESPONSE_HEAD + body, consumed, lookalike_plans)


def response_head_of_size(size: int) -> bytes:
    start = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Pad: "
    return start + b"p" * (size - len(start) - 4) + b"\r\n\r\n"


def test_a_response_head_at_the_limit_is_forwarded_and_one_byte_more_is_a_502_however_it_is_cut():
    def forwarded_whole(reads):
        with ProxyHarness(**{"limits.max_header_bytes": HEAD_LIMIT}) as h:
            exchange_with_response(reads, h=h)
            assert h.outcomes == [("/v1/models?x=1", "OK", 200)]

    def refused(reads):
        with ProxyHarness(**{"limits.max_header_bytes": HEAD_LIMIT}) as h:
            exchange_with_response(reads, h=h)
            assert bytes(h.client.written).startswith(b"HTTP/1.1 502 Bad Gateway\r\n")
            assert b"response head exceeds %d bytes" % HEAD_LIMIT in h.client.written
            assert [(code, status) for _, code, status in h.outcomes] == [("UPE", 502)]

    each_plan(response_head_of_size(HEAD_LIMIT) + b"ok", forwarded_whole)
    each_plan(response_head_of_size(HEAD_LIMIT + 1) + b"ok", refused)


@pytest.mark.parametrize("read_size", [1, 7, 100, HEAD_LIMIT - 1])
@pytest.mark.parametrize(("start", "status"), [
    (b"HTTP/1.1 200 OK\r\nX-Endless: ", 502),
    (CHUNKED_RESPONSE_HEAD + b"5\r\nhello\r\n0\r\nX-Endless: ", 200),  # the response had started
], ids=["head", "trailer"])
def test_a_response_head_or_trailer_that_never_ends_is_cut_off_once_past_the_limit(start, status, read_size):
    with ProxyHarness(**{"limits.max_header_bytes": HEAD_LIMIT}) as h:
        exchange_with_response((start,), h=h)
        sent = 0
        while not h.outcomes and sent <= 4 * HEAD_LIMIT:
            h.upstream_sends(b"v" * read_size)
            sent += read_size
        assert [(code, status) for _, code, status in h.outcomes] == [("UPE", status)]
        assert sent <= HEAD_LIMIT + read_size
        assert h.upstream().calls == ["abort"]  # never reused


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
SSE_EVENTS = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n' + b"data: [DONE]\n\n"


SSE_STREAM = SSE_HEAD + b"%x\r\n%s\r\n0\r\n\r\n" % (len(SSE_EVENTS), SSE_EVENTS)


def test_an_event_stream_cut_in_two_anywhere_ends_ok():
    # An event stream ends OK only when its end (data: [DONE]) is seen; cut in two,
    # that end spans at most two reads.
    each_plan(SSE_STREAM, lambda reads: check_chunked_response(reads, SSE_EVENTS, b"Content-Type: text/event-stream"),
              one_or_two_reads)


def test_an_event_stream_whose_end_comes_a_byte_per_read_ends_ok():
    check_chunked_response(byte_by_byte(SSE_STREAM), SSE_EVENTS, b"Content-Type: text/event-stream")
