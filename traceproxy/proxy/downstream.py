"""The client side: one ``ClientConnection`` per accepted keep-alive connection.

It parses requests strictly (httptools/llhttp plus the rules in ``headers``), turns
each into an ``Exchange``, answers pipelined requests strictly in order, and owns the
connection's timers: the request-head timeout and the keep-alive idle timeout.

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
  see ``head_meter.HeadMeter``, told here where reads, heads and bodies begin.
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
import functools
import logging
import time

import httptools

from ..lifecycle.flags import Flag, Outcome
from ..lifecycle.marks import MARK
from ..lifecycle.timeline import ClientConnectionRecord, RequestRecord
from . import headers as H
from . import sockets
from .context import ServerContext
from .endings import Ending
from .forward import Exchange
from .head_meter import HeadMeter
from .linger import LINGER_MAX_BYTES, LINGER_SECONDS
from .local_reply import body_size, error_response
from .request_head import RequestHead
from .timer import Timer

log = logging.getLogger("traceproxy.downstream")

CONTINUE_100 = b"HTTP/1.1 100 Continue\r\n\r\n"
# How often a connection whose reading is paused is checked for a hang-up: well
# within the second in which the engine must see an abandoned request's connection close.
PEER_CHECK_INTERVAL = 0.25
# Pipelined requests queued behind the one being answered, at most: past this the
# connection closes after the last one queued (each costs a record and an exchange,
# and a 1 MiB read of minimal GETs would queue 38,000).
MAX_PIPELINED = 32
# The stages of lingering (see linger.py): the rest of a body answered early, then
# what comes after the proxy's FIN.
_DRAINING, _CLOSING = 1, 2
# How a FIN after a whole request, taken as leaving, is recorded (see eof_received).
HALF_CLOSE_TAKEN_AS_LEAVING = ("client half-closed the connection (FIN) after its whole request, before {what}: "
                               "taken as leaving (limits.client_half_close = abort)")
# The usual methods as str, so that a request does not decode its method.
_METHODS = {m.encode(): m for m in ("GET", "POST", "HEAD", "PUT", "DELETE", "PATCH", "OPTIONS")}


class _BegunAfterClose(Exception):
    """Raised inside llhttp's callback to stop it at a request begun after the
    connection was closed within the same read."""


class _PipelineFull(Exception):
    """Raised inside llhttp's callback to stop it at a request past MAX_PIPELINED."""


def _unsupported_version(version: str) -> str:
    return f"HTTP/{version} is not supported: send HTTP/1.1 (or HTTP/1.0)"


class ClientConnection(asyncio.Protocol):
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.transport: asyncio.Transport | None = None
        self.record: ClientConnectionRecord | None = None
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.closing = False
        self.feeding = False  # inside parser.feed_data: upstream writes are batched
        self.write_paused = False
        self.reading_paused_for: set[str] = set()
        # The request whose head/body is being parsed now.
        self.parsing: RequestRecord | None = None
        self.parsing_exchange: Exchange | None = None
        self._url = b""
        self._headers: H.Headers = []
        self._meter = HeadMeter(ctx.limits.max_header_bytes, ctx.limits.max_target_bytes)  # see head_meter.py
        self._upgrade_offer_ignored = False  # see _ignore_upgrade_offer
        self._max_head_bytes = ctx.limits.max_header_bytes
        self._max_target_bytes = ctx.limits.max_target_bytes
        # A head began during this read: arm the head timer after it, unless the head
        # also ended in it (the usual case, so most requests never touch the timer).
        self._head_timer_pending = False
        # The exchange being answered, and pipelined ones waiting their turn.
        self.active: Exchange | None = None
        self.queue: collections.deque[Exchange] = collections.deque()
        self.rejection: tuple[int, Outcome, str] | None = None
        # The connection's timers (see timer.Timer): the request-head or keep-alive
        # timeout; the active exchange's deadlines (kept across requests, so that
        # keep-alive requests do not each create and cancel one); the hang-up check of
        # paused reading (see Hazards); and a lingering stage's end or a close's flush.
        self._head_timer = Timer()
        self._exchange_timer = Timer()
        self._peer_check = Timer()
        self._close_timer = Timer()
        self._lingering = 0  # _DRAINING or _CLOSING (see linger.py)
        self._lingered_bytes = 0  # of a body drained after its answer
        self.reading_stopped = False  # too many requests pipelined: nothing more is parsed
        # The client's FIN came after whole requests, which are still answered (see
        # Hazards: Half-close); and its FIN after a whole request was taken as leaving.
        self.half_closed = False
        self._left_after_request = False

    # ---------------------------------------------------------------------------
    # Connection lifetime
    # ---------------------------------------------------------------------------
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
        self._head_timer.set_in(self.ctx.timeouts.client_headers, self._on_idle_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        for timer in (self._head_timer, self._exchange_timer, self._peer_check, self._close_timer):
            timer.cancel()
        closed = self.record.closed_ns = time.monotonic_ns()
        self.ctx.forget(self)
        for exchange in (self.active, *self.queue):
            if exchange is not None:
                exchange.client_closed(closed)
        if self._left_after_request:
            self._drop_queue(Flag.DC, HALF_CLOSE_TAKEN_AS_LEAVING.format(what="this pipelined request's turn"))
            if self.active is not None:
                self.active.end(Ending.CLIENT_LEFT, Flag.DC,
                                HALF_CLOSE_TAKEN_AS_LEAVING.format(what="the response was complete"))
        else:
            self._drop_queue(Flag.DC, "client closed the connection before this pipelined request's turn")
            if self.active is not None:
                self.active.end(Ending.CLIENT_LEFT, Flag.DC, "client closed the connection")
        if self.parsing is not None and not self.parsing.finished and self.parsing_exchange is None:
            self.ctx.stamp_once(self.parsing, closed, MARK.DOWNSTREAM_CLOSED)
            self.ctx.end_request(self.parsing, Flag.DC, "client closed the connection while sending the request head")
        self._let_go_of_self()

    def _let_go_of_self(self) -> None:
        """Drop what refers back to this connection, so that it is freed by reference
        counting as soon as nothing else holds it, not by the cycle collector, which
        runs rarely (see app.YOUNG_COLLECTION_THRESHOLD): the parser holds its
        callbacks, an exchange still here (a body arriving, a reply lingering) its
        connection (the timers let go of theirs when cancelled). None is used after
        the close: ``_feed`` and ``exchange_finished`` stop at ``closing``."""
        self.parser = None
        self.active = self.parsing_exchange = None

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
        if not (self.active is not None or self.queue or (self.parsing is not None and not self.parsing.finished)):
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
        return (not had_its_stream and self.parsing is None and self.rejection is None
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
                self._arm_flush_deadline(sockets.unsent(self.transport))

    def _arm_flush_deadline(self, unsent: int | None) -> None:
        self._close_timer.set_in(self.ctx.timeouts.client_send, functools.partial(self._flush_deadline_passed, unsent))

    def _flush_deadline_passed(self, unsent_before: int | None) -> None:
        unsent = sockets.unsent(self.transport)
        if unsent is not None and unsent_before is not None and unsent < unsent_before:
            self._arm_flush_deadline(unsent)  # it took some since: a slow reader, still reading
        else:
            # A reset, not a close: with the rest unsent, a FIN would make a
            # close-delimited response look complete.
            sockets.reset(self.transport)

    # -- lingering (see linger.py): one mechanism, two stages -----------------------
    def _drain_body(self) -> None:
        """Stage 1: the active exchange answered before its body ended, and keeps the
        turn while the rest is read and thrown away (see on_body)."""
        self._lingering, self._lingered_bytes = _DRAINING, 0
        self.resume_reading("pending")
        self.resume_reading("upstream")
        self._close_timer.set_in(LINGER_SECONDS, self._linger_expired)

    def _body_discarded(self, size: int) -> None:
        self._lingered_bytes += size
        if self._lingering == _DRAINING and self._lingered_bytes > LINGER_MAX_BYTES:
            self._drain_ended(body_complete=False)

    def _drain_ended(self, body_complete: bool) -> None:
        """The drained body ended (the connection is kept if its answer said so), or
        ran out of time or bytes: stage 2 follows (see exchange_finished)."""
        self._lingering = 0
        self._close_timer.clear()
        self.record.body_drained(time.monotonic_ns())
        exchange = self.active
        self.exchange_finished(exchange, body_complete and exchange.keep_client_alive)

    def close_lingering(self) -> None:
        """Stage 2: close a connection the client may still be sending on (a response
        before the end of its request body, a refusal mid-head): a FIN after the reply,
        then what still arrives is read and thrown away, until the client's FIN or
        LINGER_SECONDS."""
        if self.closing:
            return
        self.closing = True  # from here every read is dropped unparsed (see _feed)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self._lingering = _CLOSING
        self.transport.write_eof()
        self.reading_paused_for.clear()
        self.transport.resume_reading()
        self._close_timer.set_in(LINGER_SECONDS, self._linger_expired)

    def _linger_expired(self) -> None:
        if self._lingering == _DRAINING:
            self._drain_ended(body_complete=False)
        elif sockets.unsent(self.transport):
            sockets.reset(self.transport)  # the reply is not all taken: the client must see it cut
        else:
            self.transport.close()

    def shut_down(self, reason: str) -> None:
        """The shutdown grace ran out: every request on this connection ends LR (the
        proxy's doing, not the client's). The pipelined ones are dropped first, so
        that none starts once the grace is over; the one in progress gets its error
        with Connection: close; a head still arriving is ended; then the connection
        closes."""
        self._drop_queue(Flag.LR, reason)
        if self.active is not None:
            self.active.keep_client_alive = False
            self.active.end(Ending.FAILED, Flag.LR, reason)
        if self.parsing is not None and not self.parsing.finished and self.parsing_exchange is None:
            if self.rejection is not None:
                # Refused already (its 4xx waits behind the response before it): the
                # refusal is its outcome, though the connection closes before it is sent.
                _, refused, why = self.rejection
                self.ctx.end_request(self.parsing, refused, why)
            else:
                self.ctx.end_request(self.parsing, Flag.LR, reason)
        self.close()

    def reset(self) -> None:
        """Close with a reset, not a FIN: what was written but not yet sent is lost,
        and the client sees an error rather than an end of data."""
        self.closing = True
        sockets.reset(self.transport)

    def write(self, data: bytes) -> None:
        if not self.transport.is_closing() and self._lingering != _CLOSING:  # nothing after our FIN
            self.transport.write(data)

    def unsent(self) -> int | None:
        return sockets.unsent(self.transport)

    # ---------------------------------------------------------------------------
    # Flow control
    # ---------------------------------------------------------------------------
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

    # ---------------------------------------------------------------------------
    # Parsing
    # ---------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        rest = self._feed(data)
        while rest:  # what followed requests that offered h2c (see _ignore_upgrade_offer)
            rest = self._feed(rest)

    def _feed(self, data: bytes) -> bytes | None:
        """Parse one read; returns the bytes llhttp left after an ignored h2c offer."""
        if self.closing or self.rejection is not None or self.reading_stopped:
            return None
        meter = self._meter
        meter.read_begins(data, self.parsing is not None)
        rest = b""
        self.feeding = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            refusal = (cause.status, cause.reason) if isinstance(cause, H.BadRequest) else None
            pipeline_full = isinstance(cause, _PipelineFull)
            begun_after_close = isinstance(cause, _BegunAfterClose)
            # Its traceback holds this frame, which would hold it: a cycle that would
            # keep the refused connection (and its last read) for the collector.
            del cause
            if refusal is not None:
                self.reject(refusal[0], Flag.DPE, refusal[1])
            elif pipeline_full:
                self._read_no_more()
            elif not begun_after_close:
                raise
            return
        except httptools.HttpParserUpgrade as upgrade:
            if not self._upgrade_offer_ignored:
                self.reject(501, Flag.DPE, "protocol upgrade (Upgrade or CONNECT) is not supported")
                return
            # llhttp stopped after the request that offered h2c (done: it has no body)
            # and resumed; what follows in this read is the next request.
            self._upgrade_offer_ignored = False
            rest = data[upgrade.args[0]:]
        except httptools.HttpParserInvalidMethodError as exc:
            unknown = meter.unknown_method()
            if unknown is not None:
                # RFC 9110 section 9.1: a method the proxy cannot carry is not implemented here.
                self.reject(501, Flag.DPE, f"request method {unknown!r} is not supported")
            else:
                self.reject(400, Flag.DPE, f"malformed request: {exc}")
            return
        except httptools.HttpParserError as exc:
            if self._url == b"*" and self.parser.get_http_version() == "2.0":
                # llhttp pauses at HTTP/2's connection preface (PRI * HTTP/2.0).
                self.reject(505, Flag.DPE, _unsupported_version("2.0"))
            else:
                self.reject(400, Flag.DPE, f"malformed request: {exc}")
            return
        finally:
            self.feeding = False
            if self.active is not None:
                self.active.flush_upstream()
        if rest:
            return rest
        if self.parsing is not None:
            if meter.in_head:
                if meter.head_too_long():
                    self.reject(431, Flag.DPE, f"request head exceeds {self._max_head_bytes} bytes")
                    return
                if meter.line_without_version():
                    self.reject(505, Flag.DPE, _unsupported_version("0.9"))
                    return
            elif meter.chunked:
                if not meter.body_seen:
                    # Chunk-size lines, extensions or trailers only: the client is still
                    # sending, and the body timeout runs between reads, as nginx's does.
                    self.parsing.last_downstream_rx_ns = time.monotonic_ns()
                if meter.framing_too_long():
                    self.reject(431, Flag.DPE, f"request chunk framing or trailers exceed {self._max_head_bytes} bytes")
                    return
        if self._head_timer_pending:
            self._head_timer_pending = False
            self._head_timer.set_in(self.ctx.timeouts.client_headers, self._on_header_timeout)

    def _read_no_more(self) -> None:
        """MAX_PIPELINED requests wait: the connection closes after the last of them
        (its response says so), and what the client sent after it is never read: the
        client resends those requests on a new connection (RFC 9112 section 9.3.2)."""
        last = self.queue[-1]
        last.head.keep_alive = last.keep_client_alive = False
        self.reading_stopped = True
        self.pause_reading("pipeline full")

    def on_message_begin(self) -> None:
        if self.closing:
            # Closed while llhttp went on through this read (a lingering request's body
            # ended, a shutdown): this request can never be answered, and its client
            # resends it on a new connection, so it is never started (run twice else).
            raise _BegunAfterClose
        if len(self.queue) >= MAX_PIPELINED:
            raise _PipelineFull
        now = time.monotonic_ns()
        self._head_timer.clear()  # the keep-alive idle timeout stands down
        self.ctx.connection_busy(self)
        record = self.record.begin_request(now)
        record.owner = self  # until its exchange exists
        # Behind a request in progress, its head is read only as the proxy reads on
        # (it stops at a queued one): until its turn, its silence is not the client's.
        record.waiting_turn = self.active is not None
        self.parsing, self.parsing_exchange = record, None
        self._url, self._headers = b"", []
        self._meter.head_begins(self.queue[-1] if self.queue else self.active, record.sequence)
        self.ctx.start_request(record)
        self._head_timer_pending = self.active is None

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self._max_target_bytes:
            raise H.BadRequest(414, f"request target exceeds {self._max_target_bytes} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        # Called for every header of every request: the size limit is checked once
        # the head is complete (see Hazards: Unbounded heads).
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        record = self.parsing
        meter = self._meter
        meter.in_head = self._head_timer_pending = False
        self._head_timer.clear()  # the head timeout stands down
        method = self.parser.get_method()
        record.method = _METHODS.get(method) or method.decode("ascii", "replace")
        target = self._url  # named now, so that a refusal below still names it
        origin_form = target.startswith(b"/")
        record.target = target.decode("latin-1") if origin_form else H.shown_target(target)
        version = record.http_version = self.parser.get_http_version()
        record.mark(MARK.LAST_DOWNSTREAM_RX_HEADER_BYTE, time.monotonic_ns())
        if self.ctx.fanout.mark_observers:
            self.ctx.fanout.mark(record, MARK.LAST_DOWNSTREAM_RX_HEADER_BYTE)
        if meter.head_exceeds(record.method, self._url, self._headers):
            raise H.BadRequest(431, f"request head exceeds {self._max_head_bytes} bytes")
        if version != "1.1" and version != "1.0":
            # llhttp reads a request line without a version as HTTP/0.9.
            raise H.BadRequest(505, _unsupported_version(version))
        # The usual head, at the read's first byte, is checked here at once.
        if not meter.starts_with_http(method, self._url):
            protocol = meter.unexpected_protocol(method, self._url)
            if protocol is not None:
                raise H.BadRequest(400, f"not an HTTP request line: protocol {protocol.decode('latin-1')!r}")
        upgrade = self.parser.should_upgrade()
        if upgrade and record.method == "CONNECT":
            raise H.BadRequest(501, "CONNECT is not supported: this is a reverse proxy")
        parts = H.parse_request_headers(self._headers, version, self.ctx.request_id_names)
        if upgrade:
            self._ignore_upgrade_offer(parts)
        if not origin_form:
            if target == b"*":
                if record.method != "OPTIONS":  # RFC 9112 section 3.2.4
                    raise H.BadRequest(400, "the asterisk-form target * is only for OPTIONS")
            else:
                absolute = H.split_absolute_form(target)
                if absolute is None:
                    raise H.BadRequest(400, "unsupported request target: expected /path or an http(s):// URL")
                host, target = absolute
                parts = H.with_host(parts, host)
                record.target = target.decode("latin-1")  # what goes upstream: the origin form
        meter.body_begins(parts.framing.chunked, len(self._headers))
        generated_id = self.ctx.identify(record, parts)  # before any refusal, so errors carry the ids
        http11 = record.http_version == "1.1"
        # RFC 9110 section 10.1.1: Expect in an HTTP/1.0 request is ignored (and 1xx
        # responses are never sent to an HTTP/1.0 client); the proxy strips it upstream.
        expect = parts.expect if http11 else None
        if expect is not None and expect.strip().lower() != b"100-continue":
            raise H.BadRequest(417, "unsupported Expect value: only 100-continue is understood")
        head = RequestHead(
            record.method, target, parts, http11,
            self.parser.should_keep_alive() and not self.ctx.shutting_down,
            expect is not None and parts.framing.has_body,
            generated_id,
        )
        exchange = Exchange(self.ctx, self, record, head)
        self.parsing_exchange = exchange
        if self.active is None:
            self._begin(exchange)
        else:
            record.waiting_turn = True
            self.queue.append(exchange)
            self.pause_reading("pipeline")

    def _ignore_upgrade_offer(self, parts: H.RequestParts) -> None:
        """An offer of h2c on a request without a body is answered over HTTP/1.1, as
        RFC 9113 allows (``curl --http2`` sends one); any other upgrade gets 501."""
        if not H.only_offers_h2c(self._headers):
            raise H.BadRequest(501, "protocol upgrade (Upgrade) is not supported: only HTTP/1.1 is proxied")
        if parts.framing.has_body:
            raise H.BadRequest(501, "an Upgrade: h2c offer on a request with a body is not supported: "
                                    "send it without Upgrade")
        self._upgrade_offer_ignored = True

    def on_body(self, body: bytes) -> None:
        self._meter.body_seen = True
        exchange = self.parsing_exchange
        if exchange.finished:  # answered before its body ended: thrown away (see linger.py)
            self._body_discarded(len(body))
        else:
            exchange.request_body(body)

    def on_message_complete(self) -> None:
        meter = self._meter
        if meter.trailers_exceed(self._headers):
            raise H.BadRequest(431, f"request trailers exceed {self._max_head_bytes} bytes")
        meter.message_complete()
        exchange = self.parsing_exchange
        self.parsing, self.parsing_exchange = None, None
        exchange.request_done()
        if self._lingering == _DRAINING and exchange is self.active:
            self._drain_ended(body_complete=True)

    # ---------------------------------------------------------------------------
    # Answering in order
    # ---------------------------------------------------------------------------
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
            self._drain_body()  # it keeps its turn until the rest of its body is read
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
                                                      or self.parsing is not None or self.reading_stopped)
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
        elif self.parsing is None:
            self.ctx.connection_idle(self)
            self._head_timer.set_in(self.ctx.timeouts.client_keepalive, self._on_idle_timeout)
        else:
            # The head begun behind the requests before it: its turn starts now, and
            # its time to complete (the stall verdict, the header timeout) with it.
            self.parsing.waiting_turn = False
            self.parsing.turn_began_ns = time.monotonic_ns()
            self._head_timer.set_in(self.ctx.timeouts.client_headers, self._on_header_timeout)

    def _drop_queue(self, outcome: Outcome, why: str) -> None:
        while self.queue:
            self.queue.popleft().end(Ending.NOT_STARTED, outcome, why)

    # ---------------------------------------------------------------------------
    # Refusals
    # ---------------------------------------------------------------------------
    def reject(self, status: int, outcome: Outcome, reason: str) -> None:
        """Refuse the request being parsed; nothing of it has been forwarded."""
        self.rejection = (status, outcome, reason)
        self.pause_reading("rejected")
        if self.parsing is not None and (self.active is not None or self.queue):
            self.parsing.waiting_turn = True  # its refusal goes out after the responses before it
        broken = self.parsing_exchange
        if broken is not None and broken is self.active:
            # The bad bytes are inside the body of the active request (e.g. a bad
            # chunk size): that request cannot complete, so it is the one that fails.
            self.parsing = None
            self.active.end(Ending.FAILED, outcome, reason, status)
            return
        if broken is not None and broken in self.queue:
            # A pipelined request with a broken body never starts; its 400 goes
            # out in its turn, after the responses before it.
            self.queue.remove(broken)
            self.parsing_exchange = None
        if self.active is None and not self.queue:
            self._send_rejection()

    def abort(self, outcome: Outcome, message: str) -> None:
        """The watchdog's abort of a request whose head is not complete."""
        if self.parsing is not None and not self.parsing.finished and self.rejection is None:
            self.rejection = (outcome.local_status or 408, outcome, message)
            self.pause_reading("rejected")
            if self.active is None:
                self._send_rejection()

    def _send_rejection(self) -> None:
        status, outcome, reason = self.rejection
        record = self.parsing
        # The header lines read before the refusal are this request's, whoever refused
        # it (our checks, or llhttp's, e.g. duplicate lengths): the refusal carries the
        # client's trace context and request id from them, so it can be found by them.
        parts = H.ids_only(self._headers, self.ctx.request_id_names) if record is not None else None
        if record is None or record.finished:
            parts = None
            now = time.monotonic_ns()
            record = self.record.begin_request(now)
            self.ctx.start_request(record)
        elif not record.method and self._url:
            # Refused after its method (llhttp, or a target too long): the refusal names it.
            method = self.parser.get_method()
            record.method = _METHODS.get(method) or method.decode("ascii", "replace")
            if len(self._url) <= self._max_target_bytes:
                record.target = H.shown_target(self._url)
        self.parsing = None
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

    # ---------------------------------------------------------------------------
    # Connection timers (see timer.Timer: a later deadline costs nothing, so none is
    # reset per request)
    # ---------------------------------------------------------------------------
    def aim_exchange_timer(self, due_ns: int, now_ns: int) -> None:
        """Make the exchange timer call the active exchange back no later than ``due_ns``
        (monotonic ns). Due sooner already, it is left alone: the active exchange re-aims
        it when it fires, so its deadlines may move later without a call here."""
        timer = self._exchange_timer
        due = timer.now() + (due_ns - now_ns) / 1e9
        if not timer.due_by(due):
            timer.set(due, self._exchange_timer_fired)

    def exchange_timer_due_within(self, delay_ns: int) -> bool:
        """True when the exchange timer calls the active exchange back within ``delay_ns`` anyway."""
        timer = self._exchange_timer
        return timer.due_by(timer.now() + delay_ns / 1e9)

    def _exchange_timer_fired(self) -> None:
        if self.active is not None:
            self.active.timer_fired()

    def _on_idle_timeout(self) -> None:
        if self.active is None and self.parsing is None:
            self.close()

    def _on_header_timeout(self) -> None:
        if self.closing:
            return
        if self.parsing is not None and not self.parsing.has(MARK.LAST_DOWNSTREAM_RX_HEADER_BYTE):
            waited = self.ctx.timeouts.client_headers
            self.rejection = (408, Flag.DHT, f"request head not complete after {waited:g} s")
            if self.active is None:
                self._send_rejection()
