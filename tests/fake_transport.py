"""Fake transports: the proxy's protocols driven with reads the test chooses.

Over real sockets a test cannot choose where one read ends: TCP merges small
writes, so a head meant to arrive in two reads often arrives in one, and the code
that accounts for a head, a chunk size or a trailer spanning reads goes untested.
Here the test calls the protocols' asyncio callbacks itself (``connection_made``,
``data_received``), one call per read, and reads back exactly what the proxy wrote
to each side.

The seam
--------
The client side needs none: a ``ClientConnection`` is built on a ``ServerContext``
and given a ``FakeTransport`` in ``connection_made``, as ``create_server`` would.
The upstream side is reached through the event loop, the one thing the pool asks
for a connection: ``FakeNetworkLoop`` is an asyncio loop whose ``create_connection``
builds the protocol the pool gives it and hands it a ``FakeTransport`` (in
``connection_made``, before the connect returns, as uvloop does). Nothing in
``traceproxy.proxy`` is patched.

The loop is a real one (the proxy arms timers and starts connect tasks on it), with
its clock held still (``FakeNetworkLoop.now``): no timer ever comes due, so no
timeout interferes with a test of read boundaries, and nothing depends on how fast
the machine is. No network socket is opened (the loop's own wake-up pipe is its
only descriptor pair).

What a fake transport does not have
-----------------------------------
``get_extra_info("socket")`` is None: ``proxy.sockets`` then knows no unsent queue
(None), sees no hang-up, and a reset is a plain ``abort``. A write is taken at once
(the write buffer stays empty), so ``pause_writing`` comes only when a test calls it.
Reads arriving while reading is paused are held, each as its own read, and
delivered in order on the loop turn after ``resume_reading``: the boundaries the
test chose are kept (over TCP they might merge; that is another schedule).
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Callable

from traceproxy.config import default_settings
from traceproxy.lifecycle.hooks import Fanout
from traceproxy.lifecycle.timeline import RequestRecord
from traceproxy.proxy.context import ServerContext
from traceproxy.proxy.downstream import ClientConnection

CLIENT_ADDRESS = ("192.0.2.10", 50123)  # TEST-NET-1: never a real peer
PROXY_ADDRESS = ("192.0.2.1", 8080)
UPSTREAM_URL = "http://engine.test:9"  # never connected to: the loop fakes every connect

# At most this many loop passes run after each step of a test, stopping at the first
# with nothing left to run. A step needs few: a connect task's first step, its done
# callback, a connection_lost scheduled by close(), reads held during a pause.
SETTLE_PASSES = 20


class RecordingTransport:
    """The least a protocol outside the proxy writes to (the bench's client and sinks): what
    was written, and whether it was closed or aborted. Not a loop's, and no peer."""

    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def get_extra_info(self, name, default=None):
        return default

    def close(self) -> None:
        self.closed = True

    abort = close

    def is_closing(self) -> bool:
        return self.closed


class FakeTransport(asyncio.Transport):
    """One connection as the proxy sees it; records everything the proxy does to it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, protocol: asyncio.Protocol,
                 peername: tuple[str, int], sockname: tuple[str, int]) -> None:
        super().__init__()
        self._loop = loop
        self.protocol = protocol
        self.peername, self.sockname = peername, sockname
        self.written = bytearray()  # every byte written, in order
        self.calls: list[str] = []  # close, abort, write_eof, pause_reading, resume_reading, in order
        self.closing = False
        self.lost = False  # connection_lost was called
        self.reading_paused = False
        self._held: list[bytes] = []  # reads that came while reading was paused

    # -- what the proxy calls ---------------------------------------------------
    def get_extra_info(self, name: str, default=None):
        return {"peername": self.peername, "sockname": self.sockname}.get(name, default)

    def write(self, data: bytes) -> None:
        if not self.closing:  # after close, dropped (asyncio drops them too)
            self.written += data

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.calls.append("write_eof")

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self._shut("close")

    def abort(self) -> None:
        self._shut("abort")

    def pause_reading(self) -> None:
        self.calls.append("pause_reading")
        self.reading_paused = True

    def resume_reading(self) -> None:
        self.calls.append("resume_reading")
        self.reading_paused = False
        if self._held:
            self._loop.call_soon(self._deliver_held)

    # -- what the peer does -----------------------------------------------------
    def deliver(self, data: bytes) -> None:
        """``data`` arrives as one read (held while reading is paused; dropped once closed)."""
        if self.closing:
            return
        if self.reading_paused or self._held:
            self._held.append(data)
            return
        self.protocol.data_received(data)

    # -- internals ---------------------------------------------------------------
    def _deliver_held(self) -> None:
        while self._held and not self.reading_paused and not self.closing:
            self.protocol.data_received(self._held.pop(0))

    def _shut(self, how: str) -> None:
        self.calls.append(how)
        if not self.closing:
            self.closing = True
            self._loop.call_soon(self._lose, None)  # as asyncio: connection_lost on a later pass

    def _lose(self, exc: Exception | None) -> None:
        if not self.lost:
            self.lost = True
            self.protocol.connection_lost(exc)


class FakeNetworkLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock stands still, and whose outgoing connections are fake
    transports (kept in ``connections``, in the order they were opened)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        self.connections: list[FakeTransport] = []

    def time(self) -> float:
        return self.now

    async def settle(self) -> None:
        """Let the loop run what the last step scheduled (``_ready``: asyncio's queue of
        callbacks due on the next pass; timers are not in it until the clock moves)."""
        for _ in range(SETTLE_PASSES):
            await asyncio.sleep(0)
            if not self._ready:
                return

    async def create_connection(self, protocol_factory: Callable[[], asyncio.Protocol], host=None, port=None,
                                **_ignored):
        protocol = protocol_factory()
        sockname = ("192.0.2.1", 40000 + len(self.connections))
        transport = FakeTransport(self, protocol, peername=(host, port), sockname=sockname)
        self.connections.append(transport)
        protocol.connection_made(transport)
        return transport, protocol


class DoneRecords:
    """An observer that keeps every request record as it ends."""

    def __init__(self) -> None:
        self.records: list[RequestRecord] = []

    def on_done(self, record: RequestRecord) -> None:
        self.records.append(record)


class ProxyHarness:
    """A ``ServerContext`` and one client connection on a fake network.

    Every step (a client read, an upstream read) runs inside the loop, then lets it
    run its pending callbacks, so the proxy has done all it will do about that step
    when the call returns. Use as a context manager."""

    def __init__(self, **overrides) -> None:
        settings = _settings(tuple(sorted(overrides.items())))
        self.loop = FakeNetworkLoop()
        self.done = DoneRecords()
        self.ctx = ServerContext(settings, Fanout([self.done]))
        self.proxy = ClientConnection(self.ctx)
        self.client = FakeTransport(self.loop, self.proxy, peername=CLIENT_ADDRESS, sockname=PROXY_ADDRESS)
        self._step(self.proxy.connection_made, self.client)

    def __enter__(self) -> "ProxyHarness":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self.loop.close()

    # -- steps -------------------------------------------------------------------
    def client_sends(self, *reads: bytes) -> None:
        """Each of ``reads`` arrives at the proxy as one read from the client."""
        for data in reads:
            self._step(self.client.deliver, data)

    def upstream_sends(self, *reads: bytes, connection: int = -1) -> None:
        """Each of ``reads`` arrives as one read on an upstream connection (the newest by default)."""
        upstream = self.upstream(connection)
        for data in reads:
            self._step(upstream.deliver, data)

    # -- what happened -------------------------------------------------------------
    @property
    def upstreams(self) -> list[FakeTransport]:
        return self.loop.connections

    def upstream(self, index: int = -1) -> FakeTransport:
        assert self.loop.connections, "the proxy opened no upstream connection"
        return self.loop.connections[index]

    @property
    def outcomes(self) -> list[tuple[str, str, int | None]]:
        """(target, outcome code, status) of each ended request, in the order they ended."""
        return [(r.target, r.outcome.code, r.status) for r in self.done.records]

    def _step(self, action: Callable, *args) -> None:
        async def step() -> None:
            action(*args)
            await self.loop.settle()

        self.loop.run_until_complete(step())


@functools.lru_cache(maxsize=None)
def _settings(overrides: tuple):
    """Settings are immutable, and validating them costs more than a test step: built once per set of overrides."""
    return default_settings().replace(**{
        "upstream": UPSTREAM_URL, "tracing.exporter": "off", "access_log.path": "",
        # No connection opened ahead of demand: each test's upstream connections are
        # the ones its requests opened.
        "pool.keep_warm": 0,
        **dict(overrides),
    })


# ----------------------------------------------------------------------------------
# Reading what the proxy wrote
# ----------------------------------------------------------------------------------
# Values the proxy makes up per request (span ids, a generated request id): masked,
# so that bytes from two runs compare equal.
_MINTED = re.compile(rb"(?im)^(traceparent|traceresponse|x-request-id): [^\r\n]*")


def masked(data: bytes | bytearray) -> bytes:
    return _MINTED.sub(rb"\1: <minted>", bytes(data))


# Messages up to this long are cut at every offset. In a longer one (a head padded to
# a size limit) the cuts inside a long run of plain bytes are all alike to the code
# that counts heads: it looks at line ends, a head's start and a read's last bytes.
EVERY_OFFSET_UP_TO = 256
NEAR_LINE_END = 8
STRIDE = 61


def cut_offsets(message: bytes) -> list[int]:
    """Where to cut ``message`` in two: at every offset, or, in a long message, at every
    offset within NEAR_LINE_END bytes of a CR or LF and every STRIDE-th one elsewhere."""
    if len(message) <= EVERY_OFFSET_UP_TO:
        return list(range(1, len(message)))
    near = {at for i, byte in enumerate(message) if byte in b"\r\n"
            for at in range(i - NEAR_LINE_END, i + NEAR_LINE_END + 1)}
    return sorted(at for at in near.union(range(1, len(message), STRIDE)) if 0 < at < len(message))


def splits_in_two(message: bytes) -> list[tuple[bytes, bytes]]:
    """``message`` cut in two reads (see cut_offsets)."""
    return [(message[:at], message[at:]) for at in cut_offsets(message)]


def byte_by_byte(message: bytes) -> list[bytes]:
    return [message[i:i + 1] for i in range(len(message))]


def dechunk(data: bytes) -> tuple[bytes, bytes, bytes]:
    """A chunked body at the start of ``data``, read strictly: (its data, its trailer
    section, what follows it). Fails on anything RFC 9112 section 7.1 does not allow."""
    body, at = bytearray(), 0
    while True:
        line_end = data.find(b"\r\n", at)
        assert line_end >= 0, f"chunked body cut short at {at}: {data[-100:]!r}"
        size_text = data[at:line_end].split(b";")[0]
        assert re.fullmatch(rb"[0-9A-Fa-f]+", size_text), f"bad chunk size line {data[at:line_end]!r}"
        size, at = int(size_text, 16), line_end + 2
        if size == 0:
            end = data.find(b"\r\n\r\n", at - 2) + 4
            assert end >= 4, f"no end to the trailer section: {data[at:at + 100]!r}"
            return bytes(body), data[at:end - 2], data[end:]
        body += data[at:at + size]
        assert data[at + size:at + size + 2] == b"\r\n", f"chunk data not followed by CRLF at {at + size}"
        at += size + 2


def head_and_rest(data: bytes) -> tuple[bytes, bytes]:
    end = data.find(b"\r\n\r\n") + 4
    assert end >= 4, f"no whole head in {data[:300]!r}"
    return data[:end], data[end:]
