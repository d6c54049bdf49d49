"""W3C Trace Context (traceparent, tracestate, traceresponse): pure functions.

Rules followed (W3C Trace Context, level 1 and level 2 for ``traceresponse``):
a ``traceparent`` is ``version-traceid-parentid-flags`` in lowercase hex; version
``ff`` is invalid; an all-zero trace id or parent id is invalid; version ``00`` has
exactly four fields, later versions may append fields after a ``-``. An invalid
value is not repaired: the receiver starts a new trace (and we keep the rejected
value for the span). ``tracestate`` is passed on unchanged, several headers joined
with commas.
"""

from __future__ import annotations

from typing import NamedTuple

from ..lifecycle.ids import new_request_id, new_span_id, new_trace_id

__all__ = ["parse_traceparent", "format_traceparent", "continue_or_start", "new_trace_id", "new_span_id",
           "new_request_id", "TraceParent", "TraceDecision"]

_HEX = frozenset(b"0123456789abcdef")


class TraceParent(NamedTuple):
    trace_id: int
    parent_span_id: int
    sampled: bool


def parse_traceparent(value: bytes) -> TraceParent | None:
    """The parsed header, or None when it is invalid and a new trace must start."""
    value = value.strip()
    if len(value) < 55 or value[2:3] != b"-" or value[35:36] != b"-" or value[52:53] != b"-":
        return None
    version, trace_id, span_id, flags = value[:2], value[3:35], value[36:52], value[53:55]
    if not _is_hex(version) or version == b"ff":
        return None
    if version == b"00" and len(value) != 55:
        return None
    if len(value) > 55 and value[55:56] != b"-":
        return None
    if not (_is_hex(trace_id) and _is_hex(span_id) and _is_hex(flags)):
        return None
    tid, sid = int(trace_id, 16), int(span_id, 16)
    if tid == 0 or sid == 0:
        return None
    return TraceParent(tid, sid, bool(int(flags, 16) & 1))


def _is_hex(part: bytes) -> bool:
    return _HEX.issuperset(part)


def format_traceparent(trace_id: int, span_id: int, sampled: bool) -> bytes:
    return b"00-%032x-%016x-%s" % (trace_id, span_id, b"01" if sampled else b"00")


class TraceDecision(NamedTuple):
    trace_id: int
    parent_span_id: int  # 0 when a new trace starts here
    sampled: bool
    rejected: bytes | None  # the invalid traceparent value(s), kept for the span


def continue_or_start(traceparents: list[bytes]) -> TraceDecision:
    """Continue exactly one valid incoming traceparent; otherwise start a new trace."""
    if len(traceparents) == 1:
        parsed = parse_traceparent(traceparents[0])
        if parsed is not None:
            return TraceDecision(parsed.trace_id, parsed.parent_span_id, parsed.sampled, None)
    rejected = b", ".join(traceparents) if traceparents else None
    return TraceDecision(new_trace_id(), 0, True, rejected)
