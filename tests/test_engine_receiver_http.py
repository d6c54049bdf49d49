"""The OTLP/HTTP engine span receiver's own HTTP/1.1 server (``engine_receiver_http``):
keep-alive, chunked and compressed bodies, answers from the headers alone, bodies
refused with a counted reason, in order on one connection. 127.0.0.1, an ephemeral port,
a ``take`` that records."""

from __future__ import annotations

import asyncio
import gzip
import zlib

import pytest

from traceproxy.observe.engine_receiver_http import MAX_HEADER_BYTES, BodyRefused, OtlpHttpServer

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
], ids=["path", "method", "json", "brotli", "gzip-bomb", "oversized", "gzip-cut-short", "not-gzip", "bad-chunk",
        "huge-headers"])
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
