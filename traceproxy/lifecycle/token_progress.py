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
other response has no progress here (None) and keeps byte judgement.
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
    max_token_gap_ns: int  # the longest wait between two events with output


def token_progress(record: RequestRecord) -> TokenProgress | None:
    """What the record's event stream brought so far; None when it is not one."""
    events = record.stream_events
    if events is None:
        return None
    last = record.last_token_ns
    since = last if last is not None else record.when(Mark.LAST_UPSTREAM_RX_HEADER_BYTE)
    return TokenProgress(events.output_events, events.heartbeats, last is not None, since,
                         record.first_token_ns, record.max_token_gap_ns)

