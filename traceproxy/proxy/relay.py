"""The response half of an exchange: the upstream's parse events relayed to the client.

Theory of operation
-------------------
Each ``forward.Exchange`` has one ``ResponseRelay``, and it is the ``sides.UpstreamUser``
of every upstream connection the exchange is given: the connection reports each parse
event to it directly, so a response's chunks cost no more calls than before the split.
It builds the client's response head, frames the body for the client, writes what one
upstream read produced in one call (``flush_client``), keeps the client's side of flow
control (upstream reads pause while the client is not reading), and notices the
client's acknowledgements for the send deadline. Ending the exchange is not its
business: it calls ``Exchange.end``, and forwards the events that concern the request
as a whole (a lost connection, a protocol error, the upstream's write pause).

A 200 ``text/event-stream`` response with a body (not to HEAD) that has no content
coding is judged on its tokens: the pieces of its body one upstream read brought go
through its ``EventScanner`` (the record's ``stream_events``) together, when the
read is written to the client, and a read that completed an event with output stamps
the record's ``last_token_ns`` (and ``first_token_ns``, ``max_token_gap_ns``), from
which the stall verdicts count (see lifecycle.attribution); how it ended is judged
from the scanner too (see lifecycle.endings). Any other response costs one attribute
test per piece for this.

State, the response's: whether its head went out, its framing, the length promised,
an event stream's scanner, what one read produced, whether the
client is still to take its tail; while the client's connection is full, how much it
had taken and when; and whether the client left once it had the whole stream.

Hazards
-------
* The exchange and its relay refer to each other: at its end the exchange lets go of
  the relay's reference (``exchange`` is None from then), so that no cycle outlives the
  request, and an event after the end is ignored, as it always was.
* A response is complete only after the read that completed it was parsed in full
  (see upstream.py), so ``upstream_response_complete`` never runs inside the parser.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..lifecycle.endings import had_the_whole_stream
from ..lifecycle.marks import MARK
from ..lifecycle.stream_events import OUTPUT, EventScanner
from . import headers as H
from .endings import END

if TYPE_CHECKING:
    from .forward import Exchange

log = logging.getLogger("traceproxy.relay")


class ResponseRelay:
    __slots__ = ("exchange", "record", "client", "ctx", "started", "framing", "chunked", "declared_length", "events",
                 "event_pieces", "client_out", "awaiting_client_drain", "upstream_paused", "client_taken",
                 "client_taken_ns", "client_gone")

    def __init__(self, exchange: Exchange) -> None:
        self.exchange: Exchange | None = exchange  # None once it ended
        self.record = exchange.record
        self.client = exchange.client
        self.ctx = exchange.ctx
        self.started = False  # the response head went to the client
        self.framing = H.ResponseFraming.NONE
        self.chunked = False  # framing is CHUNKED: read once per chunk, so a plain bool
        self.declared_length: int | None = None  # Content-Length we promised the client
        # An event stream's scanner (the record's stream_events): None for any other
        # response, which is then judged on bytes (one attribute test per chunk).
        self.events: EventScanner | None = None
        self.event_pieces: list[bytes] = []  # its pieces in the read being parsed
        self.client_out: list[bytes] = []  # what one upstream read produced for the client
        self.awaiting_client_drain = False  # complete upstream; the client has not taken it all
        self.upstream_paused = False  # upstream reads paused: the client is not reading
        # While the client's connection is full: how much of the response it had taken
        # (acknowledged), and when that last grew (see timeouts.client_send).
        self.client_taken = 0
        self.client_taken_ns = 0
        self.client_gone = False  # it left once it had the whole stream (see Exchange.client_sent_fin)

    # -- the head ------------------------------------------------------------------------
    def upstream_first_byte(self) -> None:
        exchange = self.exchange
        if exchange is not None:
            exchange.stamp_once(MARK.FIRST_UPSTREAM_RX_BYTE, time.monotonic_ns())
            exchange.upload.sent_log = None  # the upstream answered: never resent

    def upstream_response_head(self, status: int, reason: bytes, parts: H.ResponseParts) -> None:
        exchange = self.exchange
        if exchange is None:
            return
        now = time.monotonic_ns()
        record, head, ctx = self.record, exchange.head, self.ctx
        exchange.stamp_once(MARK.FIRST_UPSTREAM_RX_BYTE, now)
        exchange.stamp(now, MARK.LAST_UPSTREAM_RX_HEADER_BYTE, MARK.FIRST_DOWNSTREAM_TX_BYTE)
        record.status = record.attempts[-1].status = status
        exchange.upload.sent_log = None  # the upstream answered: never resent
        framing, length = H.response_framing(status, head.method, parts, head.http11)
        self.framing = framing
        self.chunked = framing == H.ResponseFraming.CHUNKED
        if framing == H.ResponseFraming.LENGTH and length.isdigit():
            self.declared_length = int(length)
        if parts.event_stream and status == 200 and head.method != "HEAD" and not parts.coded:
            self.events = record.stream_events = EventScanner()
        # Keep the client connection only if its request was read to the end and
        # the response has a length the client can see.
        keep_alive = exchange.keep_client_alive = (
            head.keep_alive and exchange.request_complete and framing != H.ResponseFraming.CLOSE
            and not self.client.closing and not ctx.shutting_down  # say so: it closes after this
        )
        self.client_out.append(H.client_response_head(
            status, reason, parts.end_to_end_lines, framing, length, keep_alive, head.http11,
            extra_lines=ctx.response_ids(record), keepalive_timeout=ctx.advertised_keepalive,
        ))
        self.started = True
        record.last_upstream_rx_ns = now
        upstream_read_ns = ctx.upstream_read_ns
        if upstream_read_ns and not self.client.exchange_timer.due_by_ns(now + upstream_read_ns):
            exchange.aim_timer(now)

    # -- the body (per upstream read: nothing here that could be per request) -------------
    def upstream_response_body(self, data: bytes) -> None:
        if self.exchange is None or self.client_gone:  # read to reuse the connection, not forwarded
            return
        now = time.monotonic_ns()
        record = self.record
        if record.upstream_rx_chunks == 0:
            self.exchange.stamp(now, MARK.FIRST_UPSTREAM_RX_BODY_BYTE, MARK.FIRST_DOWNSTREAM_TX_BODY_BYTE)
        elif now - record.last_upstream_rx_ns > record.max_chunk_gap_ns:
            record.max_chunk_gap_ns = now - record.last_upstream_rx_ns
        tail = record.response_tail
        record.response_tail = (tail[1], tail[2], data)
        record.upstream_rx_chunks += 1
        record.upstream_rx_body_bytes += len(data)
        record.last_upstream_rx_ns = now
        if self.events is not None:
            self.event_pieces.append(data)  # judged once per read (see flush_client)
        if self.chunked:
            self.client_out.extend(H.chunk_pieces(data))  # flush_client joins once per read
        else:
            self.client_out.append(data)
        record.downstream_tx_body_bytes += len(data)

    def flush_client(self) -> None:
        """Write everything gathered during one upstream read in one call, and judge
        the events it brought."""
        out = self.client_out
        if out:
            self.client_out = []
            self.client.write(out[0] if len(out) == 1 else b"".join(out))
            self.record.last_downstream_tx_ns = now = time.monotonic_ns()
            pieces = self.event_pieces
            if pieces:
                try:
                    kinds = self.events.feed_pieces(pieces)
                except Exception:  # a scanner bug must not cost the response: bytes judge it from here
                    log.exception("event stream scanner failed; request %s judged on bytes from now",
                                  self.record.request_id)
                    self.events = self.record.stream_events = None
                    kinds = 0
                pieces.clear()
                if kinds & OUTPUT:  # an event with output: a token came now
                    record = self.record
                    last = record.last_token_ns
                    if last is None:
                        record.first_token_ns = now
                    elif now - last > record.max_token_gap_ns:
                        record.max_token_gap_ns = now - last
                    record.last_token_ns = now

    def upstream_response_complete(self, reusable: bool) -> None:
        exchange = self.exchange
        if exchange is None:
            return
        exchange.stamp(time.monotonic_ns(), MARK.LAST_UPSTREAM_RX_BYTE)
        if self.client_gone:  # nothing more goes to the client: it had its whole stream
            exchange.release_upstream(reusable and exchange.request_complete)
            exchange.end(END.CLIENT_HAD_ITS_STREAM)
            return
        if self.chunked:
            self.client_out.append(H.LAST_CHUNK)
        self.flush_client()
        exchange.release_upstream(reusable and exchange.request_complete)
        if self.client.write_paused:
            # The client is not reading the tail; the end waits for its transport to drain.
            self.awaiting_client_drain = True
        else:
            exchange.end(END.COMPLETE)

    # -- the client's flow control ---------------------------------------------------------
    def client_write_paused(self) -> None:
        self.record.downstream_paused_since_ns = now = time.monotonic_ns()
        exchange = self.exchange
        if exchange is None:
            return
        if exchange.upstream is not None and not self.upstream_paused:
            self.upstream_paused = True
            exchange.upstream.pause_reading()
        if self.ctx.client_send_ns:
            self.client_taken, self.client_taken_ns = self.taken_by_client(), now
            exchange.aim_timer(now)  # the send deadline starts now

    def client_write_resumed(self) -> None:
        self.record.downstream_paused_since_ns = None
        exchange = self.exchange
        if self.upstream_paused:
            self.upstream_paused = False
            if exchange is not None and exchange.upstream is not None:
                exchange.upstream.resume_reading()
        if self.awaiting_client_drain and exchange is not None:
            exchange.end(END.COMPLETE)

    def taken_by_client(self) -> int:
        """Response bytes the client has acknowledged so far (grows while it reads)."""
        unsent = self.client.unsent()
        return -1 if unsent is None else self.record.downstream_tx_body_bytes - unsent

    def had_the_whole_stream(self) -> bool:
        """The client, closing, had its whole event stream but the chunked terminator
        (see lifecycle.endings.had_the_whole_stream)."""
        return self.events is not None and had_the_whole_stream(self.record, self.client.unsent())

    def cut(self) -> None:
        """The response started and fails: end it short, so that the client can tell."""
        if self.framing == H.ResponseFraming.CLOSE or self.client.write_paused:
            # Close-delimited: the body ends where the connection ends, and a clean
            # close would read as a complete response. A client not reading: a clean
            # close waits for it to drain what is buffered, which it may never do.
            # Either way the connection is reset instead.
            self.client.reset()

    # -- what concerns the request as a whole ---------------------------------------------
    def upstream_lost(self, exc: BaseException | None, bytes_received: int) -> None:
        if self.exchange is not None:
            self.exchange.upstream_lost(exc, bytes_received)

    def upstream_protocol_error(self, detail: str) -> None:
        if self.exchange is not None:
            self.exchange.upstream_protocol_error(detail)

    def upstream_write_paused(self) -> None:
        if self.exchange is not None:
            self.exchange.upstream_write_paused()

    def upstream_write_resumed(self) -> None:
        if self.exchange is not None:
            self.exchange.upstream_write_resumed()

