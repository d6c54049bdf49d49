"""One HTTP/1.1 client connection on a raw socket, driven by h11, every byte timed.

The harness needs exact control of connection reuse (which request goes on which
connection, and how many came before it) and to know, when a turn hangs, how far
the response got. So it does not use an HTTP library with a pool: a
``ClientConnection`` is one socket, one ``h11.Connection``, and a count of the
requests sent on it. ``exchange`` sends one request and reads its response into
an ``Exchange`` that is filled in as bytes arrive, so a timed-out read still says
what had come back.

Every read is bounded by a deadline and the number of reads by ``MAX_READS``.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

import h11

READ_SIZE = 65536
MAX_READS = 200_000  # per response: far beyond any sane stream, still a bound

# How an exchange ended.
COMPLETE = "complete"
TIMEOUT = "timeout"
CLOSED = "closed"  # the peer closed (or reset) before the response was complete
PROTOCOL_ERROR = "protocol_error"
SEND_FAILED = "send_failed"


@dataclass
class Exchange:
    """What came back for one request; times are seconds since the request was sent."""

    ending: str = ""
    error: str = ""
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    bytes_out: int = 0
    bytes_in: int = 0
    head_s: float | None = None
    first_body_s: float | None = None
    last_byte_s: float | None = None
    end_s: float | None = None


class ClientConnection:
    """A keep-alive client connection: ``number`` names it in reports, ``uses`` counts its requests."""

    def __init__(self, host: str, port: int, number: int, connect_timeout: float) -> None:
        self.sock = socket.create_connection((host, port), timeout=connect_timeout)
        # Like real HTTP clients: without it, Nagle holds the body behind the head.
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.h11 = h11.Connection(h11.CLIENT)
        self.number = number
        self.uses = 0
        self.local_port = self.sock.getsockname()[1]

    def reusable(self) -> bool:
        """True when the last exchange ended cleanly and neither side asked to close."""
        if self.uses == 0:
            return True
        return self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE

    def exchange(self, request: h11.Request, body: bytes, deadline: float) -> Exchange:
        """Send one request and read its whole response, or until ``deadline`` (monotonic)."""
        result = Exchange()
        sent_at = time.monotonic()
        if not self._send(request, body, result):
            return result
        self._receive(result, sent_at, deadline)
        return result

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def _send(self, request: h11.Request, body: bytes, result: Exchange) -> bool:
        if self.uses and self.reusable():
            self.h11.start_next_cycle()
        self.uses += 1
        data = self.h11.send(request)
        if body:
            data += self.h11.send(h11.Data(data=body))
        data += self.h11.send(h11.EndOfMessage())
        try:
            self.sock.sendall(data)
        except OSError as exc:
            result.ending, result.error = SEND_FAILED, f"sending the request failed: {_describe(exc)}"
            return False
        result.bytes_out = len(data)
        return True

    def _receive(self, result: Exchange, sent_at: float, deadline: float) -> None:
        for _ in range(MAX_READS):
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                what = "the answer is not HTTP/1.1" if result.status is None else "malformed response"
                result.ending, result.error = PROTOCOL_ERROR, f"{what} ({exc})"
                return
            if event is h11.NEED_DATA:
                if not self._read(result, sent_at, deadline):
                    return
                continue
            if self._apply(event, result, sent_at):
                return
        result.ending, result.error = TIMEOUT, f"gave up after {MAX_READS} reads"

    def _read(self, result: Exchange, sent_at: float, deadline: float) -> bool:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            result.ending = TIMEOUT
            return False
        self.sock.settimeout(remaining)
        try:
            data = self.sock.recv(READ_SIZE)
        except socket.timeout:
            result.ending = TIMEOUT
            return False
        except OSError as exc:
            result.ending, result.error = CLOSED, f"connection error: {_describe(exc)}"
            return False
        if data:
            result.bytes_in += len(data)
            result.last_byte_s = time.monotonic() - sent_at
        self.h11.receive_data(data)  # b"" tells h11 the peer closed
        return True

    @staticmethod
    def _apply(event, result: Exchange, sent_at: float) -> bool:
        """Record one h11 event; True when the response is over (complete or not)."""
        now = time.monotonic() - sent_at
        if isinstance(event, h11.Response):
            result.status, result.head_s = event.status_code, now
            result.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
        elif isinstance(event, h11.Data):
            if result.first_body_s is None:
                result.first_body_s = now
            result.body += event.data
        elif isinstance(event, h11.EndOfMessage):
            result.ending, result.end_s = COMPLETE, now
            return True
        elif isinstance(event, h11.ConnectionClosed):
            result.ending = CLOSED
            result.error = "the server closed the connection " + (
                "before any response byte" if result.bytes_in == 0 else "in the middle of the response")
            return True
        return False


def _describe(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def connect(host: str, port: int, number: int, timeout: float) -> ClientConnection:
    """Open a connection; raises OSError (refused, unreachable, timeout) like ``socket``."""
    return ClientConnection(host, port, number, timeout)


def simple_get(host: str, port: int, target: str, timeout: float) -> Exchange:
    """One GET on a fresh connection, closed afterwards (used for the admin listener)."""
    conn = connect(host, port, 0, timeout)
    try:
        request = h11.Request(method="GET", target=target,
                              headers=[("Host", f"{host}:{port}"), ("Connection", "close")])
        return conn.exchange(request, b"", time.monotonic() + timeout)
    finally:
        conn.close()
