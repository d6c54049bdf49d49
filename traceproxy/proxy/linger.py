"""Lingering: reading on after an answer that went out before the client finished sending.

Theory of operation
-------------------
The proxy can answer while the client is still sending: an error before the end of
the request body, a refusal in the middle of a head. Closing then, with the client's
bytes unread, makes the kernel reset the connection, and a reset destroys what the
client has not read yet: the answer. So the client connection reads on and throws
away what still comes (``downstream.ClientConnection``), in at most two stages of
``LINGER_SECONDS`` each, as nginx's discarded body and lingering close do:

1. Draining: the rest of the request body the answer came before is still parsed (to
   find its end) and thrown away. If it ends within the time and ``LINGER_MAX_BYTES``,
   the connection carries on with the next request, as the answer's keep-alive said.
2. Closing: the proxy's FIN is out. Everything is thrown away unparsed until the
   client's FIN, then the connection closes; with part of the answer still unsent
   after the time, it is reset, so that the client sees it cut.

A drain that does not end in time goes on as a lingering close. The exchange that
answered decides whether its connection may be kept (``drainable``) before it writes
the answer, which says so. ``Lingering`` is the mechanism, one per client connection;
it also bounds a plain close's wait for the client to take what is written.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from . import sockets
from .headers import RequestFraming
from .timer import Timer

if TYPE_CHECKING:
    from .downstream import ClientConnection

LINGER_SECONDS = 2.0  # each stage
LINGER_MAX_BYTES = 8 * 1024 * 1024  # the most of a body drained to keep the connection


def drainable(framing: RequestFraming, received: int) -> bool:
    """Whether the rest of a request body, ``received`` bytes of it read, can be drained
    to keep the connection (a chunked body's rest is bounded while it is drained)."""
    return framing.chunked or framing.content_length - received <= LINGER_MAX_BYTES


class Lingering:
    """A client connection's waits at its end: the two lingering stages, and a plain
    close's wait for the client to take what is written (not past ``timeouts.client_send``:
    a client that stopped reading never does). One timer serves them all, one at a time."""

    __slots__ = ("stage", "_discarded", "_timer", "_conn")
    DRAINING, CLOSING = 1, 2

    def __init__(self, conn: ClientConnection) -> None:
        self.stage = 0  # DRAINING, CLOSING, or 0: not lingering
        self._discarded = 0  # bytes of the body drained
        self._timer = Timer()
        self._conn: ClientConnection | None = conn

    def cancel(self) -> None:
        """The connection closed: let go of it (it holds this, and the timer holds it)."""
        self._timer.cancel()
        self._conn = None

    # -- stage 1 ---------------------------------------------------------------------
    def drain(self) -> None:
        """The active exchange answered before its body ended, and keeps the turn while
        the rest is read and thrown away."""
        conn = self._conn
        self.stage, self._discarded = self.DRAINING, 0
        conn.resume_reading("pending")
        conn.resume_reading("upstream")
        self._timer.set_in(LINGER_SECONDS, self._expired)

    def discarded(self, size: int) -> None:
        self._discarded += size
        if self.stage == self.DRAINING and self._discarded > LINGER_MAX_BYTES:
            self._drain_ended(body_complete=False)

    def body_ended(self) -> None:
        if self.stage == self.DRAINING:
            self._drain_ended(body_complete=True)

    def _drain_ended(self, body_complete: bool) -> None:
        self.stage = 0
        self._timer.clear()
        self._conn.body_drained(body_complete)  # it carries on, or stage 2 follows

    # -- stage 2 ---------------------------------------------------------------------
    def close(self) -> bool:
        """Our FIN after the answer, then what still arrives is thrown away unparsed,
        until the client's FIN or LINGER_SECONDS (the connection is already closing).
        True when the FIN went out (else the transport just closes)."""
        conn = self._conn
        transport = conn.transport
        if not transport.can_write_eof():
            transport.close()
            return False
        self.stage = self.CLOSING
        transport.write_eof()
        conn.reading_paused_for.clear()
        transport.resume_reading()
        self._timer.set_in(LINGER_SECONDS, self._expired)
        return True

    def _expired(self) -> None:
        if self.stage == self.DRAINING:
            self._drain_ended(body_complete=False)
            return
        transport = self._conn.transport
        if sockets.unsent(transport):
            sockets.reset(transport)  # the answer is not all taken: the client must see it cut
        else:
            transport.close()

    # -- a plain close -----------------------------------------------------------------
    def wait_for_flush(self, seconds: float) -> None:
        """The transport is closing with bytes unsent: reset it unless the client takes
        some within ``seconds``, and again after each time it did."""
        self._flush_deadline(seconds, sockets.unsent(self._conn.transport))

    def _flush_deadline(self, seconds: float, unsent: int | None) -> None:
        self._timer.set_in(seconds, functools.partial(self._flush_deadline_passed, seconds, unsent))

    def _flush_deadline_passed(self, seconds: float, unsent_before: int | None) -> None:
        transport = self._conn.transport
        unsent = sockets.unsent(transport)
        if unsent is not None and unsent_before is not None and unsent < unsent_before:
            self._flush_deadline(seconds, unsent)  # it took some since: a slow reader, still reading
        else:
            # A reset, not a close: with the rest unsent, a FIN would make a
            # close-delimited response look complete.
            sockets.reset(transport)
