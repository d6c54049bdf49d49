"""Lifecycle transcripts: marks and times in, phase and ledger out. No event loop."""

from __future__ import annotations

import pytest

from traceproxy.lifecycle.flags import Flag
from traceproxy.lifecycle.machine import PHASES, Phase, phase_of
from traceproxy.lifecycle.marks import Mark
from traceproxy.lifecycle.timeline import (
    ClientConnectionRecord,
    MarkTwiceError,
    RequestRecord,
    UpstreamConnectionRecord,
)

MS = 1_000_000

HEALTHY = [
    Mark.FIRST_DOWNSTREAM_RX_BYTE,
    Mark.LAST_DOWNSTREAM_RX_HEADER_BYTE,
    Mark.POOL_ACQUIRED,
    Mark.FIRST_UPSTREAM_TX_BYTE,
    Mark.LAST_DOWNSTREAM_RX_BYTE,
    Mark.LAST_UPSTREAM_TX_BYTE,
    Mark.FIRST_UPSTREAM_RX_BYTE,
    Mark.LAST_UPSTREAM_RX_HEADER_BYTE,
    Mark.FIRST_DOWNSTREAM_TX_BYTE,
    Mark.FIRST_UPSTREAM_RX_BODY_BYTE,
    Mark.LAST_UPSTREAM_RX_BYTE,
    Mark.LAST_DOWNSTREAM_TX_BYTE,
]


def _request(now: int = 0) -> RequestRecord:
    # Built bare, without the first byte's mark: the transcripts stamp every mark.
    record = RequestRecord(connection=ClientConnectionRecord(peer="127.0.0.1:1", opened_ns=now),
                           sequence=1, idle_gap_ns=None)
    record.new_attempt()
    return record


def _replay(marks: list[Mark]) -> RequestRecord:
    record = _request()
    for t, mark in enumerate(marks):
        record.mark(mark, t * MS)
    return record


# (id, marks stamped so far, expected phase)
TRANSCRIPTS = [
    ("nothing-yet", [], Phase.AWAITING_REQUEST_HEADERS),
    ("head-started", HEALTHY[:1], Phase.AWAITING_REQUEST_HEADERS),
    ("head-done-no-connection", HEALTHY[:2], Phase.AWAITING_UPSTREAM_CONNECTION),
    ("pool-queued", HEALTHY[:2] + [Mark.POOL_QUEUED], Phase.AWAITING_UPSTREAM_CONNECTION),
    ("connected-body-coming", HEALTHY[:4], Phase.AWAITING_REQUEST_BODY),
    ("body-in-upstream-not-drained", HEALTHY[:5], Phase.SENDING_REQUEST_UPSTREAM),
    ("sent-nothing-back", HEALTHY[:6], Phase.AWAITING_UPSTREAM_HEADERS),
    ("first-byte-no-headers", HEALTHY[:7], Phase.AWAITING_UPSTREAM_HEADERS),
    ("streaming", HEALTHY[:10], Phase.STREAMING_RESPONSE),
    ("upstream-done-client-not-drained", HEALTHY[:11], Phase.DRAINING_TO_CLIENT),
    ("body-complete-before-connection", HEALTHY[:2] + [Mark.LAST_DOWNSTREAM_RX_BYTE],
     Phase.AWAITING_UPSTREAM_CONNECTION),
    ("early-response-before-body-complete",
     HEALTHY[:4] + [Mark.FIRST_UPSTREAM_RX_BYTE, Mark.LAST_UPSTREAM_RX_HEADER_BYTE], Phase.STREAMING_RESPONSE),
]


@pytest.mark.parametrize("marks,phase", [(m, p) for _, m, p in TRANSCRIPTS], ids=[i for i, _, _ in TRANSCRIPTS])
def test_phase_is_named_for_the_mark_it_waits_on(marks, phase):
    assert phase_of(_replay(marks)) is phase


def test_finished_request_is_done_whatever_its_marks():
    record = _replay(HEALTHY[:3])
    record.finish(Flag.UF, 5 * MS, "connect refused")
    assert phase_of(record) is Phase.DONE


def test_every_phase_but_done_waits_on_a_distinct_mark():
    awaited = [mark for phase, mark in PHASES if phase is not Phase.DONE]
    assert None not in awaited and len(set(awaited)) == len(awaited)


def test_a_mark_set_twice_is_a_bug():
    record = _request()
    record.mark(Mark.FIRST_DOWNSTREAM_RX_BYTE, 1)
    with pytest.raises(MarkTwiceError):
        record.mark(Mark.FIRST_DOWNSTREAM_RX_BYTE, 2)
    assert record.mark_once(Mark.FIRST_DOWNSTREAM_RX_BYTE, 3) is False
    assert record.when(Mark.FIRST_DOWNSTREAM_RX_BYTE) == 1


def test_a_request_ends_exactly_once():
    record = _request()
    record.finish(Flag.OK, 10)
    with pytest.raises(MarkTwiceError):
        record.finish(Flag.DC, 11)
    assert record.outcome is Flag.OK


def test_upstream_marks_belong_to_each_attempt():
    record = _request()
    record.mark(Mark.FIRST_UPSTREAM_TX_BYTE, 1 * MS)
    record.new_attempt()  # the resend after a stale connection
    assert not record.has(Mark.FIRST_UPSTREAM_TX_BYTE)
    record.mark(Mark.FIRST_UPSTREAM_TX_BYTE, 2 * MS)
    assert [a.marks[Mark.FIRST_UPSTREAM_TX_BYTE] for a in record.attempts] == [1 * MS, 2 * MS]


def test_keepalive_ledger_numbers_requests_and_measures_idle_gaps():
    conn = ClientConnectionRecord(peer="127.0.0.1:1", opened_ns=0)
    first = conn.begin_request(5 * MS)
    assert (first.sequence, first.idle_gap_ns) == (1, None)
    assert first.marks == {Mark.FIRST_DOWNSTREAM_RX_BYTE: 5 * MS}
    first.finish(Flag.OK, 100 * MS)
    second = conn.begin_request(600 * MS)
    assert (second.sequence, second.idle_gap_ns) == (2, 500 * MS)


def test_a_pipelined_request_had_no_idle_gap():
    conn = ClientConnectionRecord(peer="127.0.0.1:1", opened_ns=0)
    conn.begin_request(5 * MS).finish(Flag.OK, 100 * MS)
    second = conn.begin_request(600 * MS)  # after 0.5 s idle
    third = conn.begin_request(601 * MS)  # arrived while the second was in flight
    assert [(r.sequence, r.idle_gap_ns) for r in (second, third)] == [(2, 500 * MS), (3, 0)]


def test_attempt_records_reuse_idle_age_and_request_count():
    upstream = UpstreamConnectionRecord(opened_ns=0)
    record = _request()
    record.attempt.attach(upstream, reused=False, now_ns=0)
    upstream.idle_since_ns = 10 * MS
    record2 = _request()
    record2.attempt.attach(upstream, reused=True, now_ns=4_810 * MS)
    assert record2.attempt.reused and record2.attempt.idle_age_ns == 4_800 * MS
    assert record2.attempt.connection_request_number == 2
    assert upstream.idle_since_ns is None
