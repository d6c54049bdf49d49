"""An event stream's tokens so far, for what /debug/inflight, the stall line and span,
the access log and ``top`` show of them (``observe.token_view``).

Theory of operation
-------------------
For an event stream (``record.stream_events`` set) the stall clock counts from the
last event with output, and until the first one from the response head
(``attribution``): heartbeats before the first token keep a first-byte wait (FBS)
going, heartbeats after one a stream gap (MSS). ``token_progress`` reads the same
stamps, so what the views show is the wait the verdict judges: ``waiting_since_ns``
is the last token, or, while none came (``token_came`` False), the response head.

Read when someone asks (a snapshot, a stall, a request's end), never per read: the
relay stamps the tokens, this only reads them. Pure: no clock, no I/O. Any
other response has no progress here (None) and keeps byte judgement. The longest token
gap is None until two output events came: there is no gap to speak of before that.
"""

from __future__ import annotations

from typing import NamedTuple

from .marks import Mark
from .timeline import RequestRecord


class TokenProgress(NamedTuple):
    output_events: int  # events with output so far (tokens, as far as the proxy can tell)
    heartbeats: int  # events without output: comments, empty or role-only deltas, pings
    token_came: bool  # False: no event with output yet
    waiting_since_ns: int | None  # the last token, else the response head (None: no head yet)
    first_token_ns: int | None
    max_token_gap_ns: int | None  # the longest wait between two events with output; None: not two yet


# A gap is between two output events: with fewer there is none, and a 0 in its place would
# read as tokens coming back to back (a stalled stream's "longest gap 0").
EVENTS_FOR_A_GAP = 2


def has_token_gap(output_events: int) -> bool:
    """Whether a stream with this many output events has a token gap to show."""
    return output_events >= EVENTS_FOR_A_GAP


def token_progress(record: RequestRecord) -> TokenProgress | None:
    """What the record's event stream brought so far; None when it is not one."""
    events = record.stream_events
    if events is None:
        return None
    last = record.last_token_ns
    since = last if last is not None else record.when(Mark.LAST_UPSTREAM_RX_HEADER_BYTE)
    gap = record.max_token_gap_ns if has_token_gap(events.output_events) else None
    return TokenProgress(events.output_events, events.heartbeats, last is not None, since,
                         record.first_token_ns, gap)

