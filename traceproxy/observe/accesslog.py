"""The access log: one JSON line per finished request.

Made on the proxy's loop from the request summary the spans are built from
(``spans.summarize``), as the request ends: about 4 µs, less than handing the summary to
the exporter process and restoring it there (decision 0030). The exporter process
appends the lines (``AccessLogWriter``), so a slow disk or a full pipe on stdout never
blocks the loop.
With engine spans received, a line also says where the engines had the request when it
ended (``engine_stage``: component, role, SGLang stage, worker, since when, from what).
An event stream's line has ``tokens``: its output events, heartbeats, time to first
token (null when none came) and longest wait between two tokens; a request with a
conversation id (``tracing.conversation_id_header``) has ``conversation_id``.
Timings follow nginx's names where they exist (``upstream_connect_time``,
``upstream_header_time``, ``upstream_response_time``, ``request_time``), in seconds;
the outcome code and blame come from the one outcome table; the keep-alive ledger
says which connections carried the request and how idle they were.

Hazards:
- A line is lost when the queue to the exporter process is full (the proxy never
  waits for it), counted in ``traceproxy_access_log_lines_lost_total`` with the lines
  that could not be written.
- A batch of lines that cannot be written (a full disk) is lost: counted in
  ``lines_lost``, which reaches ``traceproxy_access_log_lines_lost_total`` through
  the exporter's stats, and logged once when writing starts failing and once when
  it works again. The log keeps whole lines (``line_file.py``).
"""

from __future__ import annotations

import logging
import time
from functools import lru_cache

import orjson

from ..lifecycle.flags import BY_CODE
from ..lifecycle.marks import Mark
from .line_file import LineFile
from .spans import DOWNSTREAM_INDEX, UPSTREAM_INDEX, UPSTREAM_ORDER, RequestSummary
from .token_view import access_fields

log = logging.getLogger("traceproxy.access_log")

# Where the marks a line reads sit in a summary's mark tuples, looked up once:
# a line is written for every request.
_RX_START = DOWNSTREAM_INDEX[Mark.FIRST_DOWNSTREAM_RX_BYTE]
_RX_HEAD_END = DOWNSTREAM_INDEX[Mark.LAST_DOWNSTREAM_RX_HEADER_BYTE]
_TX_HEAD = DOWNSTREAM_INDEX[Mark.FIRST_DOWNSTREAM_TX_BYTE]
_TX_BODY = DOWNSTREAM_INDEX[Mark.FIRST_DOWNSTREAM_TX_BODY_BYTE]
_UP_ACQUIRED = UPSTREAM_INDEX[Mark.POOL_ACQUIRED]
_UP_TX_START = UPSTREAM_INDEX[Mark.FIRST_UPSTREAM_TX_BYTE]
_UP_HEAD_END = UPSTREAM_INDEX[Mark.LAST_UPSTREAM_RX_HEADER_BYTE]
_UP_RX_END = UPSTREAM_INDEX[Mark.LAST_UPSTREAM_RX_BYTE]


# What a line says of each outcome code, looked up once (an enum's .value is a property).
_OUTCOME_AND_BLAME = {code: (code, outcome.blame.value) for code, outcome in BY_CODE.items()}
_NO_UPSTREAM_MARKS = (0,) * len(UPSTREAM_ORDER)


@lru_cache(maxsize=8)  # a batch of lines mostly falls within the same few seconds
def _utc_second(second: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))


def _seconds(later: int, earlier: int) -> float | None:
    """From one mark to a later one in seconds, to the microsecond (a half rounded up); None
    when either was not reached (marks are 0 then). Integer arithmetic: a line has a
    dozen of these, and ``round`` costs three times as much."""
    return (later - earlier + 500) // 1000 / 1e6 if later and earlier else None


def _duration(ns: int) -> float:
    return (ns + 500) // 1000 / 1e6


def access_entry(s: RequestSummary) -> dict:
    marks = s.marks
    start = marks[_RX_START] or s.end_ns
    attempt = s.attempts[-1] if s.attempts else None
    if attempt is not None:
        up = attempt.marks
        # From when this attempt asked for a connection: not the wait of a pipelined
        # request for its turn, nor an earlier attempt of a resent one.
        connect_from = attempt.started_ns or marks[_RX_HEAD_END]
        connected = attempt.connection_id != 0
    else:
        up, connect_from, connected = _NO_UPSTREAM_MARKS, marks[_RX_HEAD_END], False
    up_tx_start = up[_UP_TX_START]
    outcome, blame = _OUTCOME_AND_BLAME[s.outcome]
    second, ns = divmod(start + s.clock_offset_ns, 1_000_000_000)
    return {
        "time": f"{_utc_second(second)}.{ns // 1_000_000:03d}Z",
        "request_id": s.request_id or None,
        "trace_id": "%032x" % s.trace_id if s.trace_id else None,
        "client": s.client_peer,
        "method": s.method or None,
        "path": s.target or None,
        "protocol": "HTTP/" + s.http_version,
        "status": s.status or None,
        "outcome": outcome,
        "blame": blame,
        "error": s.error or None,
        "request_bytes": s.request_body_bytes,
        "response_bytes": s.response_body_bytes,
        "chunks": s.chunks,
        "chunk_max_gap": _duration(s.max_chunk_gap_ns),
        "upstream_connect_time": _seconds(up[_UP_ACQUIRED], connect_from),
        "upstream_header_time": _seconds(up[_UP_HEAD_END], up_tx_start),
        "upstream_response_time": _seconds(up[_UP_RX_END], up_tx_start),
        "time_to_first_byte": _seconds(marks[_TX_HEAD], start),
        "time_to_first_chunk": _seconds(marks[_TX_BODY], start),
        "request_time": _seconds(s.end_ns, start),
        "client_connection": s.client_connection_id,
        "client_request_sequence": s.sequence,
        "client_idle_gap": _duration(s.idle_gap_ns) if s.idle_gap_ns >= 0 else None,
        "upstream_connection": attempt.connection_id if connected else None,
        "upstream_reused": attempt.reused if connected else None,
        "upstream_idle_age": _duration(attempt.idle_age_ns) if connected else None,
        "upstream_connection_request": attempt.connection_request_number if connected else None,
        "attempts": len(s.attempts),
        "stalls": [{"outcome": code, "phase": phase, "waited": _seconds(detected, since),
                    "resolved_after": _seconds(resolved, since)}
                   for code, phase, since, detected, resolved in s.stalls] if s.stalls else [],
    }


def access_line(summary: RequestSummary) -> bytes:
    """The line in UTF-8, without its newline: kept as orjson writes it, never decoded."""
    entry = access_entry(summary)
    if summary.engine_stage:  # engine spans or gauges by role are on, and they placed it
        entry["engine_stage"] = summary.engine_stage
    if summary.tokens:  # an event stream, judged on its tokens
        entry["tokens"] = access_fields(summary.tokens, summary.marks[_RX_START] or summary.end_ns)
    if summary.conversation_id:
        entry["conversation_id"] = summary.conversation_id
    return orjson.dumps(entry)


class AccessLogWriter:
    """Appends the lines the proxy made, one write per batch (in the exporter process)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lines = LineFile.stdout() if path == "-" else LineFile(path)
        self.lines_lost = 0
        self._lost_since_failing: int | None = None  # None while writing works

    def write_lines(self, lines: bytes, count: int) -> None:
        """``count`` whole lines, each ended by its newline, in one write."""
        try:
            self._lines.append(lines)
        except OSError as exc:  # a full disk must not end the exporter
            self._lost(count, exc)
            return
        if self._lost_since_failing is not None:
            log.warning("access log %s: writing works again; %d lines were lost", self._lines.path,
                        self._lost_since_failing)
            self._lost_since_failing = None

    def _lost(self, count: int, exc: OSError) -> None:
        self.lines_lost += count
        if self._lost_since_failing is None:
            log.warning("access log %s: cannot write (%s); its lines are lost until it can, counted in "
                        "traceproxy_access_log_lines_lost_total", self._lines.path, exc.strerror or exc)
            self._lost_since_failing = 0
        self._lost_since_failing += count

    def close(self) -> None:
        self._lines.close()
