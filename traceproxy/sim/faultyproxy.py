"""A small HTTP/1.1 keep-alive proxy that reproduces the original hang, on purpose.

Theory of operation
-------------------
Each client connection draws a turn limit ``hang_after``: an ``int``, or a
``(low, high)`` range drawn from a seeded ``random.Random``. Turns 1..limit are
forwarded normally over one keep-alive upstream connection per client connection
(request buffered, response streamed back as it arrives, SSE included). The next
turn, which is necessarily on a *reused* client connection, is read in full and then
ignored: no response, no close; the socket stays open until the client gives up.
A fresh client connection draws a new limit and works again. That is the failure
mode of a proxy that loses track of a reused connection's next request.

Raw asyncio streams with h11 on both sides; nothing from the rest of traceproxy.
A reused upstream connection that fails before any response byte is retried once
on a fresh one, so idle closes by the upstream do not masquerade as the hang.
Every loop is bounded (turns per connection, events per message, hang time).
"""

from __future__ import annotations

import asyncio
import logging
import random
from urllib.parse import urlsplit

import h11

MAX_TURNS = 100_000
MAX_EVENTS = 1_000_000  # h11 events per message
MAX_REQUEST_BODY = 16 * 1024 * 1024
READ_SIZE = 65536
CLIENT_IDLE_TIMEOUT = 300.0
HANG_LIMIT = 3600.0
HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"upgrade",
              b"transfer-encoding", b"content-length"}

log = logging.getLogger("traceproxy.sim.faultyproxy")


class _UpstreamGone(Exception):
    """The upstream closed or broke the connection; ``started`` if response bytes had arrived."""

    def __init__(self, started: bool) -> None:
        super().__init__("upstream connection lost")
        self.started = started


class _Upstream:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.conn = h11.Connection(h11.CLIENT)
        self.turns = 0

    def close(self) -> None:
        self.writer.close()


class FaultyProxy:
    def __init__(self, upstream_url: str, hang_after: int | tuple[int, int] = (1, 3), *, host: str = "127.0.0.1",
                 port: int = 0, seed: int | None = None) -> None:
        parts = urlsplit(upstream_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be an http:// URL, not {upstream_url!r}")
        low, high = (hang_after, hang_after) if isinstance(hang_after, int) else hang_after
        if not 1 <= low <= high:
            raise ValueError(f"hang_after must be >= 1 (a range low <= high), not {hang_after!r}")
        self.upstream_host, self.upstream_port = parts.hostname, parts.port or 80
        self.hang_range = (low, high)
        self.host, self.port = host, port
        self.random = random.Random(seed)
        self.connections = 0
        self.forwarded = 0
        self.hung = 0
        self.limits: list[int] = []  # the drawn limit of each client connection, in order
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._stopping = asyncio.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> "FaultyProxy":
        self._stopping = asyncio.Event()
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            await self._server.wait_closed()
            self._server = None

    # -- one client connection -----------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        limit = self.random.randint(*self.hang_range)
        self.limits.append(limit)
        self._writers.add(writer)
        client = h11.Connection(h11.SERVER)
        upstream: _Upstream | None = None
        try:
            for turn in range(1, MAX_TURNS + 1):
                message = await self._read_request(reader, client)
                if message is None:
                    return
                if turn > limit:
                    self.hung += 1
                    log.info("connection %d turn %d: swallowing the request (limit %d)", self.connections, turn, limit)
                    await self._hang(reader)
                    return
                upstream = await self._forward(*message, client, writer, upstream)
                self.forwarded += 1
                if client.our_state is not h11.DONE or client.their_state is not h11.DONE:
                    return
                client.start_next_cycle()
        except (ConnectionError, h11.ProtocolError, asyncio.TimeoutError, _UpstreamGone) as exc:
            log.debug("client connection ends: %r", exc)
        except RuntimeError as exc:
            # stop() aborts the clients' transports; a relay's next write then meets a
            # closed one (uvloop says so with RuntimeError, asyncio with nothing at all).
            if not writer.transport.is_closing():
                raise
            log.debug("client connection ends as the proxy stops: %r", exc)
        finally:
            self._writers.discard(writer)
            if upstream is not None:
                upstream.close()
            writer.close()  # after a broken upstream response this truncates the client's copy

    async def _read_request(self, reader: asyncio.StreamReader,
                            client: h11.Connection) -> tuple[h11.Request, bytes] | None:
        request, body = None, bytearray()
        for _ in range(MAX_EVENTS):
            event = client.next_event()
            if event is h11.NEED_DATA:
                data = await asyncio.wait_for(reader.read(READ_SIZE), CLIENT_IDLE_TIMEOUT)
                client.receive_data(data)
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_REQUEST_BODY:
                    raise h11.LocalProtocolError("request body too large for the faulty proxy")
            elif isinstance(event, h11.EndOfMessage):
                return request, bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                return None
        raise h11.LocalProtocolError("request has too many parts")

    async def _hang(self, reader: asyncio.StreamReader) -> None:
        """Read and drop whatever comes, answer nothing, until the client closes (bounded)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HANG_LIMIT
        while not self._stopping.is_set() and loop.time() < deadline:
            try:
                data = await asyncio.wait_for(reader.read(READ_SIZE), 1.0)
            except asyncio.TimeoutError:
                continue
            if not data:
                return

    # -- forwarding ----------------------------------------------------------------------
    async def _forward(self, request: h11.Request, body: bytes, client: h11.Connection,
                       writer: asyncio.StreamWriter, upstream: _Upstream | None) -> _Upstream:
        for attempt in range(2):
            reused = upstream is not None
            if upstream is None:
                upstream = _Upstream(*await asyncio.open_connection(self.upstream_host, self.upstream_port))
            try:
                await self._exchange(request, body, upstream, client, writer)
                return upstream
            except _UpstreamGone as exc:
                upstream.close()
                upstream = None
                if exc.started or not reused or attempt:
                    raise
        raise AssertionError("unreachable")

    async def _exchange(self, request: h11.Request, body: bytes, upstream: _Upstream, client: h11.Connection,
                        writer: asyncio.StreamWriter) -> None:
        headers = [(k, v) for k, v in request.headers if k.lower() not in HOP_BY_HOP]
        if body or request.method in (b"POST", b"PUT", b"PATCH"):
            headers.append((b"content-length", str(len(body)).encode()))
        out = upstream.conn.send(h11.Request(method=request.method, target=request.target, headers=headers))
        if body:
            out += upstream.conn.send(h11.Data(data=body))
        out += upstream.conn.send(h11.EndOfMessage())
        try:
            upstream.writer.write(out)
            await upstream.writer.drain()
        except ConnectionError:
            raise _UpstreamGone(started=False) from None
        await self._relay_response(upstream, client, writer)
        upstream.turns += 1
        if upstream.conn.our_state is h11.DONE and upstream.conn.their_state is h11.DONE:
            upstream.conn.start_next_cycle()
        else:
            raise _UpstreamGone(started=True)

    async def _relay_response(self, upstream: _Upstream, client: h11.Connection,
                              writer: asyncio.StreamWriter) -> None:
        started = False
        for _ in range(MAX_EVENTS):
            try:
                event = upstream.conn.next_event()
                if event is h11.NEED_DATA:
                    upstream.conn.receive_data(await upstream.reader.read(READ_SIZE))
                    continue
            except (ConnectionError, h11.RemoteProtocolError):
                raise _UpstreamGone(started) from None
            if isinstance(event, h11.ConnectionClosed):
                raise _UpstreamGone(started)
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                started = True
                headers = [(k, v) for k, v in event.headers if k.lower() not in (b"connection", b"keep-alive")]
                writer.write(client.send(h11.Response(status_code=event.status_code, headers=headers,
                                                      reason=event.reason)))
            elif isinstance(event, h11.Data):
                writer.write(client.send(h11.Data(data=event.data)))
            elif isinstance(event, h11.EndOfMessage):
                writer.write(client.send(h11.EndOfMessage()))
                await writer.drain()
                return
            await writer.drain()
        raise _UpstreamGone(started)
