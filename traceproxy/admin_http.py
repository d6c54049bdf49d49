"""The admin listener's HTTP server: HTTP/1.1 on asyncio and llhttp (``httptools``), for a
few read-only ``GET`` routes, each answered by a coroutine.

Why not aiohttp's server, as before: importing ``aiohttp.web`` made about 15 MB of a
proxy process of about 45 (``docs/decisions/0031-admin-server.md``), for three routes
without a request body, read a few times a minute by Prometheus and ``traceproxy top``.

Theory of operation
-------------------
One ``_Connection`` per client connection; llhttp calls back as it parses. A complete
request is queued, and the queue is answered in order, one request at a time, by one
task per connection (a route may wait on the service's workers). ``GET`` and ``HEAD``
are served on a route's path (the query is ignored), any other method is 405 with an
``Allow``, any other path 404. A route raising is logged and answered 500.

Bounds: a request head over ``MAX_HEAD_BYTES``, 431; a request body (a ``GET`` needs
none) over ``MAX_BODY_BYTES``, 413; bytes llhttp cannot parse, 400. Each of those is
answered after the answers to the requests before it, and the connection is then
closed. A request asking for a protocol upgrade is answered as any other, without
upgrading, and the connection closed after it (llhttp parses nothing past it); a
``CONNECT``, which has no route here, is 400. A connection with no complete request head for
``IDLE_TIMEOUT_S`` after it opens or after its last answer (aiohttp's keep-alive
timeout) is closed. At most ``PIPELINED`` parsed requests wait; past that, reading pauses
until answers drain.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable

import httptools

log = logging.getLogger("traceproxy.admin")

# A route: what the client accepts (its Accept header, "" without one) -> status, content type, body.
Route = Callable[[str], Awaitable[tuple[int, str, bytes]]]

MAX_HEAD_BYTES = 64 << 10
MAX_BODY_BYTES = 64 << 10
IDLE_TIMEOUT_S = 75.0
PIPELINED = 8
SERVED_METHODS = (b"GET", b"HEAD")
_REASON = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           413: "Payload Too Large", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
           503: "Service Unavailable"}
_TEXT = "text/plain; charset=utf-8"


class AdminHttpServer:
    """``routes``: path (bytes, without the query) -> ``Route``."""

    def __init__(self, routes: dict[bytes, Route]) -> None:
        self.routes = routes
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()

    async def start(self, host: str, port: int) -> int:
        """Listens; the port bound (``port`` 0 asks for any)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for connection in list(self._connections):
            connection.close()
        await self._server.wait_closed()
        self._server = None


class _Request:
    __slots__ = ("method", "path", "accept", "keep_alive", "refusal")

    def __init__(self, method: bytes, path: bytes, accept: str, keep_alive: bool,
                 refusal: tuple[int, str] | None = None) -> None:
        self.method, self.path, self.accept, self.keep_alive = method, path, accept, keep_alive
        self.refusal = refusal  # (status, reason): answered as it is, then the connection closes


class _Connection(asyncio.Protocol):
    def __init__(self, server: AdminHttpServer) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.queue: deque[_Request] = deque()
        self.answering: asyncio.Task | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.reading = True
        self.closed = False
        self.refused = False  # a refusal is queued: nothing after it is parsed
        self.last_queued: _Request | None = None
        self._reset_request()

    def _reset_request(self) -> None:
        self.in_head = False
        self.head_bytes = 0
        self.url = b""
        self.accept = ""
        self.body_bytes = 0

    # -- the connection -----------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server._connections.add(self)
        self._wait_for_a_request()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.server._connections.discard(self)
        self._stop_idle_timer()
        if self.answering is not None and not self.answering.done():
            self.answering.cancel()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.close()

    def _wait_for_a_request(self) -> None:
        """Nothing asked and nothing to answer: the next request head must come in time."""
        self._stop_idle_timer()
        self.idle_timer = asyncio.get_running_loop().call_later(IDLE_TIMEOUT_S, self.close)

    def _stop_idle_timer(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None

    # -- parsing --------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.closed or self.refused:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._upgrade_asked()
        except httptools.HttpParserError:
            if not self.refused:  # a bound hit in a callback has already said why
                self._refuse(400, "malformed request")
        if self.in_head and not self.refused:
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES:
                self._refuse(431, f"request head over {MAX_HEAD_BYTES} bytes")

    def on_message_begin(self) -> None:
        self._reset_request()
        self.in_head = True
        self.last_queued = None  # this message's request, once it is complete

    def on_url(self, url: bytes) -> None:
        self.url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value))
        if name.lower() == b"accept":
            self.accept = value.decode("latin-1")

    def _count_head(self, size: int) -> None:
        # A head that arrives whole in one read is only counted here; one that is still
        # arriving is counted in data_received too, before llhttp has handed any of it over.
        self.head_bytes += size
        if self.head_bytes > MAX_HEAD_BYTES and not self.refused:
            self._refuse(431, f"request head over {MAX_HEAD_BYTES} bytes")
            raise httptools.HttpParserError("head over the bound")  # stop parsing what follows

    def on_headers_complete(self) -> None:
        self.in_head = False

    def on_body(self, chunk: bytes) -> None:
        self.body_bytes += len(chunk)
        if self.body_bytes > MAX_BODY_BYTES and not self.refused:
            self._refuse(413, f"request body over {MAX_BODY_BYTES} bytes")
            raise httptools.HttpParserError("body over the bound")  # stop parsing what follows

    def on_message_complete(self) -> None:
        if self.refused:
            return
        try:
            path = httptools.parse_url(self.url).path or b"/"
        except httptools.HttpParserInvalidURLError:
            self._refuse(400, "malformed request target")
            return
        self.last_queued = _Request(self.parser.get_method(), path, self.accept, self.parser.should_keep_alive())
        self._queue(self.last_queued)

    def _upgrade_asked(self) -> None:
        """llhttp stops at a request asking to upgrade: answered as it is (when it was
        complete; a CONNECT is not), the connection then closes."""
        self.refused = True  # nothing after it is parsed
        if self.last_queued is not None:
            self.last_queued.keep_alive = False
        else:
            self._refuse(400, "CONNECT is not served here")

    def _refuse(self, status: int, reason: str) -> None:
        """Answered after the requests before it; the connection then closes."""
        self.refused = True
        self._queue(_Request(b"", b"", "", False, refusal=(status, reason)))

    def _queue(self, request: _Request) -> None:
        self._stop_idle_timer()  # a request in hand: the wait is the answer's now
        self.queue.append(request)
        if len(self.queue) > PIPELINED and self.reading:
            self.reading = False
            self.transport.pause_reading()
        if self.answering is None or self.answering.done():
            self.answering = asyncio.get_running_loop().create_task(self._answer_all())

    # -- answering ------------------------------------------------------------------
    async def _answer_all(self) -> None:
        while self.queue and not self.closed:
            request = self.queue.popleft()
            status, content_type, body, headers = await self._answer(request)
            self._write(request, status, content_type, body, headers)
            if not request.keep_alive:
                self.close()
                return
            if not self.reading and len(self.queue) <= PIPELINED:
                self.reading = True
                self.transport.resume_reading()
        if not self.closed:
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
        head = (f"HTTP/1.1 {status} {_REASON.get(status, 'Unknown')}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n").encode("latin-1") + headers
        if not request.keep_alive:
            head += b"Connection: close\r\n"
        self.transport.write(head + b"\r\n" + (b"" if request.method == b"HEAD" else body))
