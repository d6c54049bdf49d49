"""The upstream side: pooled keep-alive connections to the router or engine.

Hazards this module exists for
------------------------------
* The keep-alive race. uvicorn-based engines close idle connections after 5 s;
  a pool that reuses a connection the engine is closing sends a request into a
  socket that is about to be reset. Three defences, in order: the pool's idle
  timeout defaults below the engine's (``pool.idle_timeout``); an idle connection
  that sees EOF, an error or any stray byte removes itself from the pool at once
  (``UpstreamConnection.eof_received`` / ``connection_lost``); and a request that
  fails on a *reused* connection before any response byte is resent once on a fresh
  connection by ``forward.Exchange`` (never for fresh connections).
* Bursts after a pause. An idle timeout below the engine's means a pool emptied by
  every pause longer than 4 s, and a burst of N requests after it waits for N new
  connections (on a busy engine or router, accepting them is slow). With
  ``pool.keep_warm`` the pool remembers its peak use over that many seconds and
  keeps that many connections open, replacing each idle one with a fresh one
  before it reaches the idle timeout (so none ever outlives it). Replacing is
  make-before-break and spread out: a connection is due two sweep intervals before
  its idle timeout, its replacement opens within half an interval (the other half
  is the connect's allowance), and each one connected retires the oldest due idle
  one. So neither the proxy nor the upstream ever sees hundreds of connects at once
  (a burst landing on a mass renewal waited for the upstream to accept them all),
  and at ``max_connections`` renewing never opens past the cap. A connection opened
  ahead of demand waits idle like any other: handed out, it counts as reused (it
  can go stale like one, and a request on it is resent the same way).
* Clients that each sent a request, then burst. Peak use says nothing of clients
  whose requests never overlapped (agents that each made a first call, a warm-up
  request per connection), and a sweep comes too late for them: as a keep-alive
  client connection sends its first request, the pool opens one connection ahead
  while fewer are open than such client connections (``warm_for_clients``), so
  their burst finds them ready (if it comes within the idle timeout). That is at
  most one connect per client connection, and nothing renews them beyond peak
  use: unless demand uses them, they expire at the idle timeout. Requests that
  send ``Connection: close`` never make the pool open any, and clients that open a
  connection per request rarely do: each such connection holds the one it took.
  A failed connect ahead stops them (``spares_failing``) until the sweep's probe
  survives, or a request's connection comes back reusable.
* An upstream that accepts and at once closes (a load balancer with no healthy
  backend, a router restarting) must not turn keep-warm into a connect storm, nor
  teach the keep-alive learner an idle timeout of zero: a connection opened ahead
  that the upstream closes before it carried a request, within a sweep interval,
  counts as a failed connect. While connects ahead fail, one a sweep probes; they
  resume in full once one survives to the next sweep.
* A connect cancelled (timeout, shutdown) in the loop turn it completed still gets
  ``connection_made``; such a connection is abandoned: aborted there, never handed
  over or pooled.
* Parsers and responses. httptools (llhttp) cannot be told "this was a HEAD", so a
  parser is carried over to the next response only when the last one completed in
  it (never after HEAD, 204 or 304, whose body llhttp would still wait for); and a
  response is only declared complete after ``feed_data`` returns: releasing the
  connection from inside a parser callback would let the rest of the same buffer
  be parsed as the *next* user's response.
* Trailers. A response's trailer section is held to ``limits.max_header_bytes`` by its
  field lines alone (never its chunk framing), however the reads cut it: at the body's
  end from the bytes, and between body reads by a watch over the reads that carry no
  body data (httptools gathers a field until its line ends). A read with body data
  costs nothing for it; the end of a chunked body costs one test (see trailers.py).
* Repeated heads. An engine answers with the same head bytes response after
  response (an SSE head has no length). When a response's first read starts with
  the bytes of the last head parsed in full, it is fed to a second parser that
  has no header callbacks: llhttp still parses and checks every byte, and the
  head's status, reason and parts are taken from the pool's record of those
  bytes. That saves a Python callback per header on every such response.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import functools
import logging
import re
import time
from typing import TYPE_CHECKING

import httptools

from ..lifecycle.timeline import UpstreamConnectionRecord
from . import headers as H
from . import sockets
from .timer import Timer
from .trailers import NO_TRAILERS_END, TrailerWatch, section_at_end

if TYPE_CHECKING:
    from .sides import ConnectionWaiter, UpstreamUser

log = logging.getLogger("traceproxy.upstream")


# A connection opened ahead of demand that the upstream closes sooner than this after
# accepting it was refused, not timed out.
SPARE_CLOSED_AT_ONCE_NS = 100_000_000
# The status line of an interim (1xx) response, which the proxy consumes.
_INTERIM_STATUS_LINE = re.compile(rb"HTTP/1\.[01] 1[0-9][0-9][ \r]")
# What the current response still awaits, counting down (plain ints, read on every
# read and in every parser callback): its final head (also across interim 1xx
# messages, which the proxy consumes), the end of its body, or nothing: 0, complete,
# is the one false value, so "complete?" is a truth test.
_COMPLETE, _IN_BODY, _IN_INTERIM, _AWAITING_HEAD = range(4)


class Phase(enum.Enum):
    """Where an upstream connection is in its life. What else it has (how it was opened,
    whether the pool closed it, its write pause, its current response) is independent."""

    CONNECTING = "connecting"  # for a request (opening_for) or ahead of demand (opened_ahead)
    GIVEN_UP = "given up"  # the connect was cancelled (the request left, shutdown): aborted if it connects
    TIMED_OUT = "timed out"  # the connect outran timeouts.connect: a failure; aborted if it connects
    OPEN = "open"  # connected: idle in the pool, or carrying a request (user)
    CLOSED = "closed"  # connection_lost ran, or the connect ended without a connection


class Origin(enum.Enum):
    """Why an upstream connection was opened."""

    REQUEST = "for a request"
    AHEAD = "ahead of demand"  # keep_warm: idle once connected, handed out as reused
    RENEWAL = "ahead, in place of a due idle one"  # retires the oldest due idle one once connected


_NOT_CONNECTED_YET = (Phase.CONNECTING, Phase.GIVEN_UP, Phase.TIMED_OUT)
_CLOSED = Phase.CLOSED  # read on every release and reuse: a module name, not a property


class UpstreamConnection(asyncio.Protocol):
    """One pooled connection to the upstream. Its state, by lifetime: the connection's
    ``phase`` (one at a time) and what is independent of it (its ``origin``, whether
    the pool closed it, whether its slot was given back, its write pause); while
    connecting, who it is for and the connect timeout; and the current response's
    progress and facts, reset for each response (``_reset_response``)."""

    def __init__(self, pool: "UpstreamPool") -> None:
        self.pool = pool
        self.record = UpstreamConnectionRecord(opened_ns=time.monotonic_ns())
        self.transport: asyncio.Transport | None = None
        self.user: UpstreamUser | None = None
        self.phase = Phase.CONNECTING
        self.origin = Origin.REQUEST
        self.discarded_by_pool = False  # closed by us, not by the upstream
        self.counted_closed = False  # its slot in open_count was given back
        self._parser: httptools.HttpResponseParser | None = None  # the current response's
        # Idle parsers, kept for the next response (see Hazards: Parsers and
        # responses; Repeated heads): llhttp is ready for the next message once one
        # completes in it; a HEAD response (whose body llhttp would still wait for)
        # or a broken one is not. None: make a new one.
        self._full_parser: httptools.HttpResponseParser | None = None
        self._known_head_parser: httptools.HttpResponseParser | None = None
        self._known_head: KnownHead | None = None  # the head the current response repeats
        self._first_read: bytes | None = None  # of a response parsed in full, until its head is
        # The response's body, when its head says chunked (set with each final head): the
        # last read that carried body bytes (or ended the head), or the watch over the
        # reads of chunk framing or trailers alone since then (see trailers.py).
        self._chunked_body = False
        self._since_body: bytes | TrailerWatch = b""
        self._reset_response(head_only=False)
        # While connecting: who it is being opened for, and the connect timeout. The
        # connection is handed over from connection_made.
        self.opening_for: ConnectionWaiter | None = None
        self.connect_timer = Timer()
        # The transport's own flow-control state: it outlives a request (uvloop says
        # pause once, at the crossing), so the next request on this connection must
        # start paused too, or its body would be buffered without bound.
        self.write_paused = False

    @property
    def closed(self) -> bool:
        return self.phase is Phase.CLOSED

    @property
    def opened_ahead(self) -> bool:
        return self.origin is not Origin.REQUEST

    @property
    def spare(self) -> bool:
        """Opened ahead of demand and not connected yet: it goes idle once connected."""
        return self.origin is not Origin.REQUEST and self.phase in _NOT_CONNECTED_YET

    @property
    def abandoned(self) -> bool:
        """Its connect was given up: whatever connects is aborted."""
        return self.phase is Phase.GIVEN_UP or self.phase is Phase.TIMED_OUT

    # -- asyncio callbacks -----------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.abandoned or self.pool.shut:
            # The connect was cancelled as it completed: the connect task's callback
            # accounts for the slot, so this close must not count again.
            self.discarded_by_pool = self.counted_closed = True
            transport.abort()
        else:
            self.pool._connected(self)

    def data_received(self, data: bytes) -> None:
        user = self.user
        if user is None:
            # Bytes while idle: the upstream broke the protocol or is closing;
            # either way this connection must not carry another request.
            self.pool.stats["closed_by_upstream_while_idle"] += 1
            self.pool.discard(self, "unexpected bytes on an idle connection")
            return
        parser = self._parser
        if parser is None:  # the response's first read
            parser = self._parser = self._parser_for(data)
        awaiting_head = self._awaiting > _IN_BODY
        if awaiting_head and self._head_so_far + len(data) > self.pool.max_head_bytes:
            if self._walk_heads(data)[0]:
                user.upstream_protocol_error(f"response head exceeds {self.pool.max_head_bytes} bytes")
                return
        self.bytes_received += len(data)
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            user.upstream_protocol_error("upstream switched protocols, which the proxy does not support")
            return
        except httptools.HttpParserError as exc:
            if self.user is user and self._awaiting:
                user.upstream_protocol_error(_parser_reason(exc))
                return
            self._extra_message = True  # garbage after a complete response: never reuse
        if not self._awaiting and self.user is user:
            # Not judged when bytes came after the response in this read (the connection
            # is never reused then): where it ended in the read is not known.
            if (self._chunked_body and not self._extra_message and not data.endswith(NO_TRAILERS_END)
                    and section_at_end(data, self._since_body, self._body_seen or awaiting_head)
                    > self.pool.max_head_bytes):
                self._refuse_trailers(user)
                return
            self._since_body = b""  # no read outlives its response on an idle connection
            user.upstream_response_complete(self._reusable())
        elif self.user is user:
            if self._awaiting > _IN_BODY:
                # The head still incomplete: what of it came so far (1xx heads before it
                # are not counted), and its last bytes, for its empty line may straddle reads.
                _, self._head_so_far, self._head_prefix = self._walk_heads(data)
                self._head_tail = (self._head_tail + data[-3:])[-3:] if self._head_so_far else b""
                user.upstream_first_byte()  # the head spans reads: its first byte came now
            elif self._body_seen or awaiting_head:
                self._since_body = data  # two stores, not a tuple: one instruction fewer a read
                self._body_seen = False
            elif self._trailers_too_long(user, data):  # chunk framing or trailers alone
                return
            user.flush_client()

    def connect_timed_out(self, task: asyncio.Task) -> None:
        self.phase = Phase.TIMED_OUT
        task.cancel()

    def give_up_connect(self) -> None:
        """Nobody wants it any more (the request left, shutdown): a connect that timed out
        stays a timed-out connect, a failure."""
        if self.phase is Phase.CONNECTING:
            self.phase = Phase.GIVEN_UP

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self._closed(exc)
        finally:
            # The parsers hold this connection's callbacks: without them it is freed
            # by reference counting, not by the (rarely run) cycle collector.
            self._parser = self._full_parser = self._known_head_parser = None

    def _closed(self, exc: Exception | None) -> None:
        self.phase = Phase.CLOSED
        self.record.closed_ns = time.monotonic_ns()
        user = self.user
        if user is None:
            if self.opened_ahead and not self.record.requests and not self.discarded_by_pool and (
                    self.record.closed_ns - self.record.opened_ns < SPARE_CLOSED_AT_ONCE_NS):
                # Accepted, then closed at once (a balancer with no backend): a failed
                # connect. Later, it is the upstream's idle timeout, and is learnt as one.
                self.pool._spare_refused()
            elif not self.discarded_by_pool:
                self.pool.stats["closed_by_upstream_while_idle"] += 1
                # Learn only from closes of connections still pooled: one the pool
                # already let go of (discard() with a deferred connection_lost, as
                # uvloop's abort() does) was closed by the proxy.
                if self in self.pool.idle and self.record.idle_since_ns is not None:
                    self.pool.keepalive.saw_idle_close(self.record.idle_age_ns(self.record.closed_ns),
                                                       self.record.closed_ns)
            self.pool.forget(self)
            return
        self.user = None
        # The request hears first, the pool second: a resend then waits at the head of
        # the queue (see acquire), and the slot this connection frees is its own.
        try:
            if not self._awaiting:
                return
            if self._close_delimited and exc is None:
                # No Content-Length, not chunked: the body ends at a clean EOF.
                self._awaiting = _COMPLETE
                user.upstream_response_complete(reusable=False)
                return
            user.upstream_lost(exc, self.bytes_received)
        finally:
            self.pool.forget(self)

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.user is not None:
            self.user.upstream_write_paused()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.user is not None:
            self.user.upstream_write_resumed()

    # -- what the request it carries drives (see sides.UpstreamSide) -----------------
    def send(self, data: bytes) -> None:
        self.transport.write(data)

    def pause_reading(self) -> None:
        self.transport.pause_reading()

    def resume_reading(self) -> bool:
        if self.transport.is_closing():
            return False
        self.transport.resume_reading()
        return True

    # -- per response ------------------------------------------------------------
    def begin_response(self, user: "UpstreamUser", head_only: bool) -> None:
        self.user = user
        self._parser = None  # chosen by the first read (see _parser_for)
        self._reset_response(head_only)

    def _parser_for(self, first_read: bytes) -> httptools.HttpResponseParser:
        """The parser for a response, chosen by its first read (see Hazards: Repeated heads)."""
        self._known_head = known = self.pool.known_head_of(first_read)
        if known is not None:
            parser, self._known_head_parser = self._known_head_parser, None
            if parser is None:
                parser = httptools.HttpResponseParser(_KnownHeadCallbacks(self))
            return parser
        self._first_read = first_read  # a final head that ends in it is learnt (see _head_parsed)
        parser, self._full_parser = self._full_parser, None
        return parser if parser is not None else httptools.HttpResponseParser(self)

    def _reset_response(self, head_only: bool) -> None:
        """Per-response state: every response starts with these (and an idle parser)."""
        self._headers: list[tuple[bytes, bytes]] = []
        self._reason = b""
        self._head_only = head_only
        self._awaiting = _AWAITING_HEAD
        self._saw_interim = False  # a 1xx came before the final head: that head is not learnt
        self._extra_message = False
        self._close_delimited = False
        self._keep_alive = False
        self.bytes_received = 0
        self._body_seen = False  # body bytes came in the read being fed
        self._head_tail = b""  # the last bytes of the last read, while a head spans reads
        self._head_so_far = 0  # bytes of the head in progress at the end of the last read
        self._head_prefix = b""  # its first bytes: a 1xx status line, or the final head's

    def _walk_heads(self, data: bytes) -> tuple[bool, int, bytes]:
        """Walk the heads ``data`` holds or goes on with (1xx heads, then the final one):
        whether one is larger than the limit, and the size and first bytes of the head
        still incomplete at its end (0 and b"" when the last one ended with it)."""
        limit = self.pool.max_head_bytes
        size, prefix = self._head_so_far, self._head_prefix
        joined = self._head_tail + data  # an empty line may begin in the last read
        position, search_from = len(self._head_tail), 0
        while True:
            if not prefix:  # a head begins here: llhttp skips empty lines before its status line
                skipped = H.EMPTY_LINES.match(joined, position).end()
                size += skipped - position
                position = search_from = skipped
            end = joined.find(b"\r\n\r\n", search_from)
            stop = len(joined) if end < 0 else end + 4
            size += stop - position
            if len(prefix) < 16:
                prefix = (prefix + joined[position:position + 16])[:16]
            if size > limit:
                return True, size, prefix
            if end < 0:
                return False, size, prefix
            if not _INTERIM_STATUS_LINE.match(prefix):
                return False, 0, b""  # the final head ended here: the body follows
            position = search_from = stop  # a 1xx head ended: the next one begins here
            size, prefix = 0, b""

    # -- trailer sections (see trailers.py) ---------------------------------------------
    def _trailers_too_long(self, user: UpstreamUser, data: bytes) -> bool:
        """A read of a chunked body with no body bytes: httptools gathers a trailer field
        until its line ends, so a section past the limit cannot wait for the body's end."""
        watch = self._since_body
        if watch.__class__ is bytes:
            watch = self._since_body = TrailerWatch(watch)
        return watch.read(data) > self.pool.max_head_bytes and self._refuse_trailers(user)

    def _refuse_trailers(self, user: UpstreamUser) -> bool:
        user.upstream_protocol_error(f"response trailers exceed {self.pool.max_head_bytes} bytes")
        return True

    def _reusable(self) -> bool:
        return not self._extra_message and self.phase is not _CLOSED and self._keep_alive

    # -- httptools callbacks (called from inside feed_data) ----------------------
    def on_message_begin(self) -> None:
        if not self._awaiting:
            self._extra_message = True  # bytes after the response: never reuse

    def on_status(self, reason: bytes) -> None:
        self._reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._awaiting > _IN_BODY:  # not trailers: they are not forwarded, so not kept
            self._headers.append((name, value))
            # Keep-Alive is hop-by-hop (dropped towards the client); the length test
            # keeps this to one comparison for every other header.
            if len(name) == 10 and name.lower() == b"keep-alive":
                self.pool.keepalive.saw_header(value)

    def on_headers_complete(self) -> None:
        if not self._awaiting:
            return
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            # Interim responses (100 Continue, 103 Early Hints) are consumed here:
            # the proxy answered the client's Expect itself.
            self._awaiting, self._saw_interim = _IN_INTERIM, True
            self._headers = []
            self._reason = b""
            return
        reason = self._reason or b""
        H.check_status_line(status, reason)
        parts = H.parse_response_headers(self._headers, self.pool.replaced_response_headers)
        if self._first_read is not None:
            if not self._saw_interim:
                self.pool.learn_head(self._first_read, status, reason, parts)
            self._first_read = None
        self._head_parsed(status, reason, parts)

    def on_known_headers_complete(self) -> None:
        """The head repeats ``_known_head`` byte for byte (its parser has no header callbacks)."""
        if self._awaiting:
            known = self._known_head
            self._head_parsed(known.status, known.reason, known.parts)

    def _head_parsed(self, status: int, reason: bytes, parts: H.ResponseParts) -> None:
        self._awaiting = _IN_BODY
        no_body = self._head_only or status in (204, 304)
        self._close_delimited = not (no_body or parts.chunked or parts.content_length is not None)
        self._chunked_body = parts.chunked
        self.user.upstream_response_head(status, reason, parts)
        # Read keep-alive now: llhttp resets its flags once the message completes.
        self._keep_alive = self._parser.should_keep_alive()
        if no_body:
            self._awaiting = _COMPLETE
            self._chunked_body = False

    def on_body(self, body: bytes) -> None:
        awaiting = self._awaiting
        if awaiting == _IN_BODY:
            self._body_seen = True
            self.user.upstream_response_body(body)
        elif not awaiting:
            # A body after the head of a response to HEAD (llhttp does not know the
            # request was HEAD): the rest of it may still come, so never reuse.
            self._extra_message = True

    def on_message_complete(self) -> None:
        if self._awaiting == _IN_INTERIM:
            self._awaiting = _AWAITING_HEAD  # the final head is still to come
            return
        if self._awaiting:  # not when it ended early (HEAD, 204, 304): llhttp still waits for a body
            if self._known_head is not None:
                self._known_head_parser = self._parser
            else:
                self._full_parser = self._parser
        self._awaiting = _COMPLETE


def _parser_reason(exc: Exception) -> str:
    if isinstance(exc.__context__, H.BadResponse):  # raised by our own check inside a callback
        return str(exc.__context__)
    return f"malformed response: {exc or type(exc).__name__}"


class KnownHead:
    """A response head parsed in full once: its bytes, and what they parsed to."""

    __slots__ = ("raw", "status", "reason", "parts", "replaced")

    def __init__(self, raw: bytes, status: int, reason: bytes, parts: H.ResponseParts,
                 replaced: frozenset[bytes]) -> None:
        self.raw, self.status, self.reason, self.parts, self.replaced = raw, status, reason, parts, replaced


class _KnownHeadCallbacks:
    """The protocol of a parser for repeated heads: no ``on_status`` or ``on_header``,
    so llhttp makes no Python call per header (httptools binds callbacks at creation)."""

    __slots__ = ("on_message_begin", "on_headers_complete", "on_body", "on_message_complete")

    def __init__(self, conn: UpstreamConnection) -> None:
        self.on_message_begin = conn.on_message_begin
        self.on_headers_complete = conn.on_known_headers_complete
        self.on_body = conn.on_body
        self.on_message_complete = conn.on_message_complete


class KeepAliveLearner:
    """What the upstream's idle-close timeout is, learned passively, and whether
    ``pool.idle_timeout`` is safely below it.

    Two sources: a ``Keep-Alive: timeout=N`` response header, and the idle age at
    which the upstream closed pooled connections. The learned value is the smaller
    of the two known ones. The pool is misaligned when its idle timeout is not
    below the learned value by at least ``MARGIN_S``, or 10 % of the learned value
    when that is smaller (short timeouts). The first misalignment is logged once,
    as a WARN.

    Hazard: an upstream that restarts or shuts down closes every pooled connection
    at once, at whatever idle ages they had; taken as timeouts, those ages would
    raise a false alarm with bad advice (lower the pool timeout to near zero). So
    closes are grouped into events (those within ``SAME_EVENT_S`` of the first),
    and an event whose idle ages disagree is a restart and counts for nothing: an
    idle timeout closes each connection at the same age, so at one moment only
    connections that went idle together. An event's age counts only once
    confirmed by a separate event (at least ``DISTINCT_EVENTS_S`` apart) at an
    age that agrees (within 10 %, or ``AGREE_S``): a lone restart of a pool of one
    connection cannot be told apart, but two rarely close at the same age. The
    observed value is the smallest confirmed age among the last ``WINDOW`` closes.
    """

    WINDOW = 32
    MARGIN_S = 0.5
    AGREE_S = 0.05
    SAME_EVENT_S = 0.05
    DISTINCT_EVENTS_S = 0.25

    def __init__(self, idle_timeout: float, upstream: str = "") -> None:
        self.idle_timeout = idle_timeout
        self.upstream = upstream
        self.header_timeout: float | None = None
        self.observed: collections.deque[tuple[float, int]] = collections.deque(maxlen=self.WINDOW)  # (age s, at ns)
        # Ages confirmed so far, kept apart from the closes that confirmed them: a
        # restart closing a full window's worth of connections does not erase them.
        self.confirmed: collections.deque[float] = collections.deque(maxlen=self.WINDOW)
        self.learned: float | None = None
        self.misaligned = False
        self.warned = False

    def saw_header(self, value: bytes) -> None:
        for param in value.split(b","):
            key, _, number = param.partition(b"=")
            if key.strip().lower() == b"timeout":
                try:
                    timeout = float(number.strip())
                except ValueError:
                    return
                if timeout > 0 and timeout != self.header_timeout and timeout < 1e9:
                    self.header_timeout = timeout
                    self._update()
                return

    def saw_idle_close(self, idle_age_ns: int, closed_ns: int) -> None:
        if idle_age_ns > 0:
            self.observed.append((idle_age_ns / 1e9, closed_ns))
            confirmed = self.confirmed_age()
            if confirmed is not None:
                self.confirmed.append(confirmed)
            self._update()

    def _agree(self, age: float, other: float) -> bool:
        return abs(age - other) <= max(self.AGREE_S, 0.1 * other)

    def _events(self) -> list[tuple[float, int]]:
        """(idle age, when) of each event of closes whose ages agree; restarts left out."""
        events: list[tuple[float, int]] = []
        group: list[tuple[float, int]] = []
        for age, at in sorted(self.observed, key=lambda close: close[1]):
            if group and at - group[0][1] > self.SAME_EVENT_S * 1e9:
                events += self._as_event(group)
                group = []
            group.append((age, at))
        return events + (self._as_event(group) if group else [])

    def _as_event(self, group: list[tuple[float, int]]) -> list[tuple[float, int]]:
        youngest = min(age for age, _ in group)
        return [(youngest, group[0][1])] if all(self._agree(age, youngest) for age, _ in group) else []

    def confirmed_age(self) -> float | None:
        """The smallest idle age that two separate events agree on, if any."""
        events = self._events()
        agreed = [min(age, other) for i, (age, at) in enumerate(events) for other, other_at in events[i + 1:]
                  if abs(other_at - at) >= self.DISTINCT_EVENTS_S * 1e9 and self._agree(age, other)]
        return min(agreed, default=None)

    def _update(self) -> None:
        known = [v for v in (self.header_timeout, min(self.confirmed, default=None)) if v is not None]
        self.learned = min(known) if known else None
        if self.learned is None:
            self.misaligned = False
            return
        margin = min(self.MARGIN_S, 0.1 * self.learned)
        self.misaligned = self.idle_timeout > self.learned - margin
        if self.misaligned and not self.warned:
            self.warned = True
            source = "Keep-Alive header" if self.learned == self.header_timeout else "observed idle closes"
            log.warning(
                "keep-alive misaligned: upstream %s closes idle connections after about %.2f s (%s) but "
                "pool.idle_timeout is %g s, so the proxy may reuse a connection the upstream is closing; "
                "lower pool.idle_timeout to at most %.2f s",
                self.upstream or "?", self.learned, source, self.idle_timeout, max(self.learned - margin, 0.0),
            )


class UpstreamPool:
    """Keep-alive connections to one upstream, most recently used first."""

    SPARE_TICK_S = 0.01  # connections opened ahead of demand go out on ticks this far apart

    def __init__(self, host: str, port: int, idle_timeout: float, max_connections: int, connect_timeout: float,
                 keep_warm: float = 0.0, max_head_bytes: int = 65536):
        self.host = host
        self.max_head_bytes = max_head_bytes  # a response head, or trailers, past this is a 502
        self.port = port
        self.idle_timeout_ns = int(idle_timeout * 1e9)
        # The sweeper's period: idle connections past the idle timeout go, and with
        # keep_warm, the due ones (below) are replaced.
        self.sweep_interval_ns = max(self.idle_timeout_ns // 4, 50_000_000)
        # Idle connections this old are renewed at a sweep: the next sweep comes one
        # interval later, and a replacement needs up to half an interval to open plus
        # its connect. Not positive for an idle timeout of two intervals or less (0.1 s):
        # then nothing is renewed.
        self.due_age_ns = self.idle_timeout_ns - 2 * self.sweep_interval_ns
        self.keep_warm_ns = int(keep_warm * 1e9)
        self.demand_peak = 0  # most connections in use since the last sweep
        self.recent_peaks: collections.deque[tuple[int, int]] = collections.deque()  # (sweep ns, peak)
        self.warm_target = 0  # connections to keep open, from the peaks within keep_warm
        self.spares_connecting = 0
        self.spares_failing = False  # the last connect ahead of demand failed: probe with one a sweep
        self.spares_to_open = 0
        self.spares_per_tick = 1
        self._spare_timer = Timer()
        self.shut = False
        self.max_connections = max_connections
        self.connect_timeout = connect_timeout
        self.idle: list[UpstreamConnection] = []
        # Who waits for a connection at max_connections, in order. The pool knows them
        # only as ``sides.ConnectionWaiter``: it calls them back, and nothing else.
        self.waiters: collections.deque[ConnectionWaiter] = collections.deque()
        # Waiters that must get a new connection (a resend after a stale one): a
        # connection released to them is closed to make room for a new one instead.
        self._fresh_waiters: set[ConnectionWaiter] = set()
        self.open_count = 0
        self.connecting: dict[asyncio.Task, UpstreamConnection] = {}
        self._sweeper = Timer()
        self.stats = collections.Counter()
        # Response headers the proxy sets itself (request id, traceresponse).
        self.replaced_response_headers: frozenset[bytes] = frozenset()
        self._known_head: KnownHead | None = None  # see UpstreamConnection's Hazards: Repeated heads
        self.keepalive = KeepAliveLearner(idle_timeout, f"{host}:{port}")

    # -- acquiring ---------------------------------------------------------------
    def acquire(self, waiter: "ConnectionWaiter", fresh: bool = False) -> asyncio.Task | None:
        """Hand ``waiter`` a connection now (reused) or later (new, or after a wait),
        through its ``connection_ready`` (or ``connection_failed``). A waiter that no
        longer wants one says so with ``give_up``. Returns the connect task when one
        was started."""
        if not fresh:
            conn = self._pop_usable()
            if conn is not None:
                self.stats["reused"] += 1
                self._note_demand()
                waiter.connection_ready(conn, reused=True)
                return None
        if self.max_connections and self.open_count >= self.max_connections:
            if fresh and self.idle:
                self.discard(self.idle.pop(0), "making room for a fresh connection")
            else:
                if fresh:
                    # A resend had its turn already: it goes first, not behind the
                    # requests that queued while its connection was failing.
                    self.waiters.appendleft(waiter)
                    self._fresh_waiters.add(waiter)
                else:
                    self.waiters.append(waiter)
                waiter.connection_queued()
                return None
        task = self._connect(waiter)
        self._note_demand()
        return task

    def _note_demand(self) -> None:
        in_use = self.open_count - len(self.idle) - self.spares_connecting
        if in_use > self.demand_peak:
            self.demand_peak = in_use

    def give_up(self, waiter: "ConnectionWaiter") -> None:
        """``waiter`` no longer wants a connection: it leaves the queue, or the connect
        opening for it is cancelled (see cancel_connect). Nothing is called back."""
        self._fresh_waiters.discard(waiter)
        try:
            self.waiters.remove(waiter)
            return
        except ValueError:
            pass
        for task, conn in self.connecting.items():
            if conn.opening_for is waiter:
                self.cancel_connect(task)
                return

    def _pop_usable(self) -> UpstreamConnection | None:
        now = time.monotonic_ns()
        while self.idle:
            conn = self.idle.pop()
            if (conn.phase is not _CLOSED and not conn.transport.is_closing()
                    and conn.record.idle_age_ns(now) < self.idle_timeout_ns):
                return conn
            self.discard(conn, "idle timeout")
        return None

    def _connect(self, waiter: "ConnectionWaiter") -> asyncio.Task:
        """Start opening a connection for ``waiter``.

        The connection is handed to ``waiter`` from its ``connection_made`` callback,
        not when the connect coroutine returns: under load every callback hop costs a
        full pass over the ready I/O events, and the coroutine's return reaches the
        caller several hops after the socket is connected. The task only reports
        failures; a timer (not ``wait_for``, which adds its own task) bounds the wait.
        """
        conn = UpstreamConnection(self)
        conn.opening_for = waiter
        return self._start_connect(conn)

    def _open_spare(self, renewing: bool = True) -> bool:
        """Open a connection ahead of demand; it joins the idle list once connected
        (renewing: in place of the oldest idle one, when that one is due). Never past
        ``max_connections``: False then, and nothing opened (the due just expire)."""
        if self.max_connections and self.open_count >= self.max_connections:
            return False
        conn = UpstreamConnection(self)
        conn.origin = Origin.RENEWAL if renewing else Origin.AHEAD
        self.spares_connecting += 1
        self._start_connect(conn)
        return True

    def _start_connect(self, conn: UpstreamConnection) -> asyncio.Task:
        self.open_count += 1
        loop = asyncio.get_running_loop()
        task = loop.create_task(loop.create_connection(lambda: conn, self.host, self.port))
        conn.connect_timer.set_in(self.connect_timeout, functools.partial(conn.connect_timed_out, task))
        self.connecting[task] = conn
        task.add_done_callback(self._connect_done)
        return task

    def cancel_connect(self, task: asyncio.Task) -> None:
        """The request a connect was started for gave up. The connect may complete in the
        same loop pass (its connection_made is already scheduled): that connection is
        aborted there, never handed over. Handed over instead, it would reach a finished
        request and be pooled, while the cancelled connect closes its transport
        underneath, with no connection_lost: the next request would be given a dead one."""
        conn = self.connecting.get(task)
        if conn is not None and conn.opening_for is not None:
            conn.give_up_connect()
        task.cancel()

    def _connected(self, conn: UpstreamConnection) -> None:
        """Hand a new connection to the request it was opened for, or (opened ahead) to the pool."""
        conn.connect_timer.cancel()
        self.stats["opened"] += 1
        spare = conn.spare
        conn.phase = Phase.OPEN
        if spare:
            self.spares_connecting -= 1
            self.stats["opened_ahead"] += 1
            self.release(conn)  # to a waiter, or idle
            if conn.origin is Origin.RENEWAL:
                self._retire_oldest_due()
        else:
            waiter, conn.opening_for = conn.opening_for, None
            waiter.connection_ready(conn, reused=False)

    def _retire_oldest_due(self) -> None:
        """Make before break: a connection opened ahead retires the oldest idle one, if it is due."""
        oldest = self.idle[0] if len(self.idle) > 1 else None
        if oldest is not None and oldest.record.idle_age_ns(time.monotonic_ns()) >= self.due_age_ns:
            self.discard(oldest, "renewed before the idle timeout")

    def _connect_done(self, task: asyncio.Task) -> None:
        conn = self.connecting.pop(task)
        if conn.opening_for is None and not conn.spare:
            return  # handed over from connection_made (or abandoned there)
        if not task.cancelled() and task.exception() is None and conn.transport is not None:
            self._connected(conn)  # connected without a connection_made call: hand over now
            return
        conn.connect_timer.cancel()
        failed = not task.cancelled() or conn.phase is Phase.TIMED_OUT  # else: the request gave up, or shutdown
        if failed:
            self.stats["connect_failed"] += 1
        spare = conn.spare
        conn.phase = Phase.CLOSED  # never connected, or aborted as it connected (see connection_made)
        if spare:
            self.spares_connecting -= 1
            self._connection_gone()
            if failed:
                self._spares_fail()  # no request waits on it
            return
        waiter, conn.opening_for = conn.opening_for, None
        self._connection_gone()
        if failed:
            exc = asyncio.TimeoutError() if task.cancelled() else task.exception()
            waiter.connection_failed(_connect_error(exc, self.connect_timeout))

    def _spare_refused(self) -> None:
        self.stats["connect_failed"] += 1
        self._spares_fail()

    def _spares_fail(self) -> None:
        """Connects ahead of demand fail: stop this sweep's, probe with one a sweep from now on."""
        self.spares_failing = True
        self.spares_to_open = 0

    # -- responses ---------------------------------------------------------------
    def known_head_of(self, first_read: bytes) -> KnownHead | None:
        """The last fully parsed head, when ``first_read`` starts with its exact bytes."""
        known = self._known_head
        if known is not None and first_read.startswith(known.raw) and known.replaced is self.replaced_response_headers:
            return known
        return None

    def learn_head(self, first_read: bytes, status: int, reason: bytes, parts: H.ResponseParts) -> None:
        """Remember a final head that was parsed in full from the first read of its response."""
        end = first_read.find(b"\r\n\r\n")
        # Only a head at the read's first byte: llhttp skips empty lines before a status
        # line, and their CRLFs are not a head's end.
        if end >= 0 and first_read.startswith(b"HTTP/"):
            # At or after the head's end (the first empty line ends it): bytes that
            # start with these start with the same head.
            self._known_head = KnownHead(first_read[:end + 4], status, reason, parts,
                                         self.replaced_response_headers)

    # -- returning ---------------------------------------------------------------
    def release(self, conn: UpstreamConnection) -> None:
        conn.user = None
        if conn.phase is _CLOSED or conn.transport.is_closing():
            self.forget(conn)
            return
        if self.spares_failing and conn.record.requests:
            # A request's connection came back reusable: the upstream keeps connections
            # again, whether or not a sweep has probed it since connects ahead failed.
            self.spares_failing = False
        if self.shut:
            self.discard(conn, "shutdown")
            return
        if self.waiters:
            waiter = self.waiters.popleft()
            if waiter in self._fresh_waiters:
                # Back to the front: closing ``conn`` frees the slot it is connected in.
                self.waiters.appendleft(waiter)
                self.discard(conn, "making room for a fresh connection")
                return
            self.stats["reused"] += 1
            self._note_demand()
            waiter.connection_ready(conn, reused=True)
            return
        conn.record.idle_since_ns = time.monotonic_ns()
        self.idle.append(conn)
        self._arm_sweeper()

    def discard(self, conn: UpstreamConnection, why: str, reset: bool = False) -> None:
        """Close ``conn`` for good (it will not be reused); with ``reset``, by RST, so
        that the upstream sees it at once even behind request bytes it has not read."""
        conn.user = None
        if conn.transport is not None and not conn.transport.is_closing():
            log.debug("closing upstream connection #%d: %s", conn.record.id, why)
            # connection_lost follows (now or on a later loop turn): it must not
            # count as the upstream closing an idle connection.
            conn.discarded_by_pool = True
            if reset:
                sockets.reset(conn.transport)
            else:
                conn.transport.abort()
        self.forget(conn)

    def forget(self, conn: UpstreamConnection) -> None:
        """Drop every reference to ``conn``; called once it is closed or closing."""
        if conn in self.idle:
            self.idle.remove(conn)
            self.stats["closed_while_idle"] += 1
        if not conn.counted_closed:
            conn.counted_closed = True
            self._connection_gone()

    def _connection_gone(self) -> None:
        self.open_count -= 1
        if self.waiters and (not self.max_connections or self.open_count < self.max_connections):
            waiter = self.waiters.popleft()
            self._fresh_waiters.discard(waiter)
            self._connect(waiter)
            waiter.connection_opening()
            self._note_demand()

    # -- idle expiry and keeping warm -------------------------------------------------
    def _arm_sweeper(self) -> None:
        if self._sweeper.callback is None and not self.shut:  # not armed
            self._sweeper.set_in(self.sweep_interval_ns / 1e9, self._sweep)

    def _sweep(self) -> None:
        now = time.monotonic_ns()
        self._update_warm_target(now)
        for conn in [c for c in self.idle if c.record.idle_age_ns(now) >= self.idle_timeout_ns]:
            self.discard(conn, "idle timeout")
        if self.spares_failing and any(c.opened_ahead and not c.record.requests for c in self.idle):
            self.spares_failing = False  # a probe survived a sweep: the upstream keeps connections again
        # Renewing is pointless when the upstream closes idle connections before our
        # idle timeout (misaligned): the replacements would be closed the same way.
        if self.warm_target and self.due_age_ns > 0 and not self.keepalive.misaligned:
            due = sum(1 for c in self.idle if c.record.idle_age_ns(now) >= self.due_age_ns)
            self._schedule_spares(self.warm_target - (self.open_count - due))
        if self.idle or self.warm_target:
            self._arm_sweeper()

    def _update_warm_target(self, now: int) -> None:
        """Close this sweep's period of demand; the target is the most connections in use
        at once within the last ``keep_warm`` (0: off)."""
        if not self.keep_warm_ns:
            self.warm_target = 0
            return
        peaks = self.recent_peaks
        peaks.append((now, self.demand_peak))
        self.demand_peak = 0
        self._note_demand()  # the next period starts from what is in use now
        while peaks and now - peaks[0][0] > self.keep_warm_ns:
            peaks.popleft()
        target = max(peak for _, peak in peaks) if peaks else 0
        self.warm_target = min(target, self.max_connections) if self.max_connections else target

    def _schedule_spares(self, count: int) -> None:
        """Open ``count`` connections ahead of demand, spread over half a sweep interval
        (replacing what an earlier sweep left to open); while connecting fails (the
        upstream is down), only one, as a probe."""
        if count <= 0 or self.shut:
            self.spares_to_open = 0
            return
        ticks = max(1, int(self.sweep_interval_ns / 2e9 / self.SPARE_TICK_S))
        self.spares_to_open = 1 if self.spares_failing else count
        self.spares_per_tick = -(-self.spares_to_open // ticks)
        if not self._spare_timer.armed:
            self._open_spares()

    def _open_spares(self) -> None:
        if self.shut:
            return
        batch = min(self.spares_per_tick, self.spares_to_open)
        for _ in range(batch):
            if not self._open_spare():  # at the cap: requests took the slots since the sweep
                self.spares_to_open = 0
                return
        self.spares_to_open -= batch
        if self.spares_to_open > 0:
            self._spare_timer.set_in(self.SPARE_TICK_S, self._open_spares)

    def warm_for_clients(self, clients: int) -> None:
        """A keep-alive client connection sent its first request: ``clients`` such
        connections are open, and each may send its next at any moment (no more than
        that can be in flight at once). Unless that many upstream connections are open
        or opening, one more is opened ahead now, not at the next sweep. It then waits
        idle like any other, and expires at the idle timeout unless demand uses it.

        Not when connects ahead are failing, nor when the upstream closes idle
        connections before the pool's idle timeout: the new one would be closed idle."""
        if not self.keep_warm_ns or self.shut or self.spares_failing or self.keepalive.misaligned:
            return
        if self.open_count + self.spares_to_open < clients:
            self._open_spare(renewing=False)

    def stop_keeping_warm(self) -> None:
        """Shutting down: idle connections expire as if keep_warm were off."""
        self.keep_warm_ns = 0
        self.warm_target = 0
        self.spares_to_open = 0

    def close_all(self) -> None:
        self.shut = True
        self._sweeper.cancel()
        self._spare_timer.cancel()
        for task, conn in list(self.connecting.items()):
            if conn.opening_for is not None or conn.spare:  # handed-over connections are in use
                conn.give_up_connect()
                task.cancel()
        for conn in list(self.idle):
            self.discard(conn, "shutdown")


def _connect_error(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return f"connect timed out after {timeout:g} s"
    return f"connect failed: {exc.strerror or exc}" if isinstance(exc, OSError) else str(exc)
