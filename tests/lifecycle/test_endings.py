"""Ending transcripts: an event stream's bytes (split anywhere) and how it ended in;
the outcome and its detail out. No event loop."""

from __future__ import annotations

import pytest

from traceproxy.lifecycle.endings import had_the_whole_stream, judge_clean_ending, judge_client_leaving
from traceproxy.lifecycle.flags import Flag
from traceproxy.lifecycle.stream_events import EventScanner
from traceproxy.lifecycle.timeline import ClientConnectionRecord, RequestRecord

TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
FINISH = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"
SMG_ERROR = (b'data: {"error":{"message":"Stream error: error decoding response body: unexpected EOF",'
             b'"type":"stream_error"}}\n\n')


def streamed(body: bytes, pieces: str = "whole", status: int = 200) -> RequestRecord:
    """A record whose event stream carried ``body``, fed whole or a byte at a time."""
    record = RequestRecord(connection=ClientConnectionRecord(peer="p", opened_ns=0), sequence=1, idle_gap_ns=None)
    record.status = status
    record.stream_events = events = EventScanner()
    for piece in ([body] if pieces == "whole" else [body[i:i + 1] for i in range(len(body))]):
        events.feed(piece)
    record.upstream_rx_chunks = 1 if pieces == "whole" else len(body)
    return record


# (id, body, outcome)
CLEAN_ENDINGS = [
    ("done", TOKEN + FINISH + DONE, Flag.OK),
    ("finish-reason-without-done", TOKEN + FINISH, Flag.OK),
    ("done-after-pings", PING + TOKEN + PING + DONE, Flag.OK),
    ("no-end", TOKEN + TOKEN, Flag.NDN),
    ("pings-only", PING + PING, Flag.NDN),
    # The last event's blank line never came: the event did not end, nor did the stream.
    ("done-cut-before-its-blank-line", TOKEN + b"data: [DONE]\n", Flag.NDN),
    ("done-inside-content", b'data: {"choices":[{"delta":{"content":"data: [DONE]"}}]}\n\n', Flag.NDN),
    ("smg-error-then-done", TOKEN + SMG_ERROR + DONE, Flag.USE),
    ("error-event-named", TOKEN + b"event: error\ndata: engine gone\n\n" + DONE, Flag.USE),
    ("error-without-done", TOKEN + SMG_ERROR, Flag.USE),
]


@pytest.mark.parametrize("pieces", ["whole", "byte-per-read"])
@pytest.mark.parametrize("body,outcome", [c[1:] for c in CLEAN_ENDINGS], ids=[c[0] for c in CLEAN_ENDINGS])
def test_how_a_clean_event_stream_ended_is_judged_from_its_events_however_it_was_read(body, outcome, pieces):
    assert judge_clean_ending(streamed(body, pieces), None)[0] is outcome


def test_an_in_band_error_is_named_in_the_detail():
    outcome, detail = judge_clean_ending(streamed(TOKEN + SMG_ERROR + DONE), None)
    assert outcome is Flag.USE and outcome.blame.value == "engine"
    assert detail == ("the upstream reported in its event stream that the response failed: "
                      "Stream error: error decoding response body: unexpected EOF")


def test_a_stream_without_its_end_says_how_many_events_it_had():
    outcome, detail = judge_clean_ending(streamed(PING + TOKEN + TOKEN), None)
    assert outcome is Flag.NDN and detail.startswith("SSE stream of 3 events (1 chunks) ended without data: [DONE]")


def test_only_a_200_event_stream_is_judged_by_its_events():
    assert judge_clean_ending(streamed(SMG_ERROR, status=500), None) == (Flag.OK, None)
    coded = streamed(b"")
    coded.stream_events = None  # a coded body (gzip): not scanned
    assert judge_clean_ending(coded, None) == (Flag.OK, None)


def test_our_own_framing_is_checked_first():
    record = streamed(TOKEN + DONE)
    record.downstream_tx_body_bytes = 3
    assert judge_clean_ending(record, 5)[0] is Flag.PFE


@pytest.mark.parametrize("outcome,detail", [(Flag.DC, "client closed the connection"), (Flag.OK, None)],
                         ids=["left", "left-at-done"])
def test_a_client_that_left_after_an_in_band_error_did_not_fail_the_response(outcome, detail):
    judged, text = judge_client_leaving(streamed(TOKEN + SMG_ERROR + DONE), outcome, detail)
    assert judged is Flag.USE
    assert text.startswith("the upstream reported in its event stream that the response failed: Stream error")
    assert text.endswith("; then client closed the connection" if detail else
                         "; then the client closed the connection after data: [DONE]")


def test_a_client_that_left_a_healthy_stream_keeps_its_outcome():
    assert judge_client_leaving(streamed(TOKEN), Flag.DC, "client closed the connection") == (
        Flag.DC, "client closed the connection")
    assert judge_client_leaving(streamed(TOKEN + DONE), Flag.OK, None) == (Flag.OK, None)


# (id, body, whole)
AT_THE_CLIENTS_FIN = [
    ("done-last", TOKEN + DONE, True),
    ("done-then-blank-lines", TOKEN + DONE + b"\n\n", True),
    ("done-then-a-ping", TOKEN + DONE + PING, False),
    ("done-half-sent", TOKEN + b"data: [DO", False),
    ("done-without-its-blank-line", TOKEN + b"data: [DONE]\n", False),
    ("finish-reason-only", TOKEN + FINISH, False),
]


@pytest.mark.parametrize("pieces", ["whole", "byte-per-read"])
@pytest.mark.parametrize("body,whole", [c[1:] for c in AT_THE_CLIENTS_FIN], ids=[c[0] for c in AT_THE_CLIENTS_FIN])
def test_a_client_closing_had_its_whole_stream_only_after_the_last_event_done(body, whole, pieces):
    record = streamed(body, pieces)
    assert had_the_whole_stream(record, unsent=0) is whole
    assert not had_the_whole_stream(record, unsent=5)  # [DONE] still in its buffers
    assert not had_the_whole_stream(record, unsent=None)  # not known
