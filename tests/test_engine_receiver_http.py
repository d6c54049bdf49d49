"""The OTLP/HTTP engine span receiver's own HTTP/1.1 server (``engine_receiver_http``):
keep-alive, chunked and compressed bodies, answers from the headers alone, bodies
refused with a counted reason, in order on one connection. 127.0.0.1, an ephemeral port,
a ``take`` that records."""

from __future__ import annotations

import asyncio
import gzip
import zlib

import pytest

from traceproxy.observe import engine_receiver_http
from traceproxy.observe.engine_receiver_http import MAX_HEADER_BYTES, PIPELINED, BodyRefused, OtlpHttpServer

MAX_BODY = 1 << 16
PROTOBUF = b"Content-Type: application/x-protobuf\r\n"


def post(body: bytes, headers: bytes = PROTOBUF, path: bytes = b"/v1/traces") -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nHost: x\r\n" + headers +
            b"Content-Length: %d\r\n\r\n" % len(body) + body)


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if line)
    body = await reader.readexactly(int(headers["Content-Length"]))
    return int(lines[0].split()[1]), headers, body


def exchange(sent: list[bytes], answers: int, pause_after_first: bool = False, take_now_bytes: int | None = None,
             ways: list | None = None):
    """Send ``sent`` on one connection; the answers read, what ``take`` got, the refusals
    counted, and whether the server then closed the connection. ``take_now_bytes``: the
    server also has a ``take_now`` for bodies up to that size; ``ways`` gets, per body
    taken or refused by either, "now" or "task"."""
    taken, refused = [], []

    def take_now(body: bytes, peer: str) -> None:
        if ways is not None:
            ways.append("now")
        if body == b"bad":
            raise BodyRefused("malformed", "not an OTLP ExportTraceServiceRequest")
        if body == b"fault":
            raise KeyError("a fault of the receiver's own")
        taken.append((body, peer.startswith("http:127.0.0.1:")))

    async def take(body: bytes, peer: str) -> None:
        take_now(body, peer)
        if ways is not None:
            ways[-1] = "task"  # hazard: not reached when take_now raises; the tests of ways refuse nothing

    async def scenario():
        extra = {} if take_now_bytes is None else {"take_now": take_now, "take_now_bytes": take_now_bytes}
        server = OtlpHttpServer(take, lambda refusal, peer: refused.append(refusal.reason), MAX_BODY, **extra)
        port = await server.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            out = []
            for n, data in enumerate(sent):
                writer.write(data)
                await writer.drain()
                if n == 0 and pause_after_first:
                    out.append(await read_answer(reader))
            while len(out) < answers:
                out.append(await read_answer(reader))
            closed = await reader.read(1) == b""
            writer.close()
            return out, closed
        finally:
            await server.stop()

    async def bounded():
        return await asyncio.wait_for(scenario(), 10)

    answers_read, closed = asyncio.run(bounded())
    return answers_read, taken, refused, closed


@pytest.mark.parametrize("take_now_bytes", [None, 8], ids=["task", "now-and-task"])
def test_requests_on_one_keep_alive_connection_are_taken_and_answered_in_order(take_now_bytes):
    chunked = (b"POST /v1/traces HTTP/1.1\r\nHost: x\r\n" + PROTOBUF + b"Transfer-Encoding: chunked\r\n\r\n"
               b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    deflated = zlib.compress(b"deflated body")
    last = post(b"last", headers=PROTOBUF + b"Connection: close\r\n")
    answers, taken, refused, closed = exchange(
        [post(b"one") + post(b"bad"), chunked, post(gzip.compress(b"gzipped body"), PROTOBUF +
                                                        b"Content-Encoding: gzip\r\n"),
         post(deflated, PROTOBUF + b"Content-Encoding: deflate\r\n"), last], answers=6, take_now_bytes=take_now_bytes)
    assert [status for status, _, _ in answers] == [200, 400, 200, 200, 200, 200]
    assert b"not an OTLP ExportTraceServiceRequest" in answers[1][2]
    assert taken == [(b"one", True), (b"abcde", True), (b"gzipped body", True), (b"deflated body", True),
                     (b"last", True)]
    assert refused == ["malformed"] and closed
    assert answers[-1][1].get("Connection") == "close" and "Connection" not in answers[0][1]


@pytest.mark.parametrize("request_bytes, status, reason, words", [
    (post(b"x", path=b"/v1/metrics"), 404, None, b""),
    (b"GET /v1/traces HTTP/1.1\r\nHost: x\r\n\r\n", 405, None, b""),
    (post(b"{}", headers=b"Content-Type: application/json\r\n"), 415, "unsupported_media_type",
     b"application/x-protobuf only"),
    (post(b"x", headers=PROTOBUF + b"Content-Encoding: br\r\n"), 415, "unsupported_media_type", b"gzip, deflate"),
    (post(gzip.compress(b"\0" * (MAX_BODY + 1)), PROTOBUF + b"Content-Encoding: gzip\r\n"), 413, "too_large",
     b"after content decoding"),
    (post(b"x" * (MAX_BODY + 1)), 413, "too_large", b"over 65536"),
    (post(gzip.compress(b"cut short")[:-6], PROTOBUF + b"Content-Encoding: gzip\r\n"), 400, "malformed",
     b"cut short"),
    (post(b"not gzip", PROTOBUF + b"Content-Encoding: gzip\r\n"), 400, "malformed", b"cannot be read"),
    (b"POST /v1/traces HTTP/1.1\r\n" + PROTOBUF + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", 400, "malformed",
     b"cannot be parsed"),
    (b"POST /v1/traces HTTP/1.1\r\nX-Pad: " + b"a" * MAX_HEADER_BYTES + b"\r\n\r\n", 400, "malformed",
     b"headers over"),
    (post(gzip.compress(b"first") + gzip.compress(b"second"), PROTOBUF + b"Content-Encoding: gzip\r\n"), 400,
     "malformed", b"after the end of its compressed stream"),
    (post(gzip.compress(b"first") + b"junk", PROTOBUF + b"Content-Encoding: gzip\r\n"), 400, "malformed",
     b"after the end of its compressed stream"),
    (b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n" + PROTOBUF +
     b"Content-Length: 1\r\n\r\nx", 400, "malformed", b"protocol upgrade"),
], ids=["path", "method", "json", "brotli", "gzip-bomb", "oversized", "gzip-cut-short", "not-gzip", "bad-chunk",
        "huge-headers", "gzip-two-members", "gzip-then-junk", "upgrade"])
def test_what_is_not_an_export_request_is_answered_with_a_reason_and_counted(request_bytes, status, reason, words):
    answers, taken, refused, _ = exchange([request_bytes, post(b"after")], answers=1)
    assert answers[0][0] == status and words in answers[0][2]
    assert refused == ([reason] if reason else [])
    if status == 405:
        assert answers[0][1]["Allow"] == "POST"
    assert taken in ([], [(b"after", True)])  # the connection may go on after a body refused once it is read


def test_a_declared_length_over_the_cap_is_refused_before_the_body_is_sent():
    head = b"POST /v1/traces HTTP/1.1\r\nHost: x\r\n" + PROTOBUF + b"Content-Length: %d\r\n\r\n" % (MAX_BODY + 1)
    answers, taken, refused, closed = exchange([head, b"x" * (MAX_BODY + 1)], answers=1, pause_after_first=True)
    assert answers[0][0] == 413 and refused == ["too_large"] and taken == [] and closed


@pytest.mark.parametrize("take_now_bytes", [None, 8], ids=["task", "now"])
def test_a_fault_in_taking_a_request_is_answered_500_and_the_connection_goes_on(take_now_bytes):
    answers, taken, refused, _ = exchange([post(b"fault"), post(b"next", PROTOBUF + b"Connection: close\r\n")],
                                          answers=2, take_now_bytes=take_now_bytes)
    assert [status for status, _, _ in answers] == [500, 200] and b"failed to take" in answers[0][2]
    assert taken == [(b"next", True)] and refused == []


def test_a_small_body_alone_on_its_connection_is_taken_at_once_a_larger_one_or_one_behind_it_by_a_task():
    """``take_now`` (no task) for a body up to ``take_now_bytes`` when nothing waits before
    it on the connection; else the task, which keeps the answers in order."""
    ways: list[str] = []
    big = b"x" * 100
    answers, taken, refused, closed = exchange(  # "one" answered before the rest is sent
        [post(b"one"), post(big) + post(b"two", PROTOBUF + b"Connection: close\r\n")], answers=3,
        pause_after_first=True, take_now_bytes=8, ways=ways)
    assert [status for status, _, _ in answers] == [200, 200, 200] and closed and refused == []
    assert [body for body, _ in taken] == [b"one", big, b"two"]
    assert ways == ["now", "task", "task"]


def test_an_exporter_given_the_receivers_base_url_posts_to_the_root_and_is_taken():
    # SGLang hands --otlp-traces-endpoint to its OTLP/HTTP exporter as the URL to post
    # to: http://HOST:PORT (a collector's base URL, as written for gRPC) posts to "/".
    answers, taken, refused, _ = exchange([post(b"at the root", PROTOBUF + b"Connection: close\r\n", path=b"/")],
                                         answers=1)
    assert [status for status, _, _ in answers] == [200]
    assert taken == [(b"at the root", True)] and refused == []


def test_requests_answered_from_their_headers_end_the_connection_after_the_first():
    answers, taken, refused, closed = exchange([post(b"x", path=b"/a") + post(b"x", path=b"/b")], answers=1)
    assert [status for status, _, _ in answers] == [404] and closed and taken == [] and refused == []


@pytest.mark.parametrize("take_now_bytes", [None, 8], ids=["task", "now-and-task"])
def test_a_request_that_cannot_be_parsed_behind_a_valid_one_is_answered_400_after_it(take_now_bytes):
    answers, taken, refused, closed = exchange([post(b"x" * 100) + b"BOGUS\r\n\r\n"], answers=2,
                                               take_now_bytes=take_now_bytes)
    assert [status for status, _, _ in answers] == [200, 400] and b"cannot be parsed" in answers[1][2]
    assert taken == [(b"x" * 100, True)] and refused == ["malformed"] and closed
    assert answers[1][1].get("Connection") == "close"


@pytest.mark.parametrize("take_now_bytes", [None, 8], ids=["task", "now-and-task"])
def test_a_connection_that_stops_within_the_next_head_after_an_answer_is_closed_when_idle(monkeypatch,
                                                                                           take_now_bytes):
    monkeypatch.setattr(engine_receiver_http, "IDLE_TIMEOUT_S", 0.2)
    answers, taken, refused, closed = exchange([post(b"x" * 100) + b"POST /v1/traces HTTP/1.1\r\nHo"], answers=1,
                                               take_now_bytes=take_now_bytes)
    assert [status for status, _, _ in answers] == [200] and closed and taken == [(b"x" * 100, True)]


@pytest.mark.parametrize("after_an_answer", [False, True], ids=["first", "after-an-answer"])
def test_a_body_that_stops_coming_is_answered_408_and_the_connection_closed(monkeypatch, after_an_answer):
    monkeypatch.setattr(engine_receiver_http, "IDLE_TIMEOUT_S", 0.2)
    stalled = post(b"x" * 100)[:-50]  # its head and half its body, then nothing
    sent = [post(b"one") + stalled] if after_an_answer else [stalled]
    answers, taken, refused, closed = exchange(sent, answers=1 + after_an_answer)
    assert [status for status, _, _ in answers][-1] == 408 and b"no body bytes" in answers[-1][2]
    assert closed and taken == ([(b"one", True)] if after_an_answer else []) and refused == []


def test_a_body_that_keeps_coming_slowly_is_not_timed_out(monkeypatch):
    monkeypatch.setattr(engine_receiver_http, "IDLE_TIMEOUT_S", 0.3)
    body = b"x" * 6
    whole = post(body, PROTOBUF + b"Connection: close\r\n")
    head = whole[:-len(body)]

    async def scenario(port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head)
        for n in range(len(body)):  # 6 x 0.1 s: longer in all than the timeout, never quiet as long
            await asyncio.sleep(0.1)
            writer.write(body[n:n + 1])
        answer = await read_answer(reader)
        writer.close()
        return answer

    taken = []

    async def take(got: bytes, peer: str) -> None:
        taken.append(got)

    async def main():
        server = OtlpHttpServer(take, lambda refusal, peer: None, MAX_BODY)
        port = await server.start("127.0.0.1", 0)
        try:
            return await asyncio.wait_for(scenario(port), 10)
        finally:
            await server.stop()

    assert asyncio.run(main())[0] == 200 and taken == [body]


def test_pipelined_requests_in_one_piece_are_parsed_no_more_than_pipelined_at_a_time():
    """llhttp is fed a request at a time: past ``PIPELINED`` waiting, the rest of what was
    received is kept unparsed (each request could inflate to ``max_body``)."""
    count = 12
    bodies = [b"body %d" % n for n in range(count)]
    taken, most_waiting = [], []

    async def main():
        release = asyncio.Event()

        async def take(body: bytes, peer: str) -> None:
            most_waiting.append(max(len(connection.waiting) for connection in server.connections))
            if not taken:
                await release.wait()  # the first holds its connection's answers back
            taken.append(body)

        server = OtlpHttpServer(take, lambda refusal, peer: None, MAX_BODY)
        port = await server.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"".join(post(gzip.compress(body), PROTOBUF + b"Content-Encoding: gzip\r\n")
                                  for body in bodies))
            await writer.drain()
            for _ in range(50):  # what the server would parse while the first is held
                await asyncio.sleep(0.01)
            held = max(len(connection.waiting) for connection in server.connections)
            release.set()
            answers = [await asyncio.wait_for(read_answer(reader), 10) for _ in bodies]
            writer.close()
            return held, answers
        finally:
            await server.stop()

    held, answers = asyncio.run(main())
    assert held <= PIPELINED and max(most_waiting) <= PIPELINED
    assert [status for status, _, _ in answers] == [200] * count and taken == bodies


def test_a_request_answered_from_its_headers_waits_for_the_answers_before_it(monkeypatch):
    """The linger (what is sent after a refusal is read, then the connection closes)
    does not cut short the answer of a request before it still being taken."""
    monkeypatch.setattr(engine_receiver_http, "LINGER_S", 0.05)
    taken = []

    async def take(body: bytes, peer: str) -> None:
        await asyncio.sleep(0.3)  # longer than the linger
        taken.append(body)

    async def main():
        server = OtlpHttpServer(take, lambda refusal, peer: None, MAX_BODY)
        port = await server.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(post(b"first") + post(b"x", path=b"/v1/metrics"))
            answers = [await asyncio.wait_for(read_answer(reader), 10) for _ in range(2)]
            closed = await asyncio.wait_for(reader.read(1), 10) == b""
            writer.close()
            return answers, closed
        finally:
            await server.stop()

    answers, closed = asyncio.run(main())
    assert [status for status, _, _ in answers] == [200, 404] and closed and taken == [b"first"]
