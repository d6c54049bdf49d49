"""Who owes the next byte: the live verdict on a request that is waiting.

Theory of operation
-------------------
The phase (``machine.phase_of``) says which mark has not arrived; this module says
whose turn that is, since when, and which stall it would be if it went on:

* request head or body incomplete, nothing of ours in the way: the client;
* waiting for a free pooled connection: the proxy (its cap);
* connecting, or the request sent (or the upstream not taking it) and no response
  header, or a header and no body byte yet: the engine side (router queue, prefill);
* response started, upstream silent and the client reading: the engine (decode);
* an event stream (``record.stream_events``) is judged on its tokens, not its bytes:
  until its first event with output it is the first byte's wait (FBS, from the
  response head), then silence counts from the last event with output (MSS).
  Heartbeats (comments, empty deltas, pings) never move either clock, so a stream
  of pings is a stall like a silent one (issue 23);
* upstream bytes waiting because the client's transport is paused: the client;
* upstream bytes received later than the last write to the client while the client
  is not paused: the proxy itself (a check on our own forwarding).

``since_ns`` is when the silence began: the last byte on the side that owes the
next one, or the mark that handed it the turn. Pure: no clock, no I/O.
"""

from __future__ import annotations

from typing import NamedTuple

from .flags import Flag, Outcome
from .machine import Phase, phase_of
from .marks import Mark
from .timeline import RequestRecord


class Verdict(NamedTuple):
    phase: Phase
    outcome: Outcome  # the stall this wait becomes if it lasts
    since_ns: int
    threshold: str  # the [stall] key that bounds it


def verdict(record: RequestRecord) -> Verdict | None:
    if record.waiting_turn:
        return None  # nobody owes this one a byte yet: the request ahead of it is judged
    phase = phase_of(record)
    rule = _RULES.get(phase)
    return rule(record, phase) if rule else None


def _first(*stamps: int | None) -> int:
    return next(s for s in stamps if s is not None)


def _awaiting_headers(r: RequestRecord, phase: Phase) -> Verdict:
    # A head begun behind other requests is timed from its turn (see waiting_turn).
    return Verdict(phase, Flag.DHS, _first(r.turn_began_ns, r.marks[Mark.FIRST_DOWNSTREAM_RX_BYTE]),
                   "client_headers")


def _awaiting_connection(r: RequestRecord, phase: Phase) -> Verdict:
    attempt = r.attempt
    headers_done = r.marks[Mark.LAST_DOWNSTREAM_RX_HEADER_BYTE]
    if attempt is None:  # the body is held (rid injection) before a connection is taken
        return _awaiting_body(r, phase)
    if attempt.connecting_since_ns is not None:  # it waited at the cap, and now connects
        return Verdict(phase, Flag.UCS, attempt.connecting_since_ns, "pool_wait")
    if Mark.POOL_QUEUED in attempt.marks:
        return Verdict(phase, Flag.PWS, attempt.marks[Mark.POOL_QUEUED], "pool_wait")
    return Verdict(phase, Flag.UCS, attempt.started_ns or headers_done, "pool_wait")


def _awaiting_body(r: RequestRecord, phase: Phase) -> Verdict:
    if r.upstream_paused_since_ns is not None:
        return Verdict(phase, Flag.FBS, r.upstream_paused_since_ns, "first_byte")
    since = _first(r.last_downstream_rx_ns, r.marks.get(Mark.LAST_DOWNSTREAM_RX_HEADER_BYTE))
    # The proxy itself was not reading until then: the upstream had paused it, or the
    # request was pipelined and waited for its turn.
    for resumed in (r.upstream_resumed_ns, r.turn_began_ns):
        if resumed is not None and resumed > since:
            since = resumed
    return Verdict(phase, Flag.DBS, since, "client_body")


def _awaiting_upstream(r: RequestRecord, phase: Phase) -> Verdict:
    if phase is Phase.SENDING_REQUEST_UPSTREAM:
        since = _first(r.upstream_paused_since_ns, r.marks.get(Mark.LAST_DOWNSTREAM_RX_BYTE))
    else:
        since = _first(r.when(Mark.LAST_UPSTREAM_TX_BYTE), r.marks.get(Mark.LAST_DOWNSTREAM_RX_BYTE))
    return Verdict(phase, Flag.FBS, since, "first_byte")


def _streaming(r: RequestRecord, phase: Phase) -> Verdict:
    if r.downstream_paused_since_ns is not None:
        return Verdict(phase, Flag.DNR, r.downstream_paused_since_ns, "client_drain")
    head = r.when(Mark.LAST_UPSTREAM_RX_HEADER_BYTE)
    # Headers came, no token yet: engines that answer headers at once (SGLang
    # without the PD router) are still in prefill, whatever pings they send. Same
    # stall as no headers.
    if r.stream_events is None:
        if r.upstream_rx_chunks == 0:
            return Verdict(phase, Flag.FBS, head, "first_byte")
    elif r.last_token_ns is None:
        return Verdict(phase, Flag.FBS, head, "first_byte")
    last_rx = _first(r.last_upstream_rx_ns, head)
    # Our own forwarding is judged on bytes, tokens or not: a byte received later
    # than our last write to a client that is reading is held by the proxy.
    last_tx = r.last_downstream_tx_ns
    if last_tx is not None and last_rx > last_tx:
        return Verdict(phase, Flag.PFS, last_rx, "stream_gap")
    # The engine's last sign of progress: an event stream's last event with output,
    # else its last byte.
    return Verdict(phase, Flag.MSS, last_rx if r.stream_events is None else r.last_token_ns, "stream_gap")


def _draining(r: RequestRecord, phase: Phase) -> Verdict:
    since = _first(r.downstream_paused_since_ns, r.when(Mark.LAST_UPSTREAM_RX_BYTE))
    return Verdict(phase, Flag.DNR, since, "client_drain")


_RULES = {
    Phase.AWAITING_REQUEST_HEADERS: _awaiting_headers,
    Phase.AWAITING_UPSTREAM_CONNECTION: _awaiting_connection,
    Phase.AWAITING_REQUEST_BODY: _awaiting_body,
    Phase.SENDING_REQUEST_UPSTREAM: _awaiting_upstream,
    Phase.AWAITING_UPSTREAM_HEADERS: _awaiting_upstream,
    Phase.STREAMING_RESPONSE: _streaming,
    Phase.DRAINING_TO_CLIENT: _draining,
}


def client_still_silent(record: RequestRecord, code: str, since_ns: int) -> bool:
    """For a client body stall (DBS): the client has sent nothing since it began."""
    if code != Flag.DBS.code:
        return False
    return not record.has(Mark.LAST_DOWNSTREAM_RX_BYTE) and (record.last_downstream_rx_ns or 0) <= since_ns
