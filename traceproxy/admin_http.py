"""The admin listener's HTTP server: HTTP/1.1 on asyncio and llhttp (``httptools``), for a
few read-only ``GET`` routes, each answered by a coroutine.

Why not aiohttp's server, as before: importing ``aiohttp.web`` made about 15 MB of a
proxy process of about 45 (``docs/decisions/0031-admin-server.md``), for three routes
without a request body, read a few times a minute by Prometheus and ``traceproxy top``.

Theory of operation
-------------------
One ``_Connection`` per client connection. What it reads is fed to llhttp a slice
(``FEED_SLICE``) at a time, and only while fewer than ``PIPELINED`` parsed requests wait
for their answer; the rest of a read waits, unparsed, with reading paused. A complete
request is queued; the queue is answered in order, one request at a time, by one task
per connection (a route may wait on the service's workers), which lets the loop run
between two answers: in one process the admin listener shares the proxy's loop, and a
client pipelining thousands of requests in one write must not hold it.

``GET`` and ``HEAD`` are served on a route's path (percent-decoded; the query is
ignored); another method is 405 with an ``Allow``, another path 404, ``CONNECT`` 400. A route raising is logged
and answered 500. A request asking for a protocol upgrade is answered as any other,
without upgrading, and the connection closed after it (llhttp parses nothing past it).
``Expect: 100-continue`` gets the final answer at once, without reading the body, and
the connection is closed after it.

Bounds, each answered and the connection then closed: a request head over
``MAX_HEAD_BYTES`` (its line and fields, counted exactly once complete; one still
arriving, by the bytes fed), 431; a body over ``MAX_BODY_BYTES``, or a whole request
(chunk framing and trailers included) over both together, 413; bytes llhttp cannot
parse, 400. After such a refusal the connection is closed for writing and what the
client still sends is read and thrown away for up to ``LINGER_S`` (so it reads the
answer, not a reset). A connection with no complete request head for ``IDLE_TIMEOUT_S``
after it opens or after its last answer (aiohttp's keep-alive timeout) is closed. A
client that stops reading its answers: nothing more is answered or read, and after
``IDLE_TIMEOUT_S`` of that the connection is aborted; so is one whose answers are still
unsent that long after it was closed. A client that half-closes still gets its answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from urllib.parse import unquote_to_bytes

import httptools

from .observe.listener import ConnectionListener
from .reason_phrases import reason_phrase

log = logging.getLogger("traceproxy.admin")

# A route: what the client accepts (its Accept header, "" without one) -> status, content type, body.
Route = Callable[[str], Awaitable[tuple[int, str, bytes]]]

MAX_HEAD_BYTES = 64 << 10
MAX_BODY_BYTES = 64 << 10
IDLE_TIMEOUT_S = 75.0
LINGER_S = 2.0
PIPELINED = 8
FEED_SLICE = 4096
# A head still arriving is judged by the slices fed while it did: one slice of the
# request before it may be among them, and one of what follows.
_HEAD_FED_BOUND = MAX_HEAD_BYTES + 2 * FEED_SLICE
_MESSAGE_FED_BOUND = MAX_HEAD_BYTES + MAX_BODY_BYTES + 2 * FEED_SLICE
SERVED_METHODS = (b"GET", b"HEAD")
_TEXT = "text/plain; charset=utf-8"


class AdminHttpServer(ConnectionListener):
    """``routes``: path (bytes, without the query) -> ``Route``."""

    def __init__(self, routes: dict[bytes, Route]) -> None:
        super().__init__(_Connection)
        self.routes = routes


class _Request:
    __slots__ = ("method", "path", "accept", "keep_alive", "http_1_0", "refusal")

    def __init__(self, method: bytes, path: bytes, accept: str, keep_alive: bool, http_1_0: bool = False,
                 refusal: tuple[int, str] | None = None) -> None:
        self.method, self.path, self.accept, self.keep_alive = method, path, accept, keep_alive
        self.http_1_0 = http_1_0
        self.refusal = refusal  # (status, reason): answered as it is, then the connection closes


class _Connection(asyncio.Protocol):
    def __init__(self, server: AdminHttpServer) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.queue: deque[_Request] = deque()
        self.answering: asyncio.Task | None = None
        self.unfed = bytearray()  # read, not yet parsed: PIPELINED requests wait already
        self.idle_timer: asyncio.TimerHandle | None = None
        self.write_timer: asyncio.TimerHandle | None = None
        self.writable = asyncio.Event()
        self.writable.set()
        self.reading = True
        self.eof = False  # the client half-closed: answer what it asked, then close
        self.closed = False
        self.parsing = True  # False after a refusal or an upgrade: nothing more is parsed
        self.lingering = False  # a refusal was answered: what still comes is thrown away
        self.in_message = False
        self.fed_in_message = 0  # bytes of the slices fed while the current request was parsed
        self._reset_request()

    def _reset_request(self) -> None:
        self.in_head = False
        self.head_bytes = 0  # the request line's target and the fields, as llhttp hands them over
        self.url = b""
        self.accept = ""
        self.expect_continue = False
        self.body_bytes = 0
        self.this_request: _Request | None = None

    # -- the connection -----------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        self._wait_for_a_request()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self._stop_idle_timer()
        if self.write_timer is not None:
            self.write_timer.cancel()
        self.writable.set()  # an answer waiting to be written ends (the queue is dropped)
        if self.answering is not None and not self.answering.done():
            self.answering.cancel()

    def close(self) -> None:
        """Closed once its answers are written; aborted if the client does not take them in time."""
        if self.closed:
            return
        self.closed = True
        self.transport.close()
        if self.transport.get_write_buffer_size():
            self._arm_write_timer()

    def abort(self) -> None:
        self.closed = True
        self.transport.abort()

    end_now = abort  # the listener stopping: answers still unsent are not waited for

    def eof_received(self) -> bool:
        self.eof = True
        if not self.queue and not self._answering():
            self.close()
        return True  # keep our side open for the answers still owed

    def pause_writing(self) -> None:
        # The client does not read its answers: answer and read nothing more until it
        # does, and not forever.
        self.writable.clear()
        self._set_reading(False)
        self._arm_write_timer()

    def resume_writing(self) -> None:
        self.writable.set()
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None
        self._resume_reading()

    def _arm_write_timer(self) -> None:
        if self.write_timer is None:
            self.write_timer = asyncio.get_running_loop().call_later(IDLE_TIMEOUT_S, self.abort)

    def _answering(self) -> bool:
        return self.answering is not None and not self.answering.done()

    def _wait_for_a_request(self) -> None:
        """Nothing asked and nothing to answer: the next request head must come in time."""
        self._stop_idle_timer()
        self.idle_timer = asyncio.get_running_loop().call_later(IDLE_TIMEOUT_S, self.close)

    def _stop_idle_timer(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None

    def _set_reading(self, reading: bool) -> None:
        if self.reading != reading and not self.closed:
            self.reading = reading
            (self.transport.resume_reading if reading else self.transport.pause_reading)()

    def _resume_reading(self) -> None:
        if self.closed or not self.writable.is_set() or len(self.queue) >= PIPELINED:
            return
        if self.unfed:
            self._feed(b"")
        if not self.unfed and len(self.queue) < PIPELINED:
            self._set_reading(True)

    # -- parsing --------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self.lingering or not self.parsing:
            return  # thrown away: a refusal was answered, or nothing past an upgrade is parsed
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        unfed = self.unfed
        unfed += data
        while unfed and self.parsing and len(self.queue) < PIPELINED:
            piece = bytes(unfed[:FEED_SLICE])
            del unfed[:FEED_SLICE]
            try:
                self.parser.feed_data(piece)
            except httptools.HttpParserUpgrade:
                self._upgrade_asked()
            except httptools.HttpParserError:
                if self.parsing:  # a bound hit in a callback has already said why
                    self._refuse(400, "malformed request")
            if self.in_message and self.parsing:
                self._count_fed(len(piece))
        if unfed and self.parsing:
            self._set_reading(False)
        elif not self.parsing:
            unfed.clear()

    def _count_fed(self, size: int) -> None:
        # Chunk framing, extensions and trailers reach no callback, and httptools gathers
        # a field's value in memory until it ends: what is fed is counted too.
        self.fed_in_message += size
        if self.in_head and self.fed_in_message > _HEAD_FED_BOUND:
            self._refuse(431, f"request head over {MAX_HEAD_BYTES} bytes")
        elif self.fed_in_message > _MESSAGE_FED_BOUND:
            self._refuse(413, f"request over {MAX_HEAD_BYTES + MAX_BODY_BYTES} bytes")

    def on_message_begin(self) -> None:
        self._reset_request()
        self.in_head = True
        self.in_message = True
        self.fed_in_message = 0

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_bytes += len(name) + len(value) + 4  # ": " and CRLF
        lowered = name.lower()
        if lowered == b"accept":
            self.accept = value.decode("latin-1")
        elif lowered == b"expect" and value.strip().lower() == b"100-continue":
            self.expect_continue = True

    def on_headers_complete(self) -> None:
        self.in_head = False
        if self.head_bytes > MAX_HEAD_BYTES:
            self._refuse(431, f"request head over {MAX_HEAD_BYTES} bytes")
            raise httptools.HttpParserError("head over the bound")  # stop parsing what follows
        if self.expect_continue:
            # Answered now, body unread (no route takes one), and the connection closed after it.
            self._take_request(keep_alive=False)
            self.parsing = False
            raise httptools.HttpParserError("answered before its body")

    def on_body(self, chunk: bytes) -> None:
        self.body_bytes += len(chunk)
        if self.body_bytes > MAX_BODY_BYTES and self.parsing:
            self._refuse(413, f"request body over {MAX_BODY_BYTES} bytes")
            raise httptools.HttpParserError("body over the bound")  # stop parsing what follows

    def on_message_complete(self) -> None:
        self.in_message = False
        if self.parsing:
            self._take_request(keep_alive=self.parser.should_keep_alive())

    def _take_request(self, keep_alive: bool) -> None:
        method = self.parser.get_method()
        if method == b"CONNECT":
            self._refuse(400, "CONNECT is not served here")
            return
        try:
            # Percent-decoded, as aiohttp matched routes: /%6Detrics is /metrics.
            path = unquote_to_bytes(httptools.parse_url(self.url).path or b"/")
        except httptools.HttpParserInvalidURLError:
            self._refuse(400, "malformed request target")
            return
        self.this_request = _Request(method, path, self.accept, keep_alive, self.parser.get_http_version() == "1.0")
        self._queue(self.this_request)

    def _upgrade_asked(self) -> None:
        """llhttp stops at a request asking to upgrade: answered as it is (it was complete),
        the connection then closes."""
        self.parsing = False
        if self.this_request is not None:
            self.this_request.keep_alive = False

    def _refuse(self, status: int, reason: str) -> None:
        """Answered after the requests before it; the connection then closes."""
        self.parsing = False
        self._queue(_Request(b"", b"", "", False, refusal=(status, reason)))

    def _queue(self, request: _Request) -> None:
        self._stop_idle_timer()  # a request in hand: the wait is the answer's now
        self.queue.append(request)
        if not self._answering():
            self.answering = asyncio.get_running_loop().create_task(self._answer_all())

    # -- answering ------------------------------------------------------------------
    async def _answer_all(self) -> None:
        while self.queue and not self.closed:
            await self.writable.wait()
            if self.closed:
                return
            request = self.queue.popleft()
            status, content_type, body, headers = await self._answer(request)
            if self.closed:
                return
            self._write(request, status, content_type, body, headers)
            if request.refusal is not None:
                self._linger()
                return
            if not request.keep_alive:
                self.close()
                return
            self._resume_reading()
            await asyncio.sleep(0)  # one answer at a time: the loop may be the proxy's
        if self.closed:
            return
        if self.eof and not self.unfed:
            self.close()
        elif not self.queue:
            self._wait_for_a_request()

    async def _answer(self, request: _Request) -> tuple[int, str, bytes, bytes]:
        if request.refusal is not None:
            status, reason = request.refusal
            return status, _TEXT, f"{status}: {reason}\n".encode(), b""
        route = self.server.routes.get(request.path)
        if route is None:
            return 404, _TEXT, b"404: Not Found\n", b""
        if request.method not in SERVED_METHODS:
            return 405, _TEXT, b"405: Method Not Allowed\n", b"Allow: GET, HEAD\r\n"
        try:
            status, content_type, body = await route(request.accept)
        except asyncio.CancelledError:
            raise
        except Exception:  # a route's fault must not leave the client without an answer
            log.exception("admin %s failed", request.path.decode("latin-1"))
            return 500, _TEXT, b"500: Internal Server Error\n", b""
        return status, content_type, body, b""

    def _write(self, request: _Request, status: int, content_type: str, body: bytes, headers: bytes) -> None:
        head = b"HTTP/1.1 %d %s\r\n" % (status, reason_phrase(status)) + (
            f"Date: {formatdate(usegmt=True)}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        ).encode("latin-1") + headers
        if not request.keep_alive:
            head += b"Connection: close\r\n"
        elif request.http_1_0:
            head += b"Connection: keep-alive\r\n"  # an HTTP/1.0 client closes unless told
        self.transport.write(head + b"\r\n" + (b"" if request.method == b"HEAD" else body))

    def _linger(self) -> None:
        """After a refusal: our side is closed once the answer is written, and what the
        client still sends is thrown away for a while, so that it reads the answer rather
        than a reset."""
        self.lingering = True
        self.unfed.clear()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._set_reading(True)  # to throw away
        asyncio.get_running_loop().call_later(LINGER_S, self.close)
