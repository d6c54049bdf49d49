"""Deadline transcripts: a request's marks, flags and limits in; the next deadline, and
what passing it ends the request with, out. No event loop, no clock."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from traceproxy.lifecycle.deadlines import client_took_more, expiry, next_deadline
from traceproxy.lifecycle.flags import Flag
from traceproxy.lifecycle.marks import Mark
from traceproxy.lifecycle.timeline import ClientConnectionRecord, RequestRecord

S = 1_000_000_000
NOW = 20 * S


class Limits(NamedTuple):
    upstream_headers_ns: int = 10 * S
    client_body_ns: int = 4 * S
    upstream_read_ns: int = 6 * S
    client_send_ns: int = 5 * S


class Request(NamedTuple):
    """A request's state in seconds; the defaults: a bodiless request sent whole at
    2 s, started at 1 s, no response yet."""

    started: float = 1
    last_client_byte: float | None = 2
    expects_body: bool = False
    request_complete: bool = True
    reading_paused: bool = False
    response_started: bool = False
    response_complete: bool = False
    last_upstream_byte: float | None = None
    upstream_paused_by_client: bool = False
    client_paused: bool = False
    client_taken: float = 0


def seconds(ns: float | None) -> int | None:
    return None if ns is None else round(ns * S)


def deadline(request: Request, limits: Limits = Limits()):
    return next_deadline(
        NOW, limits, started_ns=seconds(request.started), last_client_byte_ns=seconds(request.last_client_byte),
        expects_body=request.expects_body, request_complete=request.request_complete,
        reading_paused=request.reading_paused, response_started=request.response_started,
        response_complete=request.response_complete, last_upstream_byte_ns=seconds(request.last_upstream_byte),
        upstream_paused_by_client=request.upstream_paused_by_client, client_paused=request.client_paused,
        client_taken_ns=seconds(request.client_taken),
    )


SENDING_BODY = Request(expects_body=True, request_complete=False)
STREAMING = Request(response_started=True, last_upstream_byte=12)
CLIENT_FULL = STREAMING._replace(client_paused=True, client_taken=11)

# (id, request, limits, deadline in seconds or None, outcome)
CASES = [
    ("nothing-applies-once-the-response-is-in", STREAMING._replace(response_complete=True), Limits(), None, None),
    ("every-limit-off", SENDING_BODY, Limits(0, 0, 0, 0), None, None),
    ("headers-counted-from-the-last-request-byte", Request(last_client_byte=3), Limits(), 13, Flag.UT),
    ("headers-limit-off", Request(), Limits(upstream_headers_ns=0), None, None),
    # Pipelined: its bytes came at 2 s, its turn at 7 s. The wait between is nobody's silence.
    ("pipelined-wait-is-not-client-silence-for-headers", Request(started=7), Limits(), 17, Flag.UT),
    ("pipelined-wait-is-not-client-silence-for-the-body", SENDING_BODY._replace(started=7), Limits(), 11, Flag.DBT),
    # The client owes body bytes: its silence is its own, even past the header deadline.
    ("owes-body-the-client-is-timed", SENDING_BODY, Limits(upstream_headers_ns=1 * S), 6, Flag.DBT),
    ("owes-body-without-a-body-limit-the-headers-are", SENDING_BODY, Limits(client_body_ns=0), 12, Flag.UT),
    # The proxy stopped reading the body (upstream full, no connection): that wait is
    # the upstream's; the body deadline stays a full limit from now.
    ("reading-paused-the-header-deadline-runs", SENDING_BODY._replace(reading_paused=True),
     Limits(client_body_ns=15 * S), 12, Flag.UT),
    ("reading-paused-the-body-deadline-restarts-from-now", SENDING_BODY._replace(reading_paused=True),
     Limits(upstream_headers_ns=30 * S), 24, Flag.DBT),
    ("reading-paused-matters-only-while-the-body-is-owed", Request(reading_paused=True), Limits(), 12, Flag.UT),
    ("tie-goes-to-the-client", SENDING_BODY._replace(reading_paused=True),
     Limits(upstream_headers_ns=22 * S, client_body_ns=4 * S), 24, Flag.DBT),
    ("upstream-read-from-its-last-byte", STREAMING, Limits(), 18, Flag.SI),
    ("our-own-pause-is-not-upstream-silence", STREAMING._replace(upstream_paused_by_client=True), Limits(), 26,
     Flag.SI),
    ("upstream-read-limit-off", STREAMING, Limits(upstream_read_ns=0), None, None),
    # The upstream answered early (a 413) while the client still sends its body.
    ("early-answer-the-body-still-timed", STREAMING._replace(expects_body=True, request_complete=False,
                                                              last_upstream_byte=3), Limits(), 6, Flag.DBT),
    ("early-answer-a-tie-with-the-read-goes-to-the-client",
     STREAMING._replace(expects_body=True, request_complete=False, last_upstream_byte=0), Limits(), 6, Flag.DBT),
    ("client-send-from-when-it-last-took-bytes", CLIENT_FULL._replace(upstream_paused_by_client=True), Limits(), 16,
     Flag.DNR),
    ("client-send-while-draining-the-tail", CLIENT_FULL._replace(response_complete=True), Limits(), 16, Flag.DNR),
    ("client-send-a-tie-with-the-read-goes-to-the-read", CLIENT_FULL._replace(client_taken=13), Limits(), 18,
     Flag.SI),
    ("client-send-limit-off", CLIENT_FULL._replace(response_complete=True), Limits(client_send_ns=0), None, None),
]


@pytest.mark.parametrize("request_state,limits,due,outcome", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_next_deadline(request_state, limits, due, outcome):
    expected = None if outcome is None else (seconds(due), outcome)
    assert deadline(request_state, limits) == expected


def request_record(*marks: Mark, **stamps) -> RequestRecord:
    """Marks stamped at 1 s, 2 s, 3 s, ... in the order given; other fields as given."""
    record = RequestRecord(connection=ClientConnectionRecord(peer="p", opened_ns=0), sequence=1, idle_gap_ns=None)
    record.new_attempt()
    for second, mark in enumerate(marks, start=1):
        record.mark(mark, second * S)
    for name, value in stamps.items():
        setattr(record, name, value)
    return record


HEAD = (Mark.FIRST_DOWNSTREAM_RX_BYTE, Mark.LAST_DOWNSTREAM_RX_HEADER_BYTE)
WHERE = "upstream u:1 on new connection #1"
FAST = Limits(upstream_headers_ns=S // 2 + S // 10, client_send_ns=S // 4)

# (id, the deadline that passed, record, outcome, detail, the client's connection may be kept)
EXPIRIES = [
    ("queued-for-a-pool-slot-is-the-proxys-cap", Flag.UT, request_record(*HEAD, Mark.POOL_QUEUED), Flag.PWS,
     "no upstream connection free within 0.6 s: pool.max_connections (8) reached", True),
    ("given-a-connection-the-upstream-is-late", Flag.UT,
     request_record(*HEAD, Mark.POOL_QUEUED, Mark.POOL_ACQUIRED), Flag.UT,
     f"{WHERE}: no response headers within 0.6 s of the client's last request byte", True),
    ("never-queued-the-upstream-is-late", Flag.UT, request_record(*HEAD), Flag.UT,
     f"{WHERE}: no response headers within 0.6 s of the client's last request byte", True),
    ("body-silence-counted-from-its-start", Flag.DBT, request_record(*HEAD, downstream_rx_body_bytes=10), Flag.DBT,
     "request body silent for 4.5 s after 10 bytes", False),
    ("upstream-silence-counted-from-its-last-byte", Flag.SI,
     request_record(*HEAD, last_upstream_rx_ns=NOW - 7 * S, upstream_rx_body_bytes=99), Flag.SI,
     f"{WHERE}: response body silent for 7.0 s after 99 bytes", True),
    ("the-client-took-none", Flag.DNR, request_record(*HEAD, downstream_tx_body_bytes=4096), Flag.DNR,
     "the client took none of the response for 0.25 s after 4096 body bytes", False),
]


@pytest.mark.parametrize("expired,record,outcome,detail,client_kept", [e[1:] for e in EXPIRIES],
                         ids=[e[0] for e in EXPIRIES])
def test_what_a_passed_deadline_ends_the_request_with(expired, record, outcome, detail, client_kept):
    due = NOW - S // 2  # half a second late: the body's silence began a limit before that
    ending = expiry(expired, due, NOW, record, FAST._replace(client_body_ns=4 * S), WHERE, max_connections=8)
    assert (ending.outcome, ending.detail, ending.client_kept) == (outcome, detail, client_kept)


@pytest.mark.parametrize("taken,taken_before,moves", [
    (5000, 4096, True),
    (4096, 4096, False),
    (-1, 4096, False),  # unknown now: not progress
    (0, -1, True),  # unknown at the start, then known
], ids=["took-more", "took-none", "unknown-is-not-progress", "known-after-unknown"])
def test_the_send_deadline_moves_on_only_when_the_client_took_more(taken, taken_before, moves):
    assert client_took_more(taken, taken_before) is moves


def test_an_outcome_no_deadline_gives_is_refused():
    with pytest.raises(ValueError, match="DC"):
        expiry(Flag.DC, NOW, NOW, request_record(*HEAD), Limits(), WHERE, max_connections=8)
