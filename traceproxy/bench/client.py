"""A raw asyncio HTTP/1.1 client connection that times each response and SSE event.

One request at a time per keep-alive connection. Every request ends exactly once,
through ``Conn.finish``, as ok or as one error kind ("hang" for the watchdog), and
is recorded in the shared ``Recorder``. Times are ``time.perf_counter()``; the
delivery latency of an SSE event is client wall clock minus the event's ``"ts"``
(upstream wall clock in microseconds at send).
"""

from __future__ import annotations

import asyncio
import collections
import math
import re
import socket
import time

import httptools

from .stats import Samples

_TS = re.compile(rb'"ts":\s*(\d+)')
_DONE = b"data: [DONE]"
_DELIM = b"\n\n"


class Recorder:
    """Counters and samples shared by all connections of one load process."""

    def __init__(self) -> None:
        self.ok = 0
        self.hangs = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.reconnects = 0
        self.server_closes = 0  # responses that ended the keep-alive connection
        self.bytes_up = 0
        self.bytes_down = 0
        self.events = 0
        self.streams = 0
        self.ttfb = Samples(seed=1)
        self.ttft = Samples(seed=2)
        self.gaps = Samples(seed=3)
        self.delivery = Samples(seed=4)
        self.latency = Samples(seed=5)  # request sent to response complete
        # perf_counter() + wall_offset ~= time.time(), without a second clock read per event
        self.wall_offset = time.time() - time.perf_counter()


class Conn(asyncio.Protocol):
    def __init__(self, rec: Recorder, detail: bool) -> None:
        self.rec = rec
        self.detail = detail
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.waiter: asyncio.Future | None = None
        self.deadline = math.inf
        self._reset(0, False, 0)

    def _reset(self, size: int, sse: bool, expected: int) -> None:
        self.size, self.sse, self.expected = size, sse, expected
        self.sent_at = self.first_byte = self.first_token = self.last_token = 0.0
        self.events = self.down = 0
        self.pending = b""
        self.last_event = b""

    # -- transport -------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.finish("reset" if exc else "closed")

    def data_received(self, data: bytes) -> None:
        if self.waiter is None:
            self.rec.errors["unsolicited_bytes"] += 1
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.finish("bad_response")
            self.abort()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    # -- one request -------------------------------------------------------------------
    def request(self, payload: bytes, sse: bool, expected_events: int, timeout: float) -> asyncio.Future:
        """Send one request; the future resolves to None (ok) or an error kind."""
        self._reset(len(payload), sse, expected_events)
        self.waiter = asyncio.get_running_loop().create_future()
        self.sent_at = time.perf_counter()
        self.deadline = self.sent_at + timeout
        self.transport.write(payload)
        return self.waiter

    def finish(self, error: str | None) -> None:
        waiter, self.waiter = self.waiter, None
        self.deadline = math.inf
        if waiter is None or waiter.done():
            return
        if error is None:
            self._record_ok()
        elif error == "hang":
            self.rec.hangs += 1
        else:
            self.rec.errors[error] += 1
        waiter.set_result(error)

    def _record_ok(self) -> None:
        rec = self.rec
        rec.ok += 1
        rec.bytes_up += self.size
        rec.bytes_down += self.down
        rec.ttfb.add(self.first_byte - self.sent_at)
        rec.latency.add(time.perf_counter() - self.sent_at)
        if self.sse:
            rec.streams += 1
            rec.events += self.events
            if self.first_token:
                rec.ttft.add(self.first_token - self.sent_at)

    # -- httptools callbacks -------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.first_byte = time.perf_counter()

    def on_body(self, data: bytes) -> None:
        self.down += len(data)
        if not self.sse:
            return
        buf = self.pending + data if self.pending else data
        if self.detail:
            parts = buf.split(_DELIM)
            self.pending = parts.pop()
            if parts:
                now = time.perf_counter()
                for event in parts:
                    self._event(event, now)
            return
        count = buf.count(_DELIM)
        if count:
            cut = buf.rfind(_DELIM)
            self.events += count
            self.last_event = buf[max(0, cut - len(_DONE)):cut]
            self.pending = buf[cut + 2:]
            if not self.first_token:
                self.first_token = time.perf_counter()
        else:
            self.pending = buf

    def _event(self, event: bytes, now: float) -> None:
        self.events += 1
        self.last_event = event
        match = _TS.search(event)
        if match is None:
            return
        if self.first_token:
            self.rec.gaps.add(now - self.last_token)
        else:
            self.first_token = now
        self.last_token = now
        self.rec.delivery.add(now + self.rec.wall_offset - int(match.group(1)) / 1e6)

    def on_message_complete(self) -> None:
        keep_alive = self.parser.should_keep_alive()
        status = self.parser.get_status_code()
        if status != 200:
            self.finish(f"status_{status}")
        elif self.sse and (self.events != self.expected or self.pending or not self.last_event.endswith(_DONE)):
            self.finish("incomplete_stream")
        else:
            self.finish(None)
        if not keep_alive:
            self.rec.server_closes += 1
            self.closed = True
            self.transport.close()


async def connect(host: str, port: int, rec: Recorder, detail: bool, timeout: float = 5.0) -> Conn:
    loop = asyncio.get_running_loop()
    _, conn = await asyncio.wait_for(loop.create_connection(lambda: Conn(rec, detail), host, port), timeout)
    return conn


def expire(conns: list[Conn | None], now: float) -> None:
    """End every request past its deadline as a hang, closing its connection."""
    for conn in conns:
        if conn is not None and conn.waiter is not None and now > conn.deadline:
            conn.finish("hang")
            conn.abort()
