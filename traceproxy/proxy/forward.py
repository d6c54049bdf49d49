"""One request through the proxy: the phases in the order a request lives them.

Theory of operation
-------------------
An ``Exchange`` carries one request from its complete head to its one ending. Read top
to bottom: start (it waits for the pool as a ``sides.ConnectionWaiter``), upstream ready
(send head and body), the request body, what ends it, and the deadlines. What it owes
the upstream is its ``upload.Upload``; its response is relayed to the client by its
``relay.ResponseRelay``, the upstream connection's user. It sees its client connection
only as ``sides.ClientSide`` and its upstream connection as ``sides.UpstreamSide``.

Every way out goes through ``end``, with the reason as data (``endings.Ending``): it
stamps the outcome once, tells the observers once (``on_done``) and hands the client
connection back. State by lifetime: the request's (head, record, whether it was read
whole, whether the client connection is kept), the upstream attempt's (connection,
pool answer awaited, upload), the response's (the relay), and the tail wait's.

Hazards
-------
* Retry safety: a request is resent only when it failed on a *reused* upstream
  connection before any response byte, only once, and only if every byte sent so
  far is still held (``pool.retry_buffer_bytes``). The resend goes to a fresh
  connection, and its failure is final.
* Truncation must look like truncation: once the response head went out, a failure
  closes the client connection without the terminating chunk (or short of
  Content-Length). ``end`` never writes a clean ending for a failed request.
* Backpressure both ways: the client not reading pauses upstream reads; the
  upstream not reading pauses client reads. Silence caused by our own pause never
  counts against the other side's timeout.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..lifecycle.deadlines import client_took_more, expiry, next_deadline
from ..lifecycle.endings import close_reason, judge_clean_ending, judge_client_leaving, lost_connection, where
from ..lifecycle.flags import Flag, Outcome
from ..lifecycle.marks import MARK, Mark
from ..lifecycle.timeline import RequestRecord
from . import headers as H
from . import tracecontext as tc
from .bodies import inject_rid, wants_rid
from .endings import END, Ending
from .linger import drainable
from .local_reply import body_size, error_response
from .relay import ResponseRelay
from .request_head import RequestHead, upstream_head
from .timer import Timer
from .upload import Upload, keep_body_evidence

if TYPE_CHECKING:
    from .context import ServerContext
    from .sides import ClientSide, UpstreamSide

# How long the upstream's last bytes are waited for after the client left at the
# stream's end (see Exchange.client_sent_fin), before its connection is closed instead.
UPSTREAM_TAIL_SECONDS = 0.5  # the engine must see the close within a second of the client leaving


class Exchange:
    # Slots: one Exchange is built per request, and every phase reads its fields.
    __slots__ = ("ctx", "client", "record", "head", "finished", "request_complete", "keep_client_alive", "_started_ns",
                 "_expects_body", "_mark_observers", "upstream", "awaiting_connection", "upload", "response",
                 "_tail_timer")

    def __init__(self, ctx: "ServerContext", client: "ClientSide", record: RequestRecord, head: RequestHead):
        # The request: one per exchange.
        self.ctx = ctx
        self.client = client
        self.record = record
        record.owner = self
        self.head = head
        self.finished = False
        self.request_complete = False
        self.keep_client_alive = head.keep_alive
        self._started_ns = 0
        self._expects_body = head.framing.has_body
        self._mark_observers = ctx.fanout.mark_observers  # the list itself: observers added later count
        # The upstream side, per attempt: the connection, the pool's answer awaited, and
        # what is owed to it (kept for one resend, see upload.py). With rid injection
        # the body is held until complete, then rewritten, and only then is a
        # connection taken (its length goes in the head).
        self.upstream: UpstreamSide | None = None
        self.awaiting_connection = False  # asked the pool, not answered yet (see sides.ConnectionWaiter)
        self.upload = Upload(ctx.retry_buffer_bytes,
                             ctx.inject_rid and wants_rid(head.method, head.target, head.framing.content_length))
        # The response: relayed to the client by its own half, the upstream connection's
        # user (see relay.py); and, once the client left with its whole stream, the wait
        # for the upstream's last bytes (see client_sent_fin).
        self.response = ResponseRelay(self)
        self._tail_timer: Timer | None = None

    # -- phase: awaiting an upstream connection -----------------------------------
    def start(self) -> None:
        self._started_ns = now = time.monotonic_ns()
        # On a keep-alive connection the timer is usually armed already, due before
        # any deadline of this request can be: it re-aims when it fires.
        if not self.client.exchange_timer.due_by_ns(now + self.ctx.first_request_deadline_ns):
            self.aim_timer(now)
        if self.upload.rewrite is None or self.request_complete:
            self._acquire(fresh=False)

    def _acquire(self, fresh: bool) -> None:
        # Its CLIENT span exists from here, connection or not (a refused connect, a
        # wait at the pool cap): the span id is the parent the upstream will see.
        self.record.new_attempt(time.monotonic_ns(), tc.new_span_id())
        self.awaiting_connection = True  # before: a reused connection is handed over within acquire
        self.ctx.pool.acquire(self, fresh=fresh)

    def connection_queued(self) -> None:
        self.stamp(time.monotonic_ns(), MARK.POOL_QUEUED)

    def connection_opening(self) -> None:
        self.record.attempt.connecting_since_ns = time.monotonic_ns()

    def connection_ready(self, conn: "UpstreamSide", reused: bool) -> None:
        self.awaiting_connection = False
        if self.finished:
            self.ctx.pool.release(conn)
            return
        now = time.monotonic_ns()
        attempt = self.record.attempts[-1]  # the one _acquire started
        attempt.attach(conn.record, reused, now)
        self.stamp(now, MARK.POOL_ACQUIRED, MARK.FIRST_UPSTREAM_TX_BYTE)
        self.upstream = conn
        conn.begin_response(self.response, head_only=self.head.method == "HEAD")
        upload = self.upload
        upload.out.append(upstream_head(self.ctx, self.head, self.record, attempt, self.client.forwarding))
        if upload.held:
            self._send_upstream(upload.release_held())
        elif not self.client.feeding:
            self.flush_upstream()
        if self.request_complete:
            self.stamp(now, MARK.LAST_UPSTREAM_TX_BYTE)
        self.client.resume_reading("pending")
        if conn.write_paused:  # still full of the request before (a resend, an early answer)
            self.upstream_write_paused()

    def connection_failed(self, error: str) -> None:
        self.awaiting_connection = False
        self.end(END.FAILED, Flag.UF, f"while connecting to {self.ctx.upstream_authority}: {error}")

    # -- phase: the request body (client -> upstream) ------------------------------
    def request_body(self, data: bytes) -> None:
        if self.finished:
            return
        record = self.record
        record.downstream_rx_body_bytes += len(data)
        record.last_downstream_rx_ns = time.monotonic_ns()
        keep_body_evidence(record, data, self.ctx.fanout.request_body_tail_bytes)
        if self.upload.rewrite is not None:
            self.upload.rewrite.append(data)
            return
        framed = H.chunk(data) if self.head.framing.chunked else data
        if self.upstream is not None:
            self._send_upstream(framed)
        else:
            self._hold(framed)

    def request_done(self) -> None:
        if self.finished:
            self.request_complete = True  # its body was read to throw it away (see linger.py)
            return
        now = time.monotonic_ns()
        self.stamp(now, MARK.LAST_DOWNSTREAM_RX_BYTE)
        # The last request byte may be framing after a pause (a chunked body's end):
        # the header timeout counts from it.
        self.record.last_downstream_rx_ns = now
        self.request_complete = True
        if self.ctx.header_timeout_shorter:
            self._aim_at_the_header_timeout(now)
        if self.upload.rewrite is not None:
            self._send_rewritten_body()
            return
        tail = H.LAST_CHUNK if self.head.framing.chunked else b""
        if self.upstream is not None:
            if tail:
                self._send_upstream(tail)
            self.stamp(now, MARK.LAST_UPSTREAM_TX_BYTE)
        elif tail:
            self._hold(tail)

    def _aim_at_the_header_timeout(self, now: int) -> None:
        """The header timeout applies from here (the body is no longer the client's to
        send, or the proxy stopped reading it): the timer, aimed at the body deadline,
        may be due later than it, when the header timeout is the shorter. (When it is
        the longer, the timer fires first and re-aims itself.)"""
        upstream_headers_ns = self.ctx.upstream_headers_ns
        if (self.ctx.header_timeout_shorter and self._expects_body and not self.response.started
                and not self.finished and not self.client.exchange_timer.due_by_ns(now + upstream_headers_ns)):
            self.aim_timer(now)

    def _send_rewritten_body(self) -> None:
        upload = self.upload
        body = inject_rid(b"".join(upload.rewrite), self.record.request_id)
        upload.rewrite = None
        self.head.with_length(len(body))
        self._hold(body)
        if self._started_ns:
            self._acquire(fresh=False)

    def _hold(self, data: bytes) -> None:
        if self.upload.hold(data):
            self.client.pause_reading("pending")
            self._aim_at_the_header_timeout(time.monotonic_ns())

    def _send_upstream(self, data: bytes) -> None:
        if data:
            self.upload.send(data)
            if not self.client.feeding:
                self.flush_upstream()

    def flush_upstream(self) -> None:
        """Write what one client read produced in one call (head and body together)."""
        upload = self.upload
        out = upload.out
        if out and self.upstream is not None:
            upload.out = []
            self.upstream.send(out[0] if len(out) == 1 else b"".join(out))

    def upstream_write_paused(self) -> None:
        self.record.upstream_paused_since_ns = now = time.monotonic_ns()
        self.client.pause_reading("upstream")
        self._aim_at_the_header_timeout(now)

    def upstream_write_resumed(self) -> None:
        self.record.upstream_paused_since_ns = None
        self.record.upstream_resumed_ns = time.monotonic_ns()
        self.client.resume_reading("upstream")

    # -- the response (see relay.ResponseRelay): the client's flow control -----------
    def client_write_paused(self) -> None:
        self.response.client_write_paused()

    def client_write_resumed(self) -> None:
        self.response.client_write_resumed()

    def release_upstream(self, reusable: bool) -> None:
        conn, self.upstream = self.upstream, None
        if conn is None:
            return
        if self.response.upstream_paused and conn.resume_reading():
            self.response.upstream_paused = False
        if reusable:
            self.ctx.pool.release(conn)
        else:
            self._let_go(conn, "not reusable after this response")

    def _let_go(self, conn: "UpstreamSide", why: str, reset: bool = False) -> None:
        """Close this attempt's connection for good, and mark when."""
        self.stamp_once(MARK.UPSTREAM_CLOSED, time.monotonic_ns())
        self.ctx.pool.discard(conn, why, reset=reset)

    # -- what ends it from either side -----------------------------------------
    def upstream_lost(self, exc: BaseException | None, bytes_received: int) -> None:
        if self.finished:
            return
        self.upstream = None
        if self.response.client_gone:  # its stream had ended, and nobody reads the rest
            self.end(END.CLIENT_HAD_ITS_STREAM)
            return
        self.stamp_once(MARK.UPSTREAM_CLOSED, time.monotonic_ns())
        attempt = self.record.attempt
        outcome, detail = lost_connection(
            attempt, bytes_received, self.upload.sent_log is not None, self.upload.sent_size, self.ctx.retry_buffer_bytes,
            where(self.ctx.upstream_authority, attempt), close_reason(exc))
        if outcome is None:
            self._resend_on_fresh_connection(detail)
            return
        if outcome is Flag.SRC:
            self.ctx.pool.stats["stale_not_retried"] += 1
        self.end(END.FAILED, outcome, detail)

    def _resend_on_fresh_connection(self, detail: str) -> None:
        attempt = self.record.attempt
        attempt.outcome, attempt.error = Flag.SRC, detail
        self.ctx.pool.stats["stale_retried"] += 1
        # The dead connection's write pause dies with it: the fresh one starts unpaused.
        if self.record.upstream_paused_since_ns is not None:
            self.upstream_write_resumed()
        self.upload.resend()
        self._acquire(fresh=True)

    def upstream_protocol_error(self, detail: str) -> None:
        self.end(END.FAILED, Flag.UPE, f"{where(self.ctx.upstream_authority, self.record.attempt)}: {detail}")

    def client_closed(self, now: int) -> None:
        """Stamp the client connection's end on this request, if it was still open."""
        if not self.finished:
            self.stamp_once(MARK.DOWNSTREAM_CLOSED, now)

    def client_sent_fin(self) -> bool:
        """The client closed with a FIN: judged now, before anything more comes from the
        upstream. True when it had its whole stream: the request then ends OK, not DC,
        once the upstream's last bytes (the chunked terminator after data: [DONE]) are
        read, so that its connection can be pooled; the openai SDK stops reading at
        [DONE]. They are not waited on for long."""
        if self.finished or not self.response.had_the_whole_stream():
            return False
        # From now: the upstream's bytes (in this very loop pass too) are past it.
        self.response.client_gone = True
        self._tail_timer = Timer()
        self._tail_timer.set_in(UPSTREAM_TAIL_SECONDS, self.end_without_tail)
        self.ctx.tail_waits.add(self)  # its client connection is gone: shutdown finds it here
        return True

    def end_without_tail(self) -> None:
        """Stop waiting for the upstream's last bytes after the client left with its
        whole stream (see client_sent_fin): the upstream connection is closed."""
        self.end(END.CLIENT_HAD_ITS_STREAM)

    def abort(self, outcome: Outcome, message: str, status: int | None = None) -> None:
        """The watchdog's abort (see lifecycle.timeline.RequestOwner)."""
        self.end(END.FAILED, outcome, message, status)

    # -- the end: one way out, the reason as data (see endings.Ending) ---------
    def end(self, ending: Ending, outcome: Outcome = Flag.OK, detail: str | None = None,
            status: int | None = None) -> None:
        """End the exchange, once: the reason says what the client is sent and what
        becomes of the upstream connection; the outcome is stamped and the observers
        told (``ServerContext.end_request``), then the client connection is handed
        back. ``status``: for the client of a FAILED exchange whose response has not
        started (else the outcome's own). A second call does nothing."""
        if self.finished:
            return
        response = self.response
        if response.client_gone:  # it had its whole stream: whatever ends it now is past that
            if ending is END.CLIENT_LEFT:
                return  # its close was judged already; the upstream's last bytes are still awaited
            ending, outcome, detail = END.CLIENT_HAD_ITS_STREAM, Flag.OK, None
        drain = False
        if ending is END.COMPLETE:
            response.awaiting_client_drain = False
            self.stamp(time.monotonic_ns(), MARK.LAST_DOWNSTREAM_TX_BYTE)
            outcome, detail = judge_clean_ending(self.record, response.declared_length)
        elif ending is END.CLIENT_HAD_ITS_STREAM:
            self.release_upstream(reusable=False)
            # OK as judged when it left (USE after an in-band error): what came after is
            # nobody's response.
            self.stamp_once(MARK.LAST_DOWNSTREAM_TX_BYTE, self.record.last_downstream_tx_ns or time.monotonic_ns())
            outcome, detail = judge_client_leaving(self.record, Flag.OK, None)
        elif ending.resets_upstream:
            if ending is END.CLIENT_LEFT:
                outcome, detail = judge_client_leaving(self.record, outcome, detail)
            self._give_up_upstream(outcome)
            if ending is END.FAILED:
                drain = self._answer_failure(outcome, detail, status)
        self.finished = True
        response.exchange = None  # see relay.py, Hazards: no cycle outlives the request
        if self._tail_timer is not None:
            self._tail_timer.cancel()
            self.ctx.tail_waits.discard(self)
        self.upload.out.clear()
        self.ctx.end_request(self.record, outcome, detail)
        if ending.hands_back:
            self.client.exchange_finished(self, self.keep_client_alive, drain)

    def _give_up_upstream(self, outcome: Outcome) -> None:
        conn, self.upstream = self.upstream, None
        if conn is not None:
            # A reset: the engine sees it now, even behind request bytes it has not read.
            self._let_go(conn, outcome.name, reset=True)
        if self.awaiting_connection:
            self.awaiting_connection = False
            self.ctx.pool.give_up(self)

    def _answer_failure(self, outcome: Outcome, detail: str, status: int | None) -> bool:
        """The client's side of a failure: an error reply while nothing of the response
        reached it, else the response cut short so that it can tell. True when the rest
        of the request body is to be drained (see linger.py)."""
        self.response.client_out.clear()
        if self.response.started and self.record.last_downstream_tx_ns is not None:
            self.keep_client_alive = False
            self.response.cut()
            return False
        # Nothing of the response reached the client yet (its head may have been
        # parsed in the very read that then failed): it can still get the error.
        drain = False
        if not self.request_complete:
            # Drain the rest of the body, then keep the connection, as nginx does; but
            # not after a body timeout (the client is stalled) or a body the parser
            # refused (nothing after it can be read).
            drain = outcome not in (Flag.DBT, Flag.DPE)
            self.keep_client_alive = (self.keep_client_alive and drain
                                      and drainable(self.head.framing, self.record.downstream_rx_body_bytes))
        status = status or outcome.local_status or 502
        reply = error_response(status, outcome, detail, self.keep_client_alive, self.head.http11,
                               extra_lines=self.ctx.response_ids(self.record), head_only=self.head.method == "HEAD")
        self.client.write(reply)
        self.record.status = status
        self.record.downstream_tx_body_bytes += body_size(reply)
        now = time.monotonic_ns()
        self.stamp_once(MARK.FIRST_DOWNSTREAM_TX_BYTE, now)
        self.stamp(now, MARK.LAST_DOWNSTREAM_TX_BYTE)
        return drain

    # -- deadlines ------------------------------------------------------------------
    # One timer, aimed at the nearest deadline and re-aimed when it fires, never reset
    # per chunk. It is the client connection's and outlives the exchange: the next
    # request on a keep-alive connection adopts it (its deadlines are later, so the
    # old one fires first and this re-aims it), instead of creating and cancelling one.
    def _next_deadline(self, now: int) -> tuple[int, Outcome] | None:
        """(deadline ns, outcome) of the limit that expires first (see lifecycle.deadlines)."""
        record, response = self.record, self.response
        started = response.started
        return next_deadline(
            now, self.ctx, started_ns=self._started_ns, last_client_byte_ns=record.last_downstream_rx_ns,
            expects_body=self._expects_body, request_complete=self.request_complete,
            reading_paused=self.client.reading_paused, response_started=started,
            response_complete=started and record.has(MARK.LAST_UPSTREAM_RX_BYTE),
            last_upstream_byte_ns=record.last_upstream_rx_ns, upstream_paused_by_client=response.upstream_paused,
            client_paused=record.downstream_paused_since_ns is not None, client_taken_ns=response.client_taken_ns,
        )

    def aim_timer(self, now: int) -> None:
        nearest = self._next_deadline(now)
        if nearest is not None:
            self.client.exchange_timer.aim(nearest[0], now)

    def timer_fired(self) -> None:
        """The client connection's exchange timer fired while this exchange is its active one."""
        if self.finished:
            return
        now = time.monotonic_ns()
        nearest = self._next_deadline(now)
        if nearest is None:
            return
        due, expired = nearest
        if due > now:
            self.client.exchange_timer.aim(due, now)
            return
        if expired is Flag.DNR:
            response = self.response
            taken = response.taken_by_client()
            if client_took_more(taken, response.client_taken):
                response.client_taken, response.client_taken_ns = taken, now
                self.aim_timer(now)
                return
        passed = expiry(expired, due, now, self.record, self.ctx, where(self.ctx.upstream_authority, self.record.attempt),
                        self.ctx.pool.max_connections)
        if not passed.client_kept:
            self.keep_client_alive = False
        self.end(END.FAILED, passed.outcome, passed.detail)

    # -- marks ----------------------------------------------------------------------
    def stamp(self, now: int, *marks: Mark) -> None:
        """Stamp one or more marks at ``now`` (edges crossed in the same moment go together)."""
        record = self.record
        for mark in marks:
            record.mark(mark, now)
        if self._mark_observers:
            for mark in marks:
                self.ctx.fanout.mark(record, mark)

    def stamp_once(self, mark: Mark, now: int) -> None:
        if self.record.mark_once(mark, now) and self._mark_observers:
            self.ctx.fanout.mark(self.record, mark)
