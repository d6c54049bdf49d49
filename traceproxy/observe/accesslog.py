"""The access log: one JSON line per finished request.

Made on the proxy's loop from the request's record as it ends, about 4 µs: less than
handing a summary of it to the exporter process and restoring it there (decision 0030). The exporter process
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
from ..lifecycle.marks import MARK
from ..lifecycle.timeline import RequestRecord
from ..lifecycle.token_progress import token_progress
from .line_file import LineFile
from .token_view import access_fields

log = logging.getLogger("traceproxy.access_log")

# The marks a line reads, looked up once: a line is made for every request.
_RX_START = MARK.FIRST_DOWNSTREAM_RX_BYTE
_RX_HEAD_END = MARK.LAST_DOWNSTREAM_RX_HEADER_BYTE
_TX_HEAD = MARK.FIRST_DOWNSTREAM_TX_BYTE
_TX_BODY = MARK.FIRST_DOWNSTREAM_TX_BODY_BYTE
_UP_ACQUIRED = MARK.POOL_ACQUIRED
_UP_TX_START = MARK.FIRST_UPSTREAM_TX_BYTE
_UP_HEAD_END = MARK.LAST_UPSTREAM_RX_HEADER_BYTE
_UP_RX_END = MARK.LAST_UPSTREAM_RX_BYTE


# What a line says of each outcome code, looked up once (an enum's .value is a property).
_OUTCOME_AND_BLAME = {code: (code, outcome.blame.value) for code, outcome in BY_CODE.items()}
_NO_MARKS: dict = {}


@lru_cache(maxsize=8)  # lines mostly fall within the same few seconds
def _utc_second(second: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))


def _seconds(later: int | None, earlier: int | None) -> float | None:
    """From one mark to a later one in seconds, to the microsecond (a half rounded up); None
    when either was not reached. Integer arithmetic: a line has a dozen of these, and
    ``round`` costs three times as much."""
    return (later - earlier + 500) // 1000 / 1e6 if later and earlier else None


def _duration(ns: int) -> float:
    return (ns + 500) // 1000 / 1e6


def access_entry(r: RequestRecord, clock_offset_ns: int) -> dict:
    """A finished request's line, read off its record as it ends (no summary is made for
    a request whose spans are not kept: most of them)."""
    marks = r.marks
    end = r.end_ns
    start = marks.get(_RX_START) or end
    attempt = r.attempts[-1] if r.attempts else None
    if attempt is not None:
        up = attempt.marks
        # From when this attempt asked for a connection: not the wait of a pipelined
        # request for its turn, nor an earlier attempt of a resent one.
        connect_from = attempt.started_ns or marks.get(_RX_HEAD_END)
        connected = attempt.connection is not None
    else:
        up, connect_from, connected = _NO_MARKS, marks.get(_RX_HEAD_END), False
    up_tx_start = up.get(_UP_TX_START)
    outcome, blame = _OUTCOME_AND_BLAME[r.outcome.code]
    second, ns = divmod(start + clock_offset_ns, 1_000_000_000)
    return {
        "time": f"{_utc_second(second)}.{ns // 1_000_000:03d}Z",
        "request_id": r.request_id or None,
        "trace_id": "%032x" % r.trace_id if r.trace_id else None,
        "client": r.connection.peer,
        "method": r.method or None,
        "path": r.target or None,
        "protocol": "HTTP/" + r.http_version,
        "status": r.status or None,
        "outcome": outcome,
        "blame": blame,
        "error": r.error or None,
        "request_bytes": r.downstream_rx_body_bytes,
        "response_bytes": r.downstream_tx_body_bytes,
        "chunks": r.upstream_rx_chunks,
        "chunk_max_gap": _duration(r.max_chunk_gap_ns),
        "upstream_connect_time": _seconds(up.get(_UP_ACQUIRED), connect_from),
        "upstream_header_time": _seconds(up.get(_UP_HEAD_END), up_tx_start),
        "upstream_response_time": _seconds(up.get(_UP_RX_END), up_tx_start),
        "time_to_first_byte": _seconds(marks.get(_TX_HEAD), start),
        "time_to_first_chunk": _seconds(marks.get(_TX_BODY), start),
        "request_time": _seconds(end, start),
        "client_connection": r.connection.id,
        "client_request_sequence": r.sequence,
        "client_idle_gap": None if r.idle_gap_ns is None else _duration(r.idle_gap_ns),
        "upstream_connection": attempt.connection.id if connected else None,
        "upstream_reused": attempt.reused if connected else None,
        "upstream_idle_age": _duration(attempt.idle_age_ns) if connected else None,
        "upstream_connection_request": attempt.connection_request_number if connected else None,
        "attempts": len(r.attempts),
        "stalls": [{"outcome": e.code, "phase": e.phase, "waited": _seconds(e.detected_ns, e.since_ns),
                    "resolved_after": _seconds(e.resolved_ns, e.since_ns)}
                   for e in r.stalls] if r.stalls else [],
    }


def access_line(record: RequestRecord, clock_offset_ns: int, engine_stage: dict | None = None) -> bytes:
    """The line in UTF-8, without its newline: kept as orjson writes it, never decoded.
    ``engine_stage``: where the engines had the request when it ended, when the join knows."""
    entry = access_entry(record, clock_offset_ns)
    if engine_stage:
        entry["engine_stage"] = engine_stage
    progress = token_progress(record)
    if progress is not None:  # an event stream, judged on its tokens
        entry["tokens"] = access_fields(progress, record.marks.get(_RX_START) or record.end_ns)
    if record.conversation_id:
        entry["conversation_id"] = record.conversation_id
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
