"""The OTLP/HTTP engine span receiver's server: HTTP/1.1 on asyncio and llhttp
(``httptools``), for ``POST /v1/traces`` alone (and ``POST /``, see ``PATHS``).

Why not aiohttp's server, as before: an engine's export request is small (64 spans, a
few KiB) and comes hundreds of times a second; aiohttp's request and response objects,
router and writer cost about three times what the rest of taking a request costs at the
HTTP layer (measured with a handler that did nothing: 8 % of a core against 2.6 % for
this server, at 250 export requests a second). The receiver needs one path, one method,
one content type and an empty answer.

Theory of operation
-------------------
One ``_Connection`` per client connection; llhttp calls back as it parses. At the end of
a request's headers, what can be judged from them is: another path (404), another
method (405), another content type (415), a ``Content-Length`` over ``max_body`` (413),
an unknown ``Content-Encoding`` (415). Such a request is answered at once, its body
read and thrown away (lingering, at most ``LINGER_S``, so the client reads the answer
rather than a reset), and the connection closed. Otherwise its body is gathered, gzip
or deflate inflated as it comes, a piece at a time: past ``max_body`` (before or after
inflating) it is refused with 413, never held whole; bytes that do not inflate, or that
follow the end of the compressed stream (a second gzip member, junk), are 400.
A complete body goes to ``take(body, peer)``, which raises ``BodyRefused`` for one that
is not an export request; requests of one connection are answered in order, one at a
time. Answers as a collector gives them: 200 with an
empty body, or the status with a ``google.rpc.Status`` naming the reason. A request
llhttp cannot parse (a bad request line, a bad chunk), or one asking for a protocol
upgrade, is 400 (after the answers to the requests before it) and the connection closes;
a fault in ``take`` itself is logged and answered 500 (an exporter retries), never left
unanswered.

Bounds: a request line and headers over ``MAX_HEADER_BYTES``, 400 (counted as
malformed); a connection that sends no complete request head for ``IDLE_TIMEOUT_S``
(aiohttp's keep-alive timeout) after it opens or after its last answer is closed; a body
that goes ``IDLE_TIMEOUT_S`` without a byte is answered 408 and the connection closed
(not counted as a refusal: nothing was judged of it). At most ``PIPELINED`` parsed
requests wait: llhttp is fed a request at a time (a head, then a Content-Length body or a
chunked body's line), and what was received past that many is kept unparsed, reading
paused, until answers drain; so at most that many inflated bodies are held.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections import deque
from collections.abc import Awaitable, Callable

import httptools

from ..reason_phrases import reason_phrase
from .listener import ConnectionListener
from .otlp_proto import length_delimited, varint

log = logging.getLogger("traceproxy.engine_spans")
# OTLP/HTTP's traces path, and the root: an exporter handed an endpoint URL for traces
# posts to it as given, so SGLang told `--otlp-traces-endpoint http://HOST:PORT` (as a
# collector's base URL would be written) posts to "/". Nothing else is served here.
PATHS = (b"/v1/traces", b"/")
PROTOBUF = "application/x-protobuf"
MAX_HEADER_BYTES = 64 << 10
IDLE_TIMEOUT_S = 75.0
LINGER_S = 5.0
PIPELINED = 2  # requests waiting for their answer, past which reading pauses
_INVALID_ARGUMENT, _RESOURCE_EXHAUSTED, _INTERNAL = 3, 8, 13  # google.rpc.Code
STATUS = {"malformed": (400, _INVALID_ARGUMENT), "too_large": (413, _RESOURCE_EXHAUSTED),
          "unsupported_media_type": (415, _INVALID_ARGUMENT)}
REASONS = tuple(STATUS)  # what a refusal is counted as
_WBITS = {b"gzip": 31, b"x-gzip": 31, b"deflate": 15}  # deflate: zlib-wrapped, as RFC 9110 says


class BodyRefused(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def rpc_status(code: int, message: str) -> bytes:
    """A ``google.rpc.Status`` (code = 1, message = 2), the body OTLP/HTTP errors carry."""
    return b"\x08" + varint(code) + length_delimited(b"\x12", message.encode("utf-8", "replace"))


class OtlpHttpServer(ConnectionListener):
    """``take(body, peer)``: the receiver's, per complete body; ``refused(refusal, peer)``:
    told of every refusal, to count it. ``take_now``: the same, not a coroutine, for a
    body of at most ``take_now_bytes`` that is the only request of its connection
    waiting: answered from llhttp's callback, with no task (a task, its coroutines and
    their scheduling are work per export request that a body taken at once does not need)."""

    def __init__(self, take: Callable[[bytes, str], Awaitable[object]],
                 refused: Callable[[BodyRefused, str], None], max_body: int, *,
                 take_now: Callable[[bytes, str], object] | None = None, take_now_bytes: int = 0) -> None:
        super().__init__(_Connection)
        self.take, self.refused, self.max_body = take, refused, max_body
        self.take_now, self.take_now_bytes = take_now, take_now_bytes


class _Request:
    __slots__ = ("method", "path", "content_type", "encoding", "length", "chunked", "wire_bytes", "keep_alive",
                 "parts", "size", "inflater", "refusal", "status", "head_bytes")

    def __init__(self) -> None:
        self.method = self.path = b""
        self.content_type = ""
        self.encoding = b""
        self.length = 0  # as declared (Content-Length); llhttp refuses one that is not a number
        self.chunked = False
        self.wire_bytes = 0  # of its body as sent (before inflating): where a Content-Length body ends
        self.keep_alive = True
        self.parts: list[bytes] = []
        self.size = 0
        self.inflater = None
        self.refusal: BodyRefused | None = None
        self.status = 0  # an answer decided from the headers alone (404, 405): not a body refused
        self.head_bytes = 0  # of its target and headers, as llhttp hands them over


class _Connection(asyncio.Protocol):
    def __init__(self, server: OtlpHttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer = "http:?"
        self.parser = httptools.HttpRequestParser(self)
        self.request: _Request | None = None  # the one being parsed
        self.waiting: deque[_Request] = deque()  # parsed, not answered yet
        self.header_bytes = 0
        self.answering: asyncio.Task | None = None
        self.discarding = False  # answered from its headers: the rest of what comes is thrown away
        self.discarded_all = False  # and its body has all come
        self.closed = False
        self.paused = False
        self.unparsed = b""  # received past the last request that could be held (PIPELINED): fed as answers go
        self.failed = False  # a request that cannot be parsed: nothing after it is read
        self.last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # -- the connection --------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.peer = f"http:{peer[0]}:{peer[1]}"
        self.server.connections.add(self)
        self._close_in(IDLE_TIMEOUT_S)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        if self.answering is not None:
            self.answering.cancel()

    def data_received(self, data: bytes) -> None:
        if self.closed or self.failed:
            return
        self.last_read = asyncio.get_running_loop().time()
        if self.discarding:
            self._discard(data)
        else:
            self._feed(self.unparsed + data if self.unparsed else data)

    def _discard(self, data) -> None:
        """Answered from its headers: what follows is parsed only to see its body end."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            pass

    def _feed(self, data: bytes) -> None:
        """Feed llhttp a request at a time, and nothing past the one that makes ``PIPELINED``
        wait: llhttp cannot be paused from Python, so a piece holding many requests (each
        perhaps inflating to ``max_body``) would otherwise all be parsed, and held, at once.
        What is not fed waits in ``unparsed`` (reading paused) until answers drain."""
        self.unparsed = b""
        view, start, end = memoryview(data), 0, len(data)
        while start < end:
            if len(self.waiting) >= PIPELINED:
                self.unparsed = data[start:]
                if not self.paused:
                    self.paused = True
                    self.transport.pause_reading()
                return
            stop = self._piece_end(data, start)
            if not self._parse(view[start:stop]) or self.closed:
                return
            if self.discarding:
                self._discard(view[stop:])
                return
            start = stop

    def _piece_end(self, data: bytes, start: int) -> int:
        """Where the next piece to feed ends: at the end of a head, of a Content-Length body
        or of a chunked body's line, so that at most one request completes per piece."""
        request = self.request
        if request is None or not request.method:
            found = data.find(b"\r\n\r\n", start)
            return len(data) if found < 0 else found + 4
        if request.chunked:
            found = data.find(b"\r\n", start)
            return len(data) if found < 0 else found + 2
        return min(len(data), start + max(1, request.length - request.wire_bytes))

    def _parse(self, piece: memoryview) -> bool:
        """Feed one piece; False once the connection is failed."""
        if self._in_headers():
            self.header_bytes += len(piece)  # reset once they are complete, perhaps in this piece
        try:
            self.parser.feed_data(piece)
        except httptools.HttpParserUpgrade:  # refused from its headers (400): nothing after it is read
            self.discarded_all = True
            if self.answering is None:
                self.close()
            return False
        except httptools.HttpParserError as exc:
            if not self.discarding:
                self._fail(f"a request that cannot be parsed: {exc}")
            return False
        if self._in_headers() and self.header_bytes > MAX_HEADER_BYTES:
            self._fail(f"a request line and headers over {MAX_HEADER_BYTES} bytes")
            return False
        return True

    def _in_headers(self) -> bool:
        return self.request is None or not self.request.method

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    end_now = close  # the listener stopping

    def _close_in(self, seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._on_timer)

    def _on_timer(self) -> None:
        """The idle timer: a head must be complete within ``IDLE_TIMEOUT_S``; a body must
        not go ``IDLE_TIMEOUT_S`` without a byte (answered 408, not counted as a refusal:
        the client stopped sending, its body was not judged)."""
        self._timer = None
        request = self.request
        if self.closed or request is None or not request.method or self.discarding or self.answering is not None:
            self.close()
            return
        quiet = asyncio.get_running_loop().time() - self.last_read
        if quiet < IDLE_TIMEOUT_S:
            self._close_in(IDLE_TIMEOUT_S - quiet)
            return
        self._write(408, rpc_status(_INVALID_ARGUMENT, f"no body bytes for {IDLE_TIMEOUT_S:g} s"), keep_alive=False)
        self.close()

    def _fail(self, message: str) -> None:
        """A request that cannot be parsed: 400 and close, once the requests before it
        are answered (in order); nothing after it is read."""
        self.failed = True
        self.unparsed = b""
        failure = _Request()
        failure.refusal = BodyRefused("malformed", message)
        failure.keep_alive = False
        if self.answering is None and not self.waiting:  # nothing before it to answer first
            self._write(*self._refuse(failure.refusal), keep_alive=False)
            self.close()
            return
        self.waiting.append(failure)

    # -- llhttp's callbacks ------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.request = _Request()

    def on_url(self, url: bytes) -> None:
        self.request.head_bytes += len(url)
        if self.request.head_bytes <= MAX_HEADER_BYTES:
            self.request.path += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.request.head_bytes += len(name) + len(value)
        name = name.lower()
        if name == b"content-type":
            self.request.content_type = value.decode("latin-1").split(";")[0].strip().lower()
        elif name == b"content-encoding":
            self.request.encoding = value.strip().lower()
        elif name == b"content-length" and value.strip().isdigit():
            self.request.length = int(value)
        elif name == b"transfer-encoding":
            self.request.chunked = True  # llhttp refuses any coding but chunked, last

    def on_headers_complete(self) -> None:
        if self.discarding:  # after a request answered with "Connection: close": thrown away, not answered
            return
        request, parser = self.request, self.parser
        request.method = parser.get_method()
        request.keep_alive = parser.should_keep_alive()
        self.header_bytes = 0
        path = request.path.split(b"?", 1)[0]
        if parser.should_upgrade():  # llhttp would not hand over its body, nor anything after it
            request.refusal = BodyRefused("malformed", "a protocol upgrade, which this receiver does not take")
        elif request.head_bytes > MAX_HEADER_BYTES:
            request.refusal = BodyRefused("malformed", f"a request line and headers over {MAX_HEADER_BYTES} bytes")
        elif path not in PATHS:
            request.status = 404
        elif request.method != b"POST":
            request.status = 405
        elif request.content_type != PROTOBUF:
            request.refusal = BodyRefused("unsupported_media_type", f"Content-Type {request.content_type or 'missing'}:"
                                          f" this receiver takes {PROTOBUF} only")
        elif request.length > self.server.max_body:
            request.refusal = BodyRefused("too_large", f"a body of {request.length} bytes, over {self.server.max_body}")
        elif request.encoding not in (b"", b"identity") and request.encoding not in _WBITS:
            request.refusal = BodyRefused("unsupported_media_type", f"Content-Encoding "
                                          f"{request.encoding.decode('latin-1')}: gzip, deflate or none")
        elif request.encoding in _WBITS:
            request.inflater = zlib.decompressobj(_WBITS[request.encoding])
        if request.status or request.refusal is not None:
            # Answered now, from its headers: its body (perhaps huge) is never kept.
            self.discarding = True
            request.keep_alive = False
            self._queue(request)  # the linger starts once it is written (_answer_all)

    def on_body(self, chunk: bytes) -> None:
        request = self.request
        request.wire_bytes += len(chunk)
        if self.discarding or request.refusal is not None:
            return
        if request.inflater is not None:
            chunk = self._inflate(request, chunk)
            if chunk is None:
                return
        request.size += len(chunk)
        if request.size > self.server.max_body:
            request.refusal = BodyRefused("too_large", f"a body over {self.server.max_body} bytes"
                                          + (" (after content decoding)" if request.inflater else ""))
            request.parts = []
            return
        request.parts.append(chunk)

    def _inflate(self, request: _Request, chunk: bytes) -> bytes | None:
        room = self.server.max_body - request.size + 1
        try:
            out = request.inflater.decompress(chunk, room)
        except zlib.error as exc:
            request.refusal = BodyRefused("malformed", f"a body that cannot be read: {exc}")
            request.parts = []
            return None
        if request.inflater.unconsumed_tail:  # it inflates past the cap: stop here, a bomb is never inflated
            out += b"\0" * room
        return out

    def on_message_complete(self) -> None:
        request, self.request = self.request, None
        if self.discarding:  # answered from its headers; its body has been read and thrown away
            self.discarded_all = True
            if self.answering is None:
                self.close()
            return
        if self._timer is not None:  # the idle timer runs until a request has all come
            self._timer.cancel()
            self._timer = None
        if request.refusal is None and request.inflater is not None:
            if not request.inflater.eof:
                request.refusal = BodyRefused("malformed", "a body that cannot be read: its compressed stream is cut"
                                              " short")
            elif request.inflater.unused_data:  # a second gzip member, or junk: refused, never taken in part
                request.refusal = BodyRefused("malformed", "a body that cannot be read: bytes after the end of its"
                                              " compressed stream")
                request.parts = []
        if self.answering is None and not self.waiting and self.server.take_now is not None \
                and request.size <= self.server.take_now_bytes:
            self._answer_now(request)
            return
        self._queue(request)

    # -- answering -------------------------------------------------------------------
    def _queue(self, request: _Request) -> None:
        self.waiting.append(request)
        if self.answering is None:
            self.answering = asyncio.get_running_loop().create_task(self._answer_all())

    async def _answer_all(self) -> None:
        while self.waiting and not self.closed:
            request = self.waiting.popleft()
            self._reply(request, await self._answer(request))
            if self.unparsed and not self.closed:
                self._feed(self.unparsed)  # may queue more, answered in this loop
        self.answering = None
        if self.discarding and self.discarded_all:
            self.close()
        elif self.discarding and not self.closed:
            self._close_in(LINGER_S)  # the answer from headers is written: its client has this long to read it
        if self.paused and not self.closed and not self.unparsed:
            self.paused = False
            self.transport.resume_reading()
        if not self.closed and not self.discarding:
            self._close_in(IDLE_TIMEOUT_S)  # for the next head, or the rest of a body begun

    async def _answer(self, request: _Request) -> tuple[int, bytes]:
        answer = self._judged(request)
        if answer is not None:
            return answer
        try:
            await self.server.take(_body(request), self.peer)
        except Exception as exc:
            return self._not_taken(exc)
        return 200, b""

    def _answer_now(self, request: _Request) -> None:
        """As ``_answer_all`` for one request, from llhttp's callback (``take_now``)."""
        answer = self._judged(request)
        if answer is None:
            try:
                self.server.take_now(_body(request), self.peer)
                answer = 200, b""
            except Exception as exc:
                answer = self._not_taken(exc)
        self._reply(request, answer)
        if not self.closed:
            self._close_in(IDLE_TIMEOUT_S)  # cancelled by the next request's headers

    def _judged(self, request: _Request) -> tuple[int, bytes] | None:
        """The answer decided before its body is taken: from its headers, or a refusal as it came."""
        if request.status:
            return request.status, b""
        if request.refusal is not None:
            return self._refuse(request.refusal)
        return None

    def _not_taken(self, exc: Exception) -> tuple[int, bytes]:
        """The answer when ``take`` raised: a refusal, or a fault of ours, answered (the
        exporter retries), never a hung client. Called in the ``except`` (it logs the trace)."""
        if isinstance(exc, BodyRefused):
            return self._refuse(exc)
        log.exception("engine spans from %s could not be taken", self.peer)
        return 500, rpc_status(_INTERNAL, "the receiver failed to take this request")

    def _reply(self, request: _Request, answer: tuple[int, bytes]) -> None:
        self._write(*answer, keep_alive=request.keep_alive)
        if not request.keep_alive and not self.discarding:  # one answered from its headers lingers for its body
            self.close()

    def _refuse(self, refusal: BodyRefused) -> tuple[int, bytes]:
        self.server.refused(refusal, self.peer)
        return _refusal_answer(refusal)

    def _write(self, status: int, body: bytes, keep_alive: bool) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        head = [b"HTTP/1.1 %d %s" % (status, reason_phrase(status)),
                b"Content-Type: " + PROTOBUF.encode(), b"Content-Length: %d" % len(body)]
        if status == 405:
            head.append(b"Allow: POST")
        if not keep_alive:
            head.append(b"Connection: close")
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)


def _body(request: _Request) -> bytes:
    body = b"".join(request.parts)
    request.parts = []
    return body


def _refusal_answer(refusal: BodyRefused) -> tuple[int, bytes]:
    status, code = STATUS[refusal.reason]
    return status, rpc_status(code, str(refusal))

