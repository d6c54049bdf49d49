"""An event stream's tokens as the views show them: /debug/inflight's ``tokens``, the
stall line's ``tokens:`` part and the stall span's attributes (``lifecycle.token_progress``
reads them off the record); the access log reads its ``tokens`` off the record itself,
for every finished stream (``accesslog.access_line``).

Only for event streams (the responses judged on their tokens); any other response
shows none of this and is judged on its bytes. Built when asked, never per read.
"""

from __future__ import annotations

from ..lifecycle.token_progress import TokenProgress
from . import semconv as sc


def _seconds(ns: int | None, digits: int = 3) -> float | None:
    return None if ns is None else round(ns / 1e9, digits)


def live_fields(progress: TokenProgress, now_ns: int, start_ns: int | None) -> dict:
    """A request in flight's ``tokens``: exactly one of ``since_last_token_s`` (a token
    came) and ``since_head_without_token_s`` (none yet: counted from the response head,
    as its first-byte wait is) is a number, the other null; ``max_token_gap_s`` is null
    until two output events came."""
    waited = None if progress.waiting_since_ns is None else now_ns - progress.waiting_since_ns
    first = progress.first_token_ns
    return {
        "output_events": progress.output_events,
        "heartbeats": progress.heartbeats,
        "since_last_token_s": _seconds(waited) if progress.token_came else None,
        "since_head_without_token_s": None if progress.token_came else _seconds(waited),
        "time_to_first_token_s": _seconds(first - start_ns) if first is not None and start_ns is not None else None,
        "max_token_gap_s": _seconds(progress.max_token_gap_ns),
    }


def _counted(n: int, noun: str) -> str:
    """``1 heartbeat``, ``14 heartbeats``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def stall_words(progress: TokenProgress, now_ns: int) -> str:
    """The stall line's ``tokens:`` part: ``3 output events, the last 2.1 s ago, 14 heartbeats``,
    or with none yet ``none, 2.1 s since the response head, 14 heartbeats``; singular for
    one (``1 output event``, ``1 heartbeat``)."""
    waited = "?" if progress.waiting_since_ns is None else f"{(now_ns - progress.waiting_since_ns) / 1e9:.1f}"
    if progress.token_came:
        said = f"{_counted(progress.output_events, 'output event')}, the last {waited} s ago"
    else:
        said = f"none, {waited} s since the response head"
    return f"{said}, {_counted(progress.heartbeats, 'heartbeat')}"


def stall_attributes(progress: TokenProgress, now_ns: int) -> dict:
    """The stall span's token attributes, as they stood when the stall was detected."""
    attrs = {sc.OUTPUT_EVENTS: progress.output_events, sc.HEARTBEATS: progress.heartbeats}
    if progress.waiting_since_ns is not None:
        waited = (now_ns - progress.waiting_since_ns) / 1e9
        attrs[sc.SINCE_LAST_TOKEN if progress.token_came else sc.SINCE_HEAD_WITHOUT_TOKEN] = waited
    return attrs
