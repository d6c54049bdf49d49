"""Token judgement transcripts: an event stream's pieces at fake times in, the verdict out.

For a ``text/event-stream`` response the stall clock counts from the last event with
output, never from a heartbeat (issue 23). Each piece stands for one upstream read, and
is stamped as the response relay stamps a read: the byte clock always, the token clock
when the scanner says the read completed an event with output."""

from __future__ import annotations

import pytest

from traceproxy.lifecycle.flags import Blame, Flag
from traceproxy.lifecycle.machine import Phase
from traceproxy.lifecycle.marks import Mark
from traceproxy.lifecycle.stall import StallThresholds, judge
from traceproxy.lifecycle.stream_events import OUTPUT, EventScanner
from traceproxy.lifecycle.timeline import ClientConnectionRecord, RequestRecord

S = 1_000_000_000
THRESHOLDS = StallThresholds(first_byte=4, stream_gap=5, client_drain=6)
HEAD_AT = 10  # the response head arrived at 10 s

CONTENT = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant"},"finish_reason":null}]}\n\n'
EMPTY = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":null}]}\n\n'
EMPTY_CONTENT = b'data: {"choices":[{"index":0,"delta":{"content":""},"finish_reason":null}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}\n\n'
TOOL_CALL = (b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\\"ci"}}]},'
             b'"finish_reason":null}]}\n\n')
REASONING = b'data: {"choices":[{"index":0,"delta":{"reasoning_content":"hmm"},"finish_reason":null}]}\n\n'
PING, KEEPALIVE, BLANK, NAMED_PING = b": ping\n\n", b": keepalive\n\n", b"data: \n\n", b"event: ping\ndata: {}\n\n"


def generate(text: str, tokens: int) -> bytes:
    """An SGLang /generate stream event: the whole text so far, and its token count."""
    return (b'data: {"text":"%s","output_ids":[],"meta_info":{"id":"r1","prompt_tokens":5,"completion_tokens":%d,'
            b'"finish_reason":null}}\n\n' % (text.encode(), tokens))


def streamed(*pieces: tuple[float, bytes]) -> RequestRecord:
    """A request whose 200 event-stream head came at HEAD_AT and whose body came in
    reads at the given seconds, each stamped as proxy/relay.py stamps a read."""
    record = RequestRecord(connection=ClientConnectionRecord(peer="p", opened_ns=0), sequence=1, idle_gap_ns=None)
    record.new_attempt()
    for second, mark in enumerate((Mark.FIRST_DOWNSTREAM_RX_BYTE, Mark.LAST_DOWNSTREAM_RX_HEADER_BYTE,
                                   Mark.POOL_ACQUIRED, Mark.FIRST_UPSTREAM_TX_BYTE, Mark.LAST_DOWNSTREAM_RX_BYTE,
                                   Mark.LAST_UPSTREAM_TX_BYTE), start=1):
        record.mark(mark, second * S)
    for mark in (Mark.FIRST_UPSTREAM_RX_BYTE, Mark.LAST_UPSTREAM_RX_HEADER_BYTE, Mark.FIRST_DOWNSTREAM_TX_BYTE):
        record.mark(mark, HEAD_AT * S)
    record.status = 200
    record.stream_events = events = EventScanner()
    record.last_upstream_rx_ns = record.last_downstream_tx_ns = HEAD_AT * S
    for at, data in pieces:
        now = round(at * S)
        record.upstream_rx_chunks += 1
        record.last_upstream_rx_ns = record.last_downstream_tx_ns = now
        if events.feed(data) & OUTPUT:
            if record.last_token_ns is None:
                record.first_token_ns = now
            else:
                record.max_token_gap_ns = max(record.max_token_gap_ns, now - record.last_token_ns)
            record.last_token_ns = now
    return record


def pings(start: float, end: float, ping: bytes = PING) -> list[tuple[float, bytes]]:
    """A heartbeat every half second from ``start`` to ``end``."""
    return [(start + i / 2, ping) for i in range(int((end - start) * 2) + 1)]


# (id, pieces, outcome, since s, deadline s): judged just before the deadline, and at it.
CASES = [
    ("head-then-pings", pings(10.5, 30), Flag.FBS, HEAD_AT, HEAD_AT + 4),
    ("head-then-named-and-blank-pings", pings(10.5, 20, NAMED_PING) + pings(20.2, 30, BLANK), Flag.FBS, HEAD_AT,
     HEAD_AT + 4),
    ("head-then-role-only-and-empty-deltas", [(10.5, ROLE), *pings(11, 30, EMPTY)], Flag.FBS, HEAD_AT, HEAD_AT + 4),
    ("an-empty-content-is-no-token", pings(10.5, 30, EMPTY_CONTENT), Flag.FBS, HEAD_AT, HEAD_AT + 4),
    ("usage-only-is-no-token", pings(10.5, 30, USAGE), Flag.FBS, HEAD_AT, HEAD_AT + 4),
    ("one-token-then-pings", [(11, CONTENT), *pings(11.5, 30, KEEPALIVE)], Flag.MSS, 11, 16),
    ("one-token-then-empty-deltas", [(11, CONTENT), *pings(11.5, 30, EMPTY)], Flag.MSS, 11, 16),
    ("tokens-then-pings", [(11, CONTENT), (12, CONTENT), (13.5, CONTENT), *pings(14, 30)], Flag.MSS, 13.5, 18.5),
    ("tool-call-arguments-are-tokens", [(11, TOOL_CALL), *pings(11.5, 14), (14.2, TOOL_CALL), *pings(14.5, 30)],
     Flag.MSS, 14.2, 19.2),
    ("reasoning-is-tokens", [(11, REASONING), (12.5, REASONING), *pings(13, 30)], Flag.MSS, 12.5, 17.5),
    ("generate-new-text-is-a-token", [(11, generate("a", 1)), (12, generate("ab", 2)), *[(12.5 + i, generate("ab", 2))
                                                                                         for i in range(10)]],
     Flag.MSS, 12, 17),
]


@pytest.mark.parametrize("pieces,outcome,since,deadline", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_an_event_stream_is_judged_on_its_tokens(pieces, outcome, since, deadline):
    record = streamed(*pieces)
    due = round(deadline * S)
    before = judge(record, due - 1, THRESHOLDS)
    assert before.verdict.phase is Phase.STREAMING_RESPONSE
    assert before.verdict.outcome is outcome and outcome.blame is Blame.ENGINE
    assert before.verdict.since_ns == round(since * S)
    assert not before.stalled
    assert judge(record, due, THRESHOLDS).stalled


def test_a_token_ends_the_first_byte_wait_and_starts_the_gap():
    record = streamed(*pings(10.5, 13))
    assert judge(record, 13 * S, THRESHOLDS).verdict.outcome is Flag.FBS
    record = streamed(*pings(10.5, 13), (13.2, CONTENT))
    found = judge(record, 14 * S, THRESHOLDS)
    assert found.verdict.outcome is Flag.MSS and found.verdict.since_ns == round(13.2 * S)
    assert record.first_token_ns == record.last_token_ns == round(13.2 * S)


def test_the_token_stamps_and_the_longest_gap_between_tokens():
    record = streamed((11, CONTENT), *pings(11.5, 13), (13.5, CONTENT), (14, CONTENT))
    assert (record.first_token_ns, record.last_token_ns) == (11 * S, 14 * S)
    assert record.max_token_gap_ns == round(2.5 * S)
    assert (record.stream_events.output_events, record.stream_events.heartbeats) == (3, 4)


def test_any_other_response_is_judged_on_its_bytes():
    record = streamed(*pings(10.5, 30))
    record.stream_events = None  # not an event stream: a ping is a byte like any other
    found = judge(record, 31 * S, THRESHOLDS)
    assert found.verdict.outcome is Flag.MSS and found.verdict.since_ns == 30 * S and not found.stalled


def test_a_client_not_reading_is_still_the_clients_stall():
    record = streamed((11, CONTENT), *pings(11.5, 20))
    record.downstream_paused_since_ns = 12 * S
    assert judge(record, 19 * S, THRESHOLDS).verdict.outcome is Flag.DNR


def test_bytes_the_proxy_holds_back_are_the_proxys_stall_tokens_or_not():
    record = streamed((11, CONTENT), *pings(11.5, 20))
    record.last_downstream_tx_ns = 15 * S  # the pings after 15 s were never written
    found = judge(record, 21 * S, THRESHOLDS)
    assert found.verdict.outcome is Flag.PFS and found.verdict.since_ns == 20 * S
