"""Where an upstream read ends must not change which read brought a token.

An event stream's body cut into reads at every offset (and a byte per read), on fake
transports (see fake_transport.py): the token clock is stamped by the read that
completes the first event with output (its blank line), never by a heartbeat, and
not again until the next event with output; the counts are the same however it was
cut. The stall verdicts count from these stamps (see tests/test_token_stalls.py)."""

from __future__ import annotations

import pytest

from traceproxy.lifecycle import stream_events

from .fake_transport import ProxyHarness, byte_by_byte, masked, splits_in_two

REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: a.test\r\nContent-Length: 2\r\n\r\n{}"
SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
PING = b": ping\n\n"
EMPTY = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":null}]}\n\n'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
DONE = b"data: [DONE]\n\n"
EVENTS = (PING, EMPTY, PING, TOKEN, PING, EMPTY, DONE)
BODY = b"".join(b"%x\r\n%s\r\n" % (len(event), event) for event in EVENTS) + b"0\r\n\r\n"
# Where the token event's blank line ends in BODY: the read holding this byte completes it.
TOKEN_END = BODY.index(TOKEN) + len(TOKEN)


def stream(reads: list[bytes]) -> tuple[ProxyHarness, list]:
    """The stream's body in ``reads`` after its head; the token stamps after each read."""
    h = ProxyHarness()
    h.client_sends(REQUEST)
    h.upstream_sends(SSE_HEAD)
    record = next(iter(h.ctx.in_flight.values()))
    stamps = []
    for data in reads:
        h.upstream_sends(data)
        stamps.append((record.first_token_ns, record.last_token_ns))
    return h, stamps


def plans() -> list[list[bytes]]:
    return [[BODY], *[list(pair) for pair in splits_in_two(BODY)], byte_by_byte(BODY)]


@pytest.mark.parametrize("reads", plans(), ids=lambda reads: f"{len(reads)}-reads-first-{len(reads[0])}")
def test_the_read_that_completes_the_token_event_stamps_it_and_no_heartbeat_does(reads):
    h, stamps = stream(reads)
    with h:
        ends = [sum(map(len, reads[:i + 1])) for i in range(len(reads))]
        stamping = next(i for i, end in enumerate(ends) if end >= TOKEN_END)
        assert all(stamp == (None, None) for stamp in stamps[:stamping])
        first, last = stamps[stamping]
        assert first is not None and first == last
        assert all(stamp == (first, last) for stamp in stamps[stamping:])  # pings and [DONE] after it: no token
        record = h.done.records[0]
        assert record.outcome.code == "OK"
        summary = record.stream_events.summary()
        assert (summary.events, summary.output_events, summary.heartbeats, summary.done) == (7, 1, 5, True)
        assert record.max_token_gap_ns == 0


def test_a_scanner_that_fails_leaves_the_stream_to_byte_judgement(monkeypatch, caplog):
    def fails(self, pieces):
        raise RuntimeError("scanner bug")

    monkeypatch.setattr(stream_events.EventScanner, "feed_pieces", fails)
    h, _ = stream([BODY[:40], BODY[40:]])
    with h:
        [record] = h.done.records
        assert record.outcome.code == "OK" and record.stream_events is None and record.last_token_ns is None
        assert masked(h.client.written).endswith(b"0\r\n\r\n")  # the client had it all
        assert "event stream scanner failed" in caplog.text
