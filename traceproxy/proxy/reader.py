"""Reading requests off a client connection: llhttp, and the rules a head must pass.

Theory of operation
-------------------
A ``RequestReader`` (one per client connection) is the llhttp parser's callback
object. It turns reads into requests: it starts a request's record at its first byte,
checks its head strictly (``headers`` holds the header rules, ``head_meter`` the byte
counts llhttp does not give), builds its ``Exchange`` when the head passes, and hands
body bytes and the end of the body to it. What a request's turn means (answering in
order, refusals, pauses, closing) is the client connection's
(``downstream.ClientConnection``), which it tells through a few calls: a request
begins (``request_begins``), its head passed (``request_ready``), its body ended
(``request_read``), a body answered early is thrown away (``lingering.discarded``), and
``reject`` for whatever must be refused.

Hazards
-------
* Pipelining: llhttp parses every request in a read in one ``feed_data`` call, so a
  callback can run for a request begun after the connection decided to close (it is
  stopped with ``_BegunAfterClose``, never started) or past ``MAX_PIPELINED``.
* A refusal raised inside a callback stops llhttp; ``feed`` maps it to ``reject``. The
  exception's traceback holds ``feed``'s frame: it is dropped before ``reject`` runs.
* The reader and its connection refer to each other, and the parser to the reader's
  callbacks: ``close`` breaks both when the connection closes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import httptools

from ..lifecycle.flags import Flag
from ..lifecycle.marks import MARK
from ..lifecycle.timeline import RequestRecord
from . import headers as H
from .forward import Exchange
from .head_meter import HeadMeter
from .request_head import RequestHead

if TYPE_CHECKING:
    from .context import ServerContext
    from .downstream import ClientConnection

# Pipelined requests queued behind the one being answered, at most: past this the
# connection closes after the last one queued (each costs a record and an exchange,
# and a 1 MiB read of minimal GETs would queue 38,000).
MAX_PIPELINED = 32
# The usual methods as str, so that a request does not decode its method.
_METHODS = {m.encode(): m for m in ("GET", "POST", "HEAD", "PUT", "DELETE", "PATCH", "OPTIONS")}


class _BegunAfterClose(Exception):
    """Raised inside llhttp's callback to stop it at a request begun after the
    connection was closed within the same read."""


class _PipelineFull(Exception):
    """Raised inside llhttp's callback to stop it at a request past MAX_PIPELINED."""


def unsupported_version(version: str) -> str:
    return f"HTTP/{version} is not supported: send HTTP/1.1 (or HTTP/1.0)"


class RequestReader:
    def __init__(self, conn: ClientConnection, ctx: ServerContext) -> None:
        self.conn: ClientConnection | None = conn
        self.ctx = ctx
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.meter = HeadMeter(ctx.limits.max_header_bytes, ctx.limits.max_target_bytes)
        self._max_head_bytes = ctx.limits.max_header_bytes
        self._max_target_bytes = ctx.limits.max_target_bytes
        # The request being read now: its record, its exchange once its head passed,
        # and its target and header lines as llhttp hands them over.
        self.parsing: RequestRecord | None = None
        self.parsing_exchange: Exchange | None = None
        self.url = b""
        self.headers: H.Headers = []
        self._upgrade_offer_ignored = False  # see _ignore_upgrade_offer
        # A head began during this read: arm the head timer after it, unless the head
        # also ended in it (the usual case, so most requests never touch the timer).
        self._head_timer_pending = False
        self.stopped = False  # MAX_PIPELINED requests wait: nothing more is read

    def close(self) -> None:
        """The connection closed: let go of it and of the parser (see Hazards)."""
        self.parser = None
        self.conn = None
        self.parsing_exchange = None

    # -- one read --------------------------------------------------------------------
    def feed(self, data: bytes) -> bytes:
        """Parse one read; returns the bytes llhttp left after an ignored h2c offer."""
        conn, meter = self.conn, self.meter
        meter.read_begins(data, self.parsing is not None)
        rest = b""
        conn.feeding = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            refusal = (cause.status, cause.reason) if isinstance(cause, H.BadRequest) else None
            pipeline_full = isinstance(cause, _PipelineFull)
            begun_after_close = isinstance(cause, _BegunAfterClose)
            del cause  # see Hazards: its traceback holds this frame
            if refusal is not None:
                conn.reject(refusal[0], Flag.DPE, refusal[1])
            elif pipeline_full:
                self._read_no_more()
            elif not begun_after_close:
                raise
            return b""
        except httptools.HttpParserUpgrade as upgrade:
            if not self._upgrade_offer_ignored:
                conn.reject(501, Flag.DPE, "protocol upgrade (Upgrade or CONNECT) is not supported")
                return b""
            # llhttp stopped after the request that offered h2c (done: it has no body)
            # and resumed; what follows in this read is the next request.
            self._upgrade_offer_ignored = False
            rest = data[upgrade.args[0]:]
        except httptools.HttpParserInvalidMethodError as exc:
            unknown = meter.unknown_method()
            if unknown is not None:
                # RFC 9110 section 9.1: a method the proxy cannot carry is not implemented here.
                conn.reject(501, Flag.DPE, f"request method {unknown!r} is not supported")
            else:
                conn.reject(400, Flag.DPE, f"malformed request: {exc}")
            return b""
        except httptools.HttpParserError as exc:
            if self.url == b"*" and self.parser.get_http_version() == "2.0":
                # llhttp pauses at HTTP/2's connection preface (PRI * HTTP/2.0).
                conn.reject(505, Flag.DPE, unsupported_version("2.0"))
            else:
                conn.reject(400, Flag.DPE, f"malformed request: {exc}")
            return b""
        finally:
            conn.feeding = False
            if conn.active is not None:
                conn.active.flush_upstream()
        if rest:
            return rest
        refusal = self._limit_passed() if self.parsing is not None else None
        if refusal is not None:
            conn.reject(refusal[0], Flag.DPE, refusal[1])
        elif self._head_timer_pending:
            self._head_timer_pending = False
            conn.arm_head_timer()
        return b""

    def _limit_passed(self) -> tuple[int, str] | None:
        """At the end of a read, the request in progress checked for what cannot wait
        for its head or body to end (see head_meter)."""
        meter = self.meter
        if meter.in_head:
            if meter.head_too_long():
                return 431, f"request head exceeds {self._max_head_bytes} bytes"
            if meter.line_without_version():
                return 505, unsupported_version("0.9")
        elif meter.chunked:
            if meter.body_seen:
                meter.since_body = meter.data  # where its framing is looked for from (see trailers.py)
                return None
            # Chunk framing or trailers alone: the client is still sending, and the body
            # timeout runs between reads, as nginx's does.
            self.parsing.last_downstream_rx_ns = time.monotonic_ns()
            if meter.trailers_too_long():
                return 431, f"request trailers exceed {self._max_head_bytes} bytes"
        return None

    def _read_no_more(self) -> None:
        """MAX_PIPELINED requests wait: the connection closes after the last of them
        (its response says so), and what the client sent after it is never read: the
        client resends those requests on a new connection (RFC 9112 section 9.3.2)."""
        conn = self.conn
        last = conn.queue[-1]
        last.head.keep_alive = last.keep_client_alive = False
        self.stopped = True
        conn.pause_reading("pipeline full")

    # -- llhttp callbacks (inside feed_data) ---------------------------------------------
    def on_message_begin(self) -> None:
        conn = self.conn
        if conn.closing:
            # Closed while llhttp went on through this read (a lingering request's body
            # ended, a shutdown): this request can never be answered, and its client
            # resends it on a new connection, so it is never started (run twice else).
            raise _BegunAfterClose
        if len(conn.queue) >= MAX_PIPELINED:
            raise _PipelineFull
        record = conn.request_begins()
        self.parsing, self.parsing_exchange = record, None
        self.url, self.headers = b"", []
        self.meter.head_begins(conn.queue[-1] if conn.queue else conn.active, record.sequence)
        self.ctx.start_request(record)
        self._head_timer_pending = conn.active is None

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > self._max_target_bytes:
            raise H.BadRequest(414, f"request target exceeds {self._max_target_bytes} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        # Called for every header of every request: the size limit is checked once
        # the head is complete (see head_meter).
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        record = self.parsing
        self.meter.in_head = self._head_timer_pending = False
        self.conn.head_timer.callback = None  # the head timeout stands down (Timer.clear)
        exchange = Exchange(self.ctx, self.conn, record, self._checked_head(record))
        self.parsing_exchange = exchange
        self.conn.request_ready(exchange)

    def _checked_head(self, record: RequestRecord) -> RequestHead:
        """The head as the proxy carries it, once it passed every rule (else BadRequest).
        The record is named first (method, target, version, the head's last byte), so
        that a refusal names them too."""
        parser, meter, ctx = self.parser, self.meter, self.ctx
        method = parser.get_method()
        record.method = _METHODS.get(method) or method.decode("ascii", "replace")
        target = self.url  # named now, so that a refusal below still names it
        origin_form = target.startswith(b"/")
        record.target = target.decode("latin-1") if origin_form else H.shown_target(target)
        version = record.http_version = parser.get_http_version()
        record.mark(MARK.LAST_DOWNSTREAM_RX_HEADER_BYTE, time.monotonic_ns())
        if ctx.fanout.mark_observers:
            ctx.fanout.mark(record, MARK.LAST_DOWNSTREAM_RX_HEADER_BYTE)
        if meter.head_exceeds(record.method, self.url, self.headers):
            raise H.BadRequest(431, f"request head exceeds {self._max_head_bytes} bytes")
        if version != "1.1" and version != "1.0":
            # llhttp reads a request line without a version as HTTP/0.9.
            raise H.BadRequest(505, unsupported_version(version))
        # The usual head, at the read's first byte, is checked here at once.
        if not (meter.head_start == 0 and meter.begun and meter.data.startswith(b"HTTP/", len(method) + len(self.url) + 2)):
            protocol = meter.unexpected_protocol(method, self.url)
            if protocol is not None:
                raise H.BadRequest(400, f"not an HTTP request line: protocol {protocol.decode('latin-1')!r}")
        upgrade = parser.should_upgrade()
        if upgrade and record.method == "CONNECT":
            raise H.BadRequest(501, "CONNECT is not supported: this is a reverse proxy")
        parts = H.parse_request_headers(self.headers, version, ctx.request_id_names, ctx.conversation_id_name)
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
        if parts.framing.chunked:
            meter.chunked_body_begins(len(self.headers))
        generated_id = ctx.identify(record, parts)  # before any refusal, so errors carry the ids
        http11 = version == "1.1"
        # RFC 9110 section 10.1.1: Expect in an HTTP/1.0 request is ignored (and 1xx
        # responses are never sent to an HTTP/1.0 client); the proxy strips it upstream.
        expect = parts.expect if http11 else None
        if expect is not None and expect.strip().lower() != b"100-continue":
            raise H.BadRequest(417, "unsupported Expect value: only 100-continue is understood")
        return RequestHead(record.method, target, parts, http11, parser.should_keep_alive() and not ctx.shutting_down,
                           expect is not None and parts.framing.has_body, generated_id)

    def _ignore_upgrade_offer(self, parts: H.RequestParts) -> None:
        """An offer of h2c on a request without a body is answered over HTTP/1.1, as
        RFC 9113 allows (``curl --http2`` sends one); any other upgrade gets 501."""
        if not H.only_offers_h2c(self.headers):
            raise H.BadRequest(501, "protocol upgrade (Upgrade) is not supported: only HTTP/1.1 is proxied")
        if parts.framing.has_body:
            raise H.BadRequest(501, "an Upgrade: h2c offer on a request with a body is not supported: "
                                    "send it without Upgrade")
        self._upgrade_offer_ignored = True

    def on_body(self, body: bytes) -> None:
        self.meter.body_seen = True
        exchange = self.parsing_exchange
        if exchange.finished:  # answered before its body ended: thrown away (see linger.py)
            self.conn.lingering.discarded(len(body))
        else:
            exchange.request_body(body)

    def on_message_complete(self) -> None:
        meter = self.meter
        if meter.chunked:
            if meter.trailers_exceed(self.headers):
                raise H.BadRequest(431, f"request trailers exceed {self._max_head_bytes} bytes")
            meter.chunked, meter.since_body = False, b""
        exchange = self.parsing_exchange
        self.parsing, self.parsing_exchange = None, None
        exchange.request_done()
        if self.conn.lingering.stage:  # a body answered early was being drained (see linger.py)
            self.conn.request_read(exchange)

    # -- for a refusal of the request being read -------------------------------------------
    def refused_parts(self, record: RequestRecord) -> H.RequestParts:
        """The ids among the header lines read before the refusal, whoever refused it
        (our checks, or llhttp's, e.g. duplicate lengths), so that it can be found by
        them; and its method and target, when llhttp got that far."""
        if not record.method and self.url:
            method = self.parser.get_method()
            record.method = _METHODS.get(method) or method.decode("ascii", "replace")
            if len(self.url) <= self._max_target_bytes:
                record.target = H.shown_target(self.url)
        return H.ids_only(self.headers, self.ctx.request_id_names)
