"""The client side: one ``ClientConnection`` per accepted keep-alive connection.

Theory of operation
-------------------
A connection reads requests and answers them in order. Reading is its
``reader.RequestReader``'s: llhttp, the strict head rules, an ``Exchange`` per request
whose head passed. The connection owns what outlives a request: the turn (the
exchange being answered, the pipelined ones behind it, a refusal waiting for them),
the transport's flow control both ways, lingering and closing (``linger.py``), and
its timers (``timer.Timer``): the request-head or keep-alive timeout, the active
exchange's deadlines, the hang-up check of paused reading, and a close's end. An
exchange sees it only as ``sides.ClientSide``.

State by lifetime: the connection's (transport, record, closing, flow control,
half-close, lingering, timers), the turn's (active, queue, rejection), and the
request being read (the reader's).

Hazards
-------
* Pipelining: llhttp parses every request in a buffer in one ``feed_data`` call, so
  a second request can arrive while the first is being answered. It is queued (its
  body held, reading paused) and started when the first response has ended; a
  malformed request behind good ones is answered with its 400 only after them.
* Unbounded heads and trailers: httptools concatenates a header value until it
  ends, so a client streaming one endless header (or trailer) would grow memory.
  The bytes of heads and of a chunked body's framing and trailers are counted from
  the reads (llhttp gives no offsets) and cut off at ``limits.max_header_bytes``:
  see ``head_meter.HeadMeter``, told by the reader where reads, heads and bodies begin.
* Paused reading: while reading is paused (a pipelined request waits its turn,
  the upstream does not take the body fast enough, a refusal waits for the
  responses before it) the loop does not watch the socket, so a client hanging
  up would go unseen until some timeout, with the engine still working for it.
  A paused connection is checked every ``PEER_CHECK_INTERVAL`` for a hang-up
  (FIN or reset, also behind unread bytes) and reset when it finds one.
* Half-close: a client's FIN after whole requests is, by default, taken as leaving
  (``limits.client_half_close = "abort"``): a client that left must free the engine,
  and a FIN is all that a closing client sends. With "answer" the requests are still
  answered: reading has ended (uvloop must not be asked to read after EOF), and the
  hang-up check runs on, for a reset only, until the connection closes after the last
  response. A FIN found by that check while reading is paused may sit behind unread
  requests, so with "answer" it is left for ``eof_received`` to judge once they are read.
* Exactly one ending per request: every record started here ends through
  ``ServerContext.end_request``, including requests that were still being parsed
  or queued when the connection died.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from ..lifecycle.flags import Flag, Outcome
from ..lifecycle.marks import MARK
from ..lifecycle.timeline import ClientConnectionRecord, RequestRecord
from . import sockets
from .context import ServerContext
from .endings import END
from .forward import Exchange
from .linger import LINGER_SECONDS, Lingering  # noqa: F401  (LINGER_SECONDS: the connection's, named here too)
from .local_reply import body_size, error_response
from .reader import MAX_PIPELINED, RequestReader  # noqa: F401  (MAX_PIPELINED: the connection's limit, named here too)
from .timer import ExchangeTimer, Timer

log = logging.getLogger("traceproxy.downstream")

CONTINUE_100 = b"HTTP/1.1 100 Continue\r\n\r\n"
# How often a connection whose reading is paused is checked for a hang-up: well
# within the second in which the engine must see an abandoned request's connection close.
PEER_CHECK_INTERVAL = 0.25
# How a FIN after a whole request, taken as leaving, is recorded (see eof_received).
# A FIN is all the proxy sees either way: a client that closed its whole connection and
# one that only shut its sending side look the same until something is written to it.
HALF_CLOSE_TAKEN_AS_LEAVING = ("client closed the connection, or its sending side (FIN), after its whole request, "
                               "before {what}: taken as leaving (limits.client_half_close = abort)")


class ClientConnection(asyncio.Protocol):
    def __init__(self, ctx: ServerContext) -> None:
        # The connection.
        self.ctx = ctx
        self.transport: asyncio.Transport | None = None
        self.record: ClientConnectionRecord | None = None
        self.closing = False
        self.feeding = False  # inside a read being parsed: upstream writes are batched
        self.write_paused = False
        self.reading_paused_for: set[str] = set()
        # The client's FIN came after whole requests, which are still answered (see
        # Hazards: Half-close); and its FIN after a whole request was taken as leaving.
        self.half_closed = False
        self._left_after_request = False
        self.lingering = Lingering(self)  # and the waits of a close (see linger.py)
        self._fin_sent = False  # our FIN is out (lingering): nothing more is written
        # Its timers: the request-head or keep-alive timeout; the active exchange's
        # deadlines; the hang-up check of paused reading (see Hazards).
        self.head_timer = Timer()
        self.exchange_timer = ExchangeTimer(self._exchange_timer_fired)
        self._peer_check = Timer()
        # The turn: the exchange being answered, pipelined ones waiting, and a refusal
        # waiting for the responses before it.
        self.active: Exchange | None = None
        self.queue: collections.deque[Exchange] = collections.deque()
        self.rejection: tuple[int, Outcome, str] | None = None
        # The request being read now, and the parser.
        self.reader = RequestReader(self, ctx)

    # -- connection lifetime -------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer_ip = peer[0] if peer else "unknown"
        self.record = ClientConnectionRecord(peer=f"{peer[0]}:{peer[1]}" if peer else "unknown",
                                             opened_ns=time.monotonic_ns())
        self.forwarding = self.ctx.forwarding_for(self)
        if not self.ctx.admit(self):
            # Refused before its request is read; still a request that ended (DO),
            # with ids on its 503 and in its span, like every other refusal.
            self.rejection = (503, Flag.DO, "too many client connections")
            self._send_rejection()
            return
        self.ctx.connection_idle(self)  # evictable until its first byte arrives
        self.head_timer.set_in(self.ctx.timeouts.client_headers, self._on_idle_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        for timer in (self.head_timer, self.exchange_timer, self._peer_check, self.lingering):
            timer.cancel()
        closed = self.record.closed_ns = time.monotonic_ns()
        self.ctx.forget(self)
        for exchange in (self.active, *self.queue):
            if exchange is not None:
                exchange.client_closed(closed)
        if self._left_after_request:
            self._drop_queue(Flag.DC, HALF_CLOSE_TAKEN_AS_LEAVING.format(what="this pipelined request's turn"))
            if self.active is not None:
                self.active.end(END.CLIENT_LEFT, Flag.DC,
                                HALF_CLOSE_TAKEN_AS_LEAVING.format(what="the response was complete"))
        else:
            self._drop_queue(Flag.DC, "client closed the connection before this pipelined request's turn")
            if self.active is not None:
                self.active.end(END.CLIENT_LEFT, Flag.DC, "client closed the connection")
        parsing = self.reader.parsing
        if parsing is not None and not parsing.finished and self.reader.parsing_exchange is None:
            self.ctx.stamp_once(parsing, closed, MARK.DOWNSTREAM_CLOSED)
            self.ctx.end_request(parsing, Flag.DC, "client closed the connection while sending the request head")
        # Drop what refers back to this connection, so that reference counting frees it
        # as soon as nothing else holds it, not the cycle collector, which runs rarely
        # (see app.YOUNG_COLLECTION_THRESHOLD): the reader and its parser's callbacks, an
        # exchange still here (a body arriving, a reply lingering); the timers let go of
        # theirs when cancelled. Nothing uses them after the close: reading and
        # exchange_finished stop at ``closing``.
        self.reader.close()
        self.active = None

    def eof_received(self) -> bool:
        """A FIN from the client. With a request in progress it is a disconnect, as
        nginx and Envoy take it: the connection is aborted at once, so the engine is
        let go now. Closing instead would wait for buffered response bytes to drain,
        which never happens while the client is not reading. Otherwise (idle, or only
        a finished response draining) it is a normal close. After whole requests, with
        ``limits.client_half_close = "answer"``, they are answered first (see Hazards:
        Half-close), unless the client had all of its stream already (data: [DONE])."""
        if self.half_closed:
            return True
        parsing = self.reader.parsing
        if not (self.active is not None or self.queue or (parsing is not None and not parsing.finished)):
            return False
        owed = self._fin_after_whole_requests()
        if owed and self.ctx.answer_half_close and not self.closing:
            self._answer_then_close()
            return True
        self._left_after_request = owed and not self.ctx.answer_half_close
        self.closing = True
        self.transport.abort()  # connection_lost follows and ends every request on it
        return False

    def _fin_after_whole_requests(self) -> bool:
        """Judges the client's FIN: True when every request begun on this connection was
        read to its end and is still owed its response. Not when the client had its
        whole stream (data: [DONE]; the active exchange judges that, once, now)."""
        had_its_stream = self.active is not None and self.active.client_sent_fin()
        return (not had_its_stream and self.reader.parsing is None and self.rejection is None
                and self.active is not None and self.active.request_complete and not self.active.finished)

    def _answer_then_close(self) -> None:
        """The client half-closed after whole requests: they are answered, the last one
        with Connection: close (if its head is not out yet), then the connection closes."""
        self.half_closed = True
        last = self.queue[-1] if self.queue else self.active
        last.head.keep_alive = last.keep_client_alive = False
        self.reading_paused_for.clear()  # no reading is left to pause or resume
        if not self._peer_check.armed:
            self._peer_check.set_in(PEER_CHECK_INTERVAL, self._check_peer)

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            self.transport.close()
            if self.ctx.timeouts.client_send and self.transport.get_write_buffer_size():
                # The close waits for the client to take what is written, which a
                # client that stopped reading never does: not past the send timeout.
                self.lingering.wait_for_flush(self.ctx.timeouts.client_send)

    def close_lingering(self) -> None:
        """Close a connection the client may still be sending on (a response before the
        end of its request body, a refusal mid-head): see linger.py, stage 2."""
        if not self.closing:
            self.closing = True  # from here every read is dropped unparsed (see data_received)
            self._fin_sent = self.lingering.close()

    def body_drained(self, body_complete: bool) -> None:
        """The body of the active exchange, answered early, was drained (see linger.py):
        to its end (the connection is kept if the answer said so), or not in time."""
        self.record.body_drained(time.monotonic_ns())
        exchange = self.active
        self.exchange_finished(exchange, body_complete and exchange.keep_client_alive)

    def shut_down(self, reason: str) -> None:
        """The shutdown grace ran out: every request on this connection ends LR (the
        proxy's doing, not the client's). The pipelined ones are dropped first, so
        that none starts once the grace is over; the one in progress gets its error
        with Connection: close; a head still arriving is ended; then the connection
        closes."""
        self._drop_queue(Flag.LR, reason)
        if self.active is not None:
            self.active.keep_client_alive = False
            self.active.end(END.FAILED, Flag.LR, reason)
        parsing = self.reader.parsing
        if parsing is not None and not parsing.finished and self.reader.parsing_exchange is None:
            if self.rejection is not None:
                # Refused already (its 4xx waits behind the response before it): the
                # refusal is its outcome, though the connection closes before it is sent.
                _, refused, why = self.rejection
                self.ctx.end_request(parsing, refused, why)
            else:
                self.ctx.end_request(parsing, Flag.LR, reason)
        self.close()

    def reset(self) -> None:
        """Close with a reset, not a FIN: what was written but not yet sent is lost,
        and the client sees an error rather than an end of data."""
        self.closing = True
        sockets.reset(self.transport)

    def write(self, data: bytes) -> None:
        if not self.transport.is_closing() and not self._fin_sent:
            self.transport.write(data)

    def unsent(self) -> int | None:
        return sockets.unsent(self.transport)

    # -- flow control --------------------------------------------------------------
    def pause_writing(self) -> None:
        self.write_paused = True
        if self.active is not None:
            self.active.client_write_paused()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.active is not None:
            self.active.client_write_resumed()

    @property
    def reading_paused(self) -> bool:
        return bool(self.reading_paused_for)

    def pause_reading(self, reason: str) -> None:
        if self.half_closed:
            return  # reading ended with the client's FIN
        if not self.reading_paused_for and not self.closing:
            self.transport.pause_reading()
            if not self._peer_check.armed:
                self._peer_check.set_in(PEER_CHECK_INTERVAL, self._check_peer)
        self.reading_paused_for.add(reason)

    def resume_reading(self, reason: str) -> None:
        if reason in self.reading_paused_for:
            self.reading_paused_for.discard(reason)
            if not self.reading_paused_for and not self.closing:
                self.transport.resume_reading()

    def _check_peer(self) -> None:
        """While reading is paused, or ended by a FIN that is being answered, look for a
        hang-up the loop is not watching for."""
        if self.closing or not (self.reading_paused_for or self.half_closed):
            return
        hung_up = sockets.peer_hung_up(self.transport)
        if hung_up == sockets.FIN and self.ctx.answer_half_close:
            hung_up = None  # the FIN came, or is judged once the bytes before it are read (see Hazards)
        if hung_up:
            log.debug("client %s hung up while its reading was paused (%s)",
                      self.record.peer, ", ".join(sorted(self.reading_paused_for)) or "half-closed")
            if hung_up == sockets.FIN:
                self._left_after_request = self._fin_after_whole_requests()
            self.reset()  # connection_lost follows and ends every request on it
            return
        self._peer_check.set_in(PEER_CHECK_INTERVAL, self._check_peer)

    # -- reading (see reader.RequestReader) ----------------------------------------
    def data_received(self, data: bytes) -> None:
        reader = self.reader
        # Past an ignored h2c offer llhttp stops; the rest of the read is fed again.
        while data and not (self.closing or self.rejection is not None or reader.stopped):
            data = reader.feed(data)

    def request_begins(self) -> RequestRecord:
        """A request's first byte came: its record, which this connection owns until its head is read."""
        self.head_timer.callback = None  # the keep-alive idle timeout stands down (Timer.clear)
        self.ctx.connection_busy(self)
        record = self.record.begin_request(time.monotonic_ns())
        record.owner = self  # until its exchange exists
        # Behind a request in progress, its head is read only as the proxy reads on
        # (it stops at a queued one): until its turn, its silence is not the client's.
        record.waiting_turn = self.active is not None
        return record

    def arm_head_timer(self) -> None:
        self.head_timer.set_in(self.ctx.timeouts.client_headers, self._on_header_timeout)

    def request_ready(self, exchange: Exchange) -> None:
        """Its head passed: it is answered now, or after the ones before it."""
        if self.active is None:
            self._begin(exchange)
        else:
            exchange.record.waiting_turn = True
            self.queue.append(exchange)
            self.pause_reading("pipeline")

    def request_read(self, exchange: Exchange) -> None:
        """Its body ended (the request was read whole)."""
        if exchange is self.active:
            self.lingering.body_ended()

    # -- answering in order --------------------------------------------------------
    def _begin(self, exchange: Exchange) -> None:
        self.active = exchange
        exchange.record.waiting_turn = False
        if exchange.head.expect_continue and not exchange.request_complete:
            # We answer Expect ourselves and strip it upstream: the body is
            # streamed as soon as it comes, whatever the upstream is doing.
            self.write(CONTINUE_100)
        if self.write_paused:
            exchange.client_write_paused()
        exchange.start()
        if exchange.head.keep_alive and self not in self.ctx.sending_clients:
            # After start, so that the pool counts the connection this request took. (One
            # whose body is held for a request id takes it later: then one connection may
            # open ahead that this request could have used; it expires idle.)
            self.ctx.client_began_sending(self)

    def exchange_finished(self, exchange: Exchange, keep_alive: bool, drain: bool = False) -> None:
        if drain:
            self.lingering.drain()  # it keeps its turn until the rest of its body is read
            return
        self.active = None
        if self.reading_paused_for:
            # Pauses the finished request made (its body queued for a connection, or
            # the upstream not taking it) end with it: the next request must be read.
            self.resume_reading("pending")
            self.resume_reading("upstream")
        if not keep_alive or self.closing or (self.half_closed and not self.queue):
            # Answered before its body ended, or with requests behind it: the client
            # may still be sending (not after its FIN).
            still_sending = not self.half_closed and (not exchange.request_complete or self.queue
                                                      or self.reader.parsing is not None or self.reader.stopped)
            self._drop_queue(Flag.LR, "the connection closed before this pipelined request's turn")
            if still_sending:
                self.close_lingering()
            else:
                self.close()
            return
        if self.queue:
            exchange = self.queue.popleft()
            # Its body, if still arriving, is the client's to send from now on.
            exchange.record.turn_began_ns = time.monotonic_ns()
            self._begin(exchange)
            if not self.queue:
                self.resume_reading("pipeline")
            return
        self.resume_reading("pipeline")
        if self.rejection is not None:
            self._send_rejection()
        elif self.ctx.shutting_down:
            self.close()
        elif self.reader.parsing is None:
            self.ctx.connection_idle(self)
            self.head_timer.set_in(self.ctx.timeouts.client_keepalive, self._on_idle_timeout)
        else:
            # The head begun behind the requests before it: its turn starts now, and
            # its time to complete (the stall verdict, the header timeout) with it.
            self.reader.parsing.waiting_turn = False
            self.reader.parsing.turn_began_ns = time.monotonic_ns()
            self.arm_head_timer()

    def _drop_queue(self, outcome: Outcome, why: str) -> None:
        while self.queue:
            self.queue.popleft().end(END.NOT_STARTED, outcome, why)

    # -- refusals ------------------------------------------------------------------
    def reject(self, status: int, outcome: Outcome, reason: str) -> None:
        """Refuse the request being read; nothing of it has been forwarded."""
        reader = self.reader
        self.rejection = (status, outcome, reason)
        self.pause_reading("rejected")
        if reader.parsing is not None and (self.active is not None or self.queue):
            reader.parsing.waiting_turn = True  # its refusal goes out after the responses before it
        broken = reader.parsing_exchange
        if broken is not None and broken is self.active:
            # The bad bytes are inside the body of the active request (e.g. a bad
            # chunk size): that request cannot complete, so it is the one that fails.
            reader.parsing = None
            self.active.end(END.FAILED, outcome, reason, status)
            return
        if broken is not None and broken in self.queue:
            # A pipelined request with a broken body never starts; its 400 goes
            # out in its turn, after the responses before it.
            self.queue.remove(broken)
            reader.parsing_exchange = None
        if self.active is None and not self.queue:
            self._send_rejection()

    def abort(self, outcome: Outcome, message: str) -> None:
        """The watchdog's abort of a request whose head is not complete."""
        parsing = self.reader.parsing
        if parsing is not None and not parsing.finished and self.rejection is None:
            self.rejection = (outcome.local_status or 408, outcome, message)
            self.pause_reading("rejected")
            if self.active is None:
                self._send_rejection()

    def _send_rejection(self) -> None:
        status, outcome, reason = self.rejection
        record = self.reader.parsing
        if record is None or record.finished:
            parts = None
            record = self.record.begin_request(time.monotonic_ns())
            self.ctx.start_request(record)
        else:
            # The refusal carries the client's trace context and request id from the
            # header lines read before it, so it can be found by them.
            parts = self.reader.refused_parts(record)
        self.reader.parsing = None
        record.status = status
        if not record.trace_id:
            self.ctx.identify(record, parts)
        reply = error_response(status, outcome, reason, keep_alive=False, extra_lines=self.ctx.response_ids(record),
                               head_only=record.method == "HEAD")
        self.write(reply)
        record.downstream_tx_body_bytes += body_size(reply)
        self.ctx.stamp_once(record, time.monotonic_ns(), MARK.FIRST_DOWNSTREAM_TX_BYTE, MARK.LAST_DOWNSTREAM_TX_BYTE)
        self.ctx.end_request(record, outcome, reason)
        if outcome is Flag.DO:
            self.close()  # not admitted: no connection is held open for it
        else:
            self.close_lingering()  # refused while the client may still be sending

    # -- connection timers (timer.Timer: a later deadline costs nothing) ----------
    def _exchange_timer_fired(self) -> None:
        if self.active is not None:
            self.active.timer_fired()

    def _on_idle_timeout(self) -> None:
        if self.active is None and self.reader.parsing is None:
            self.close()

    def _on_header_timeout(self) -> None:
        if self.closing:
            return
        parsing = self.reader.parsing
        if parsing is not None and not parsing.has(MARK.LAST_DOWNSTREAM_RX_HEADER_BYTE):
            waited = self.ctx.timeouts.client_headers
            self.rejection = (408, Flag.DHT, f"request head not complete after {waited:g} s")
            if self.active is None:
                self._send_rejection()
