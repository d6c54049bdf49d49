"""Attribution transcripts: marks, progress stamps and a fake clock in; phase,
outcome, blame and deadline out. No event loop."""

from __future__ import annotations

import pytest

from traceproxy.lifecycle.flags import Blame, Flag
from traceproxy.lifecycle.machine import Phase
from traceproxy.lifecycle.marks import Mark
from traceproxy.lifecycle.stall import StallThresholds, judge, judge_all
from traceproxy.lifecycle.timeline import ClientConnectionRecord, RequestRecord

S = 1_000_000_000
THRESHOLDS = StallThresholds(client_headers=1, client_body=2, pool_wait=3, first_byte=4, stream_gap=5,
                             client_drain=6)


def request(*marks: Mark, **stamps) -> RequestRecord:
    """Marks stamped at 1 s, 2 s, 3 s, ... in the order given; stamps in seconds.
    A record whose marks include the first body byte has received one chunk."""
    record = RequestRecord(connection=ClientConnectionRecord(peer="p", opened_ns=0), sequence=1, idle_gap_ns=None)
    record.new_attempt()
    for second, mark in enumerate(marks, start=1):
        record.mark(mark, second * S)
    for name, seconds in stamps.items():
        setattr(record, name, round(seconds * S))
    record.upstream_rx_chunks = int(Mark.FIRST_UPSTREAM_RX_BODY_BYTE in marks)
    return record


HEAD = (Mark.FIRST_DOWNSTREAM_RX_BYTE, Mark.LAST_DOWNSTREAM_RX_HEADER_BYTE)
SENT = HEAD + (Mark.POOL_ACQUIRED, Mark.FIRST_UPSTREAM_TX_BYTE, Mark.LAST_DOWNSTREAM_RX_BYTE,
               Mark.LAST_UPSTREAM_TX_BYTE)  # t=6
STREAMING = SENT + (Mark.FIRST_UPSTREAM_RX_BYTE, Mark.LAST_UPSTREAM_RX_HEADER_BYTE, Mark.FIRST_DOWNSTREAM_TX_BYTE,
                    Mark.FIRST_UPSTREAM_RX_BODY_BYTE)  # t=10

# (id, record, phase, outcome, blame, since seconds, deadline seconds)
CASES = [
    ("head-incomplete", request(HEAD[0]), Phase.AWAITING_REQUEST_HEADERS, Flag.DHS, Blame.CLIENT, 1, 2),
    # Begun behind other requests (read only as far as the proxy read on): timed from its turn.
    ("head-incomplete-after-its-turn", request(HEAD[0], turn_began_ns=7), Phase.AWAITING_REQUEST_HEADERS,
     Flag.DHS, Blame.CLIENT, 7, 8),
    ("connecting", request(*HEAD), Phase.AWAITING_UPSTREAM_CONNECTION, Flag.UCS, Blame.ENGINE, 2, 5),
    ("pool-queued", request(*HEAD, Mark.POOL_QUEUED), Phase.AWAITING_UPSTREAM_CONNECTION, Flag.PWS, Blame.PROXY, 3, 6),
    ("body-from-client", request(*SENT[:4], last_downstream_rx_ns=4.5), Phase.AWAITING_REQUEST_BODY, Flag.DBS,
     Blame.CLIENT, 4.5, 6.5),
    # Pipelined, its body partly read before it waited its turn: timed from the turn.
    ("body-after-its-turn", request(*SENT[:4], last_downstream_rx_ns=4.5, turn_began_ns=9), Phase.AWAITING_REQUEST_BODY,
     Flag.DBS, Blame.CLIENT, 9, 11),
    ("engine-not-reading-body", request(*SENT[:4], last_downstream_rx_ns=4.5, upstream_paused_since_ns=4.2),
     Phase.AWAITING_REQUEST_BODY, Flag.FBS, Blame.ENGINE, 4.2, 8.2),
    ("prefill", request(*SENT), Phase.AWAITING_UPSTREAM_HEADERS, Flag.FBS, Blame.ENGINE, 6, 10),
    ("decode-gap", request(*STREAMING, last_upstream_rx_ns=11, last_downstream_tx_ns=11),
     Phase.STREAMING_RESPONSE, Flag.MSS, Blame.ENGINE, 11, 16),
    ("slow-reader", request(*STREAMING, last_upstream_rx_ns=11, last_downstream_tx_ns=11,
                            downstream_paused_since_ns=10.5),
     Phase.STREAMING_RESPONSE, Flag.DNR, Blame.CLIENT, 10.5, 16.5),
    ("proxy-holds-bytes", request(*STREAMING, last_upstream_rx_ns=12, last_downstream_tx_ns=11),
     Phase.STREAMING_RESPONSE, Flag.PFS, Blame.PROXY, 12, 17),
    ("headers-then-prefill", request(*STREAMING[:-1]), Phase.STREAMING_RESPONSE, Flag.FBS, Blame.ENGINE, 8, 12),
    ("tail-not-drained", request(*STREAMING, Mark.LAST_UPSTREAM_RX_BYTE, downstream_paused_since_ns=10.5),
     Phase.DRAINING_TO_CLIENT, Flag.DNR, Blame.CLIENT, 10.5, 16.5),
]


@pytest.mark.parametrize("record,phase,outcome,blame,since,deadline", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_whose_turn_it_is(record, phase, outcome, blame, since, deadline):
    due = round(deadline * S)
    before = judge(record, due - 1, THRESHOLDS)
    assert before.verdict.phase is phase
    assert before.verdict.outcome is outcome and outcome.blame is blame
    assert before.verdict.since_ns == round(since * S)
    assert before.deadline_ns == due and not before.stalled
    assert judge(record, due, THRESHOLDS).stalled


def test_slow_reader_and_stalled_engine_are_not_confused():
    engine = request(*STREAMING, last_upstream_rx_ns=11, last_downstream_tx_ns=11)
    reader = request(*STREAMING, last_upstream_rx_ns=11, last_downstream_tx_ns=11, downstream_paused_since_ns=11)
    assert judge(engine, 30 * S, THRESHOLDS).verdict.outcome.blame is Blame.ENGINE
    assert judge(reader, 30 * S, THRESHOLDS).verdict.outcome.blame is Blame.CLIENT


def test_a_zero_threshold_turns_that_stall_off():
    record = request(*SENT)
    off = StallThresholds(first_byte=0)
    assert judge(record, 10_000 * S, off).deadline_ns is None
    assert judge_all([record], 10_000 * S, off) == ([], None)


def test_finished_requests_have_no_verdict():
    record = request(*SENT)
    record.finish(Flag.OK, 7 * S)
    assert judge(record, 100 * S, THRESHOLDS) is None


def test_judge_all_reports_stalls_and_the_earliest_deadline_ahead():
    stuck = request(*SENT)  # deadline 10 s
    healthy = request(*STREAMING, last_upstream_rx_ns=11, last_downstream_tx_ns=11)  # deadline 16 s
    quiet = request(HEAD[0])  # deadline 2 s
    stalled, earliest = judge_all([stuck, healthy, quiet], 12 * S, THRESHOLDS)
    assert {j.record.id for j in stalled} == {stuck.id, quiet.id}
    assert earliest == 16 * S


def test_a_request_queued_at_the_cap_that_then_connects_is_a_connect_wait():
    record = request(*HEAD, Mark.POOL_QUEUED)  # queued at t=3
    assert judge(record, 4 * S, THRESHOLDS).verdict.outcome is Flag.PWS
    record.attempt.connecting_since_ns = 5 * S  # given a slot, now connecting
    found = judge(record, 6 * S, THRESHOLDS)
    assert found.verdict.outcome is Flag.UCS and found.verdict.since_ns == 5 * S


def test_a_resend_connect_wait_counts_from_the_resend():
    record = request(*HEAD)
    record.new_attempt(now_ns=7 * S)
    assert judge(record, 8 * S, THRESHOLDS).verdict.since_ns == 7 * S


def test_the_body_wait_does_not_count_the_time_the_upstream_was_not_reading():
    record = request(*HEAD, Mark.POOL_ACQUIRED, Mark.FIRST_UPSTREAM_TX_BYTE, last_downstream_rx_ns=4)
    record.upstream_resumed_ns = 9 * S  # paused from 4 s (the client held) until 9 s
    found = judge(record, 10 * S, THRESHOLDS)
    assert found.verdict.outcome is Flag.DBS and found.verdict.since_ns == 9 * S and not found.stalled


def test_a_pipelined_request_waiting_its_turn_has_no_verdict():
    record = request(*HEAD)
    record.waiting_turn = True
    assert judge(record, 100 * S, THRESHOLDS) is None
