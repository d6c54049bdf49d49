"""Test support: an event loop in a thread, scripted upstreams and a raw-socket client.

Tests are plain synchronous functions: the proxy and the fake upstreams run on a
uvloop loop in a background thread, and the test talks to them over loopback
sockets like any client would.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import h11
import pytest
import uvloop

from traceproxy.observe.metrics import prometheus_totals

STEP_TIMEOUT = 10.0  # every blocking step of a test is bounded by this


class LoopThread:
    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable, timeout: float = STEP_TIMEOUT):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable, *args):
        async def _call():
            return fn(*args)

        return self.run(_call())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class ScriptedUpstream:
    """A misbehaving upstream: ``handler(reader, writer, upstream)`` per connection.

    Records what it saw so tests can assert on the far side of the proxy:
    raw request bytes per connection, and when each connection closed.
    """

    def __init__(self, handler: Callable) -> None:
        self.handler = handler
        self.connections = 0
        self.received: list[bytearray] = []
        self.closed_at: list[float] = []
        self.closed = threading.Event()
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self) -> "ScriptedUpstream":
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        seen = bytearray()
        self.received.append(seen)
        try:
            await self.handler(RecordingReader(reader, seen), writer, self)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.closed_at.append(time.monotonic())
            self.closed.set()
            writer.close()

    def set_receive_buffer(self, size: int) -> None:
        """SO_RCVBUF of the connections accepted from now on (a small one makes the
        proxy's writes back up after a few kilobytes the upstream does not read)."""
        self._server.sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)

    async def stop(self) -> None:
        self._server.close()


class RecordingReader:
    """A StreamReader that keeps a copy of every byte read."""

    def __init__(self, reader: asyncio.StreamReader, sink: bytearray) -> None:
        self._reader, self._sink = reader, sink

    async def readuntil(self, sep: bytes = b"\n") -> bytes:
        data = await self._reader.readuntil(sep)
        self._sink += data
        return data

    async def readexactly(self, n: int) -> bytes:
        data = await self._reader.readexactly(n)
        self._sink += data
        return data

    async def read(self, n: int = -1) -> bytes:
        data = await self._reader.read(n)
        self._sink += data
        return data

    async def read_head(self) -> bytes:
        return await self.readuntil(b"\r\n\r\n")

    async def read_request(self) -> tuple[bytes, bytes]:
        """One request (head, body), Content-Length or chunked."""
        head = await self.read_head()
        lower = head.lower()
        if b"transfer-encoding: chunked" in lower:
            body = bytearray()
            while True:
                size = int((await self.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await self.readuntil(b"\r\n")
                    return head, bytes(body)
                body += await self.readexactly(size)
                await self.readexactly(2)
        length = 0
        for line in lower.split(b"\r\n"):
            if line.startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        return head, await self.readexactly(length) if length else b""


def header_value(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        if b":" in line:
            key, value = line.split(b":", 1)
            if key.strip().lower() == name.lower():
                return value.strip()
    return None


# ----------------------------------------------------------------------------------
# The raw-socket client
# ----------------------------------------------------------------------------------
class RawClient:
    """A blocking client that sends exact bytes and reads responses with h11."""

    def __init__(self, port: int, timeout: float = STEP_TIMEOUT) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        # Like real HTTP clients: without it, Nagle holds the body behind the head
        # until the proxy's delayed ACK, 40 ms per request.
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = h11.Connection(h11.CLIENT)

    def send(self, data: bytes, expect: tuple[str, ...] = ("GET",)) -> None:
        """Send exact bytes; ``expect`` lists the methods of the requests they carry."""
        self.sock.sendall(data)
        self._expected = list(expect)

    _expected: list[str] = []

    def request(self, method: str, target: str, headers=(), body: bytes = b"") -> None:
        hdrs = [("Host", "test.local")] + list(headers)
        if body and not any(k.lower() in ("content-length", "transfer-encoding") for k, _ in hdrs):
            hdrs.append(("Content-Length", str(len(body))))
        out = self.conn.send(h11.Request(method=method, target=target, headers=hdrs))
        if body:
            out += self.conn.send(h11.Data(data=body))
        self.sock.sendall(out + self.conn.send(h11.EndOfMessage()))

    def response(self) -> "Response":
        """Read one whole response. ``complete`` is False when the body was cut short."""
        if self._expected:
            self.expect_response_to(self._expected.pop(0))
        head, chunks = None, []
        while True:
            event = self._next_event()
            if isinstance(event, h11.Response):
                head = event
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return Response(head, b"".join(chunks), complete=True)
            elif isinstance(event, (h11.ConnectionClosed, _Truncated)):
                return Response(head, b"".join(chunks), complete=False)

    def _next_event(self):
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError:
                return _Truncated()
            if event is h11.NEED_DATA:
                data = self.sock.recv(1 << 20)
                self.conn.receive_data(data)
                continue
            if isinstance(event, h11.InformationalResponse):
                continue
            return event

    def expect_response_to(self, method: str) -> None:
        """Tell h11 a request went out as raw bytes, so it can parse the answer."""
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        self.conn.send(h11.Request(method=method, target="/", headers=[("Host", "raw")]))
        self.conn.send(h11.EndOfMessage())

    def roundtrip(self, method: str, target: str, headers=(), body: bytes = b"") -> "Response":
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        self.request(method, target, headers, body)
        return self.response()

    def is_closed_by_peer(self, wait: float = 2.0) -> bool:
        self.sock.settimeout(wait)
        try:
            return self.sock.recv(1) == b""
        except socket.timeout:
            return False
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


class _Truncated:
    pass


class Response:
    def __init__(self, head: h11.Response | None, body: bytes, complete: bool) -> None:
        self.head = head
        self.status = head.status_code if head else None
        self.headers = {k.decode().lower(): v.decode() for k, v in head.headers} if head else {}
        self.header_list = [(k.decode().lower(), v.decode()) for k, v in head.headers] if head else []
        self.body = body
        self.complete = complete

    def __repr__(self) -> str:
        return f"<Response {self.status} complete={self.complete} {self.body[:200]!r}>"


def raw_exchange(port: int, data: bytes, timeout: float = STEP_TIMEOUT) -> bytes:
    """Send exact bytes, read until the proxy closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        out = bytearray()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
        return bytes(out)


def recv_until(sock: socket.socket, marker: bytes, received: bytes = b"") -> bytes:
    """``received`` plus what ``sock`` sends until ``marker`` is in it; fails if the peer closes first.

    Bounded by the socket's timeout: ``recv`` raises when nothing comes.
    """
    while marker not in received:
        chunk = sock.recv(65536)
        assert chunk, f"closed before {marker!r} arrived: {received[-300:]!r}"
        received += chunk
    return received


def wait_until(predicate: Callable[[], bool], timeout: float = STEP_TIMEOUT, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


# ----------------------------------------------------------------------------------
# Upstream behaviours shared by many tests (handlers for ScriptedUpstream)
# ----------------------------------------------------------------------------------
async def never_answers(reader: RecordingReader, writer: asyncio.StreamWriter, upstream: ScriptedUpstream) -> None:
    """Reads one request and answers nothing; returns when the proxy closes the connection."""
    await reader.read_request()
    await reader.read(1)


SMALL_OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def answers_then_drops_next_request(drop_after: int = 1) -> Callable:
    """Answers ``drop_after`` requests on each connection, then closes on the next one
    without a byte of response: the keep-alive race as the proxy sees it."""

    async def handler(reader, writer, upstream) -> None:
        for _ in range(drop_after):
            await reader.read_request()
            writer.write(SMALL_OK)
            await writer.drain()
        await reader.read_request()
        writer.transport.abort()

    return handler


def answers_in_turn(*responses: bytes) -> Callable:
    """Answers each request with the next of ``responses``, whole, across the
    connections it is given: one upstream answering in a scripted order."""
    pending = iter(responses)

    async def handler(reader, writer, upstream) -> None:
        while True:
            await reader.read_request()
            writer.write(next(pending))
            await writer.drain()

    return handler


def answers_in_parts(*parts: bytes, pause: float = 0.0) -> Callable:
    """Reads one request, writes ``parts`` with ``pause`` seconds between them, then
    holds the connection open until the proxy closes it."""

    async def handler(reader, writer, upstream) -> None:
        await reader.read_request()
        for index, part in enumerate(parts):
            if index and pause:
                await asyncio.sleep(pause)
            writer.write(part)
            await writer.drain()
        await reader.read(1)

    return handler


async def streams_without_end(reader, writer, upstream) -> None:
    """Reads one request and streams 64 KiB chunks, far more than socket buffers hold,
    as fast as the proxy takes them: a client that does not read backs it up."""
    await reader.read_request()
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    block = b"x" * 65536
    for _ in range(2000):
        writer.write(b"%x\r\n%s\r\n" % (len(block), block))
        await writer.drain()


def answers_partly_then_resets(partial: bytes, after: float = 0.05) -> Callable:
    """Reads one request, writes ``partial`` (a response cut short), then resets the
    connection ``after`` seconds later: an upstream dying mid-response."""

    async def handler(reader, writer, upstream) -> None:
        await reader.read_request()
        writer.write(partial)
        await writer.drain()
        await asyncio.sleep(after)
        writer.transport.abort()

    return handler


class ListSink:
    """Stands in for the span export pipe: keeps what the tracing observer submits.
    ``backlog``: what ``backlogged()`` answers (the exporter is behind)."""

    def __init__(self, backlog: bool = False) -> None:
        self.items, self.now_items, self.lines = [], [], []
        self.backlog = backlog

    def submit(self, items) -> None:
        self.items.extend(items)

    def submit_line(self, line: bytes) -> None:
        self.lines.append(line)

    def submit_now(self, items) -> None:
        self.now_items.extend(items)

    def backlogged(self) -> bool:
        return self.backlog



def admin_get(proxy, path: str) -> str:
    """GET ``path`` from a started proxy's admin listener."""
    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.admin_port}{path}", timeout=5) as resp:
        return resp.read().decode()


def admin_metric(proxy, name: str) -> float:
    """One metric of the proxy's /metrics, summed over its label sets; it must be there."""
    totals = prometheus_totals(admin_get(proxy, "/metrics"))
    assert name in totals, name
    return totals[name]


async def answers_done_then_waits(reader, writer, upstream) -> None:
    """An event stream that sends data: [DONE] and never its chunked terminator."""
    await reader.read_request()
    event = b"data: [DONE]\n\n"
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"%x\r\n%s\r\n" % (len(event), event))
    await writer.drain()
    await reader.read(1)  # until the proxy closes this connection


class Done:
    """An observer that keeps every record the proxy finishes."""

    def __init__(self) -> None:
        self.records = []

    def on_done(self, record) -> None:
        self.records.append(record)

    def one(self):
        assert wait_until(lambda: self.records, timeout=10), "traceproxy finished no request"
        assert len(self.records) == 1, [r.outcome.code for r in self.records]
        return self.records[0]


def ended(proxy) -> list:
    """The records of the requests ``proxy`` ends from now on, as they end."""
    done = []

    class Ended:
        def on_done(self, record):
            done.append(record)

    proxy.fanout.add(Ended())
    return done


def started_for_the_test(loop_thread: LoopThread, make: Callable, stop: Callable = lambda thing: thing.stop()):
    """The body of a fixture that yields a factory: each call makes a thing with ``make(*args, **kwargs)``,
    starts it on ``loop_thread`` and returns it; each thing started is stopped with ``stop(thing)`` when the
    test ends. One that fails to start is never stopped."""
    started = []

    def factory(*args, **kwargs):
        thing = make(*args, **kwargs)
        loop_thread.run(thing.start())
        started.append(thing)
        return thing

    yield factory
    for thing in started:
        loop_thread.run(stop(thing))


# Fixtures shared by more than one test module; a module that uses one imports it by name.
@pytest.fixture
def start_pipe(loop_thread):
    """``start_pipe(export_config)`` -> a running SpanExportPipe, stopped at the test's end."""
    from traceproxy.observe.export import SpanExportPipe

    yield from started_for_the_test(loop_thread, SpanExportPipe, stop=lambda pipe: pipe.stop(timeout=2.0))


@pytest.fixture
def start_worker(loop_thread):
    """``start_worker(role, **options)`` -> a running simulated engine worker, stopped at the test's end."""
    from traceproxy.sim.engine import SimWorker

    yield from started_for_the_test(loop_thread, SimWorker)


CHECKOUT = Path(__file__).resolve().parent.parent


def refused_port() -> socket.socket:
    """A bound socket that never listens: connecting to its port is refused while it is held
    (closed, the port is free for anyone, a test file running beside this one included)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def checkout_environment() -> dict[str, str]:
    """This process's environment with the checkout first on PYTHONPATH, for a child
    that must run the code under test whatever its working directory."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(CHECKOUT), os.environ.get("PYTHONPATH")]))}


# Under the suite's own per-test timeout (pyproject's 120 s): past it pytest-timeout would
# fail the test before this could stop the bench, and the bench's processes would live on.
BENCH_TIMEOUT_S = 90


def run_bench(*args: str, timeout: float = BENCH_TIMEOUT_S, cwd: Path = CHECKOUT) -> subprocess.CompletedProcess:
    """``traceproxy bench`` with ``args`` in a process group of its own, the checkout first on
    its path, run in ``cwd``; past ``timeout`` it is stopped (it stops its own children on
    SIGTERM) and the test fails."""
    proc = subprocess.Popen([sys.executable, "-m", "traceproxy.bench", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=checkout_environment())
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
        pytest.fail(f"bench did not finish within {timeout:g} s:\n{err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
