"""The lifecycle record: plain data about connections, requests and attempts.

Theory of operation
-------------------
Three lifetimes, three records:

* ``ClientConnectionRecord``: one per accepted client connection. It numbers the
  requests made on it and remembers when the previous response ended, so every
  request knows its sequence on the connection and the idle gap before it (the
  keep-alive ledger: the original hang only happened on reused connections).
* ``RequestRecord``: one per client request. Downstream marks, byte and chunk
  counts, the response status and, once, the outcome.
* ``Attempt``: one per upstream try of a request (a request resent after a stale
  pooled connection has two), with the upstream marks and the pooled connection's
  ledger (``UpstreamConnectionRecord``: new or reused, idle age, request count).

Invariants: a mark is set at most once (setting it twice is a bug in the I/O code,
so it raises); ``finish`` is called exactly once. Times are monotonic nanoseconds
passed in by the caller; this module never reads a clock.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from .flags import Outcome
from .marks import MARK, UPSTREAM_MARKS, Mark

if TYPE_CHECKING:
    from .stream_events import EventScanner

_client_ids = itertools.count(1)
_upstream_ids = itertools.count(1)
_request_ids = itertools.count(1)


class MarkTwiceError(AssertionError):
    """A mark was stamped twice: the I/O code reported one edge two times."""


class RequestOwner(Protocol):
    """The I/O object that can end a request in flight early: the client connection
    while the request's head is read, then the request's exchange. The watchdog's
    abort action goes through it; the owner ends the request (once) its own way."""

    def abort(self, outcome: Outcome, message: str) -> None: ...


@dataclass(slots=True)
class ClientConnectionRecord:
    peer: str
    opened_ns: int
    id: int = field(default_factory=_client_ids.__next__)
    requests_started: int = 0
    requests_open: int = 0  # started and not yet finished: more than one when pipelined
    last_response_end_ns: int | None = None
    closed_ns: int | None = None

    def begin_request(self, now_ns: int) -> "RequestRecord":
        """The record of a new request on this connection, its first byte received at ``now_ns``.

        It knows its sequence (1-based) and the idle gap before it (ns, None for the
        first): how long the connection sat with nothing to do before this request's
        first byte, 0 when it arrives while an earlier one is still in flight
        (pipelined), since the connection was never idle."""
        self.requests_started += 1
        if self.requests_open > 0:
            idle = 0
        else:
            idle = None if self.last_response_end_ns is None else now_ns - self.last_response_end_ns
        self.requests_open += 1
        return RequestRecord(connection=self, sequence=self.requests_started, idle_gap_ns=idle,
                             marks={MARK.FIRST_DOWNSTREAM_RX_BYTE: now_ns})

    def request_ended(self, now_ns: int) -> None:
        if self.requests_open:
            self.requests_open -= 1
        self.last_response_end_ns = now_ns

    def body_drained(self, now_ns: int) -> None:
        """The rest of a refused request's body was read until ``now_ns`` (the connection
        then carries on): the idle gap before the next request starts here."""
        self.last_response_end_ns = now_ns


@dataclass(slots=True)
class UpstreamConnectionRecord:
    opened_ns: int
    id: int = field(default_factory=_upstream_ids.__next__)
    requests: int = 0
    idle_since_ns: int | None = None
    closed_ns: int | None = None

    def idle_age_ns(self, now_ns: int) -> int:
        return 0 if self.idle_since_ns is None else now_ns - self.idle_since_ns


@dataclass(slots=True)
class Attempt:
    index: int  # 0 for the first try, 1 for the resend
    marks: dict[Mark, int] = field(default_factory=dict)
    connection: UpstreamConnectionRecord | None = None
    reused: bool = False
    idle_age_ns: int = 0
    # The connection's request count including this one (1 = first on a new connection).
    connection_request_number: int = 0
    outcome: Outcome | None = None
    error: str | None = None
    span_id: int = 0  # this attempt's CLIENT span, the parent the upstream sees
    started_ns: int = 0  # when it asked the pool for a connection
    connecting_since_ns: int | None = None  # queued at the cap, then given a slot to connect
    status: int = 0  # the status of the response head the upstream sent on it

    def attach(self, conn: UpstreamConnectionRecord, reused: bool, now_ns: int) -> None:
        self.connection = conn
        self.reused = reused
        self.idle_age_ns = conn.idle_age_ns(now_ns) if reused else 0
        conn.requests += 1
        conn.idle_since_ns = None
        self.connection_request_number = conn.requests


@dataclass(slots=True)
class StallEntry:
    """One stall of a request: what it was waiting for, and whether the wait ended."""

    code: str
    phase: str
    since_ns: int  # when the silence began
    detected_ns: int  # when the watchdog judged it a stall
    resolved_ns: int | None = None  # when the awaited byte came after all
    attempt: int = 0  # the upstream attempt it was judged on (a resend ends it unresolved); -1 if not


@dataclass(slots=True)
class RequestRecord:
    connection: ClientConnectionRecord
    sequence: int
    idle_gap_ns: int | None
    id: int = field(default_factory=_request_ids.__next__)
    method: str = ""
    target: str = ""
    http_version: str = "1.1"
    marks: dict[Mark, int] = field(default_factory=dict)
    attempts: list[Attempt] = field(default_factory=list)
    # Counts. Body bytes only; "chunks" are upstream body deliveries (a chunk of a
    # chunked body, or what one read brought).
    downstream_rx_body_bytes: int = 0
    upstream_rx_body_bytes: int = 0
    upstream_rx_chunks: int = 0
    downstream_tx_body_bytes: int = 0
    status: int | None = None
    outcome: Outcome | None = None
    error: str | None = None
    end_ns: int | None = None
    # Identity: the W3C trace this request belongs to and the proxy's SERVER span.
    trace_id: int = 0
    span_id: int = 0
    parent_span_id: int = 0  # the client's span, 0 when the proxy started the trace
    sampled: bool = True
    tracestate: bytes = b""
    rejected_traceparent: bytes | None = None
    request_id: str = ""
    user_agent: str = ""
    # The tracing.conversation_id_header's value (gen_ai.conversation.id), "" without one.
    conversation_id: str = ""
    # Cheap evidence for span attributes, read once at the end: the first and (past
    # those, when spans are on) the last bytes of the request body, and the last three
    # upstream reads (an SSE stream's finish reason, usage event and [DONE] arrive at
    # its end, each in its own read when the engine is slow).
    request_body_head: bytes = b""
    request_body_tail: bytes = b""
    response_tail: tuple[bytes, bytes, bytes] = (b"", b"", b"")
    max_chunk_gap_ns: int = 0
    # An event stream's tokens (a text/event-stream response whose body is not coded):
    # its scanner (``stream_events.EventScanner``: the counts of output, heartbeat and
    # error events, [DONE], and in its summary() the model, the engine's token counts,
    # finish reasons and the first in-band error), and when the first and the last
    # event with output arrived and the longest wait between two of them. The stall
    # clock of such a stream counts from the last output event, not the last byte
    # (see attribution). None and 0 for any other response.
    stream_events: EventScanner | None = None
    first_token_ns: int | None = None
    last_token_ns: int | None = None
    max_token_gap_ns: int = 0
    stalls: list[StallEntry] = field(default_factory=list)
    # What can end this request early, for the watchdog's abort action; cleared when
    # it ends (owner <-> record is a reference cycle while it is set).
    owner: RequestOwner | None = None
    # Progress stamps overwritten on every read/write; the watchdog compares them
    # with its deadlines instead of stamping a mark per chunk.
    last_downstream_rx_ns: int | None = None
    last_upstream_rx_ns: int | None = None
    last_downstream_tx_ns: int | None = None
    downstream_paused_since_ns: int | None = None  # the client is not reading our response
    upstream_paused_since_ns: int | None = None  # the upstream is not reading our request
    upstream_resumed_ns: int | None = None  # when the upstream last took the request again
    # A pipelined request waiting for the responses before it: its wait is theirs.
    waiting_turn: bool = False
    turn_began_ns: int | None = None  # when a request begun behind others got its turn (its head or body)

    # -- marks -------------------------------------------------------------
    def mark(self, mark: Mark, now_ns: int) -> None:
        target = self.attempts[-1].marks if mark in UPSTREAM_MARKS else self.marks
        if mark in target:
            raise MarkTwiceError(f"{mark.label} stamped twice on request {self.id}")
        target[mark] = now_ns

    def mark_once(self, mark: Mark, now_ns: int) -> bool:
        """Stamp ``mark`` unless already set; for edges reported on every read."""
        target = self.attempts[-1].marks if mark in UPSTREAM_MARKS else self.marks
        if mark in target:
            return False
        target[mark] = now_ns
        return True

    def has(self, mark: Mark) -> bool:
        if mark in UPSTREAM_MARKS:
            return bool(self.attempts) and mark in self.attempts[-1].marks
        return mark in self.marks

    def when(self, mark: Mark) -> int | None:
        if mark in UPSTREAM_MARKS:
            return self.attempts[-1].marks.get(mark) if self.attempts else None
        return self.marks.get(mark)

    # -- attempts and the end ----------------------------------------------
    def new_attempt(self, now_ns: int = 0, span_id: int = 0) -> Attempt:
        attempt = Attempt(index=len(self.attempts), span_id=span_id, started_ns=now_ns)
        self.attempts.append(attempt)
        return attempt

    @property
    def attempt(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def finished(self) -> bool:
        return self.outcome is not None

    def finish(self, outcome: Outcome, now_ns: int, error: str | None = None) -> None:
        if self.outcome is not None:
            raise MarkTwiceError(f"request {self.id} finished twice ({self.outcome.code}, {outcome.code})")
        self.outcome = outcome
        self.error = error
        self.connection.request_ended(now_ns)
        self.end_ns = now_ns
