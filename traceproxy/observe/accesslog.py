"""The access log: one JSON line per finished request.

Made on the proxy's loop from the request's record as it ends: about 4 µs in a loop of
lines alone, about three times that in place between requests (docs/performance.md,
"Fourth round"), and still less than handing a summary of it to the exporter process
and restoring it there (decision 0030). The exporter process
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
from ..lifecycle.timeline import RequestRecord, StallEntry
from ..lifecycle.token_progress import has_token_gap
from .line_file import LineFile

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


# The last line's millisecond and its time text, replaced whole: where a line's cost
# matters, several requests begin within one millisecond (11 % of a line's cost, in place).
_last_millisecond: tuple[int | None, str] = (None, "")


def _time_text(millisecond: int) -> str:
    """``2026-12-02T03:20:31.275Z`` for a wall-clock time in milliseconds."""
    global _last_millisecond
    last, text = _last_millisecond
    if millisecond != last:
        second, rest = divmod(millisecond, 1000)
        text = f"{_utc_second(second)}.{rest:03d}Z"
        _last_millisecond = (millisecond, text)
    return text


def access_line(r: RequestRecord, clock_offset_ns: int, engine_stage: dict | None = None) -> bytes:
    """A finished request's line in UTF-8, without its newline, read off its record as it
    ends (no summary is made for a request whose spans are not kept: most of them); kept
    as orjson writes it, never decoded. ``engine_stage``: where the engines had the
    request when it ended, when the join knows.

    One function with its arithmetic written out, not a helper per timing: it runs for
    every request, between the request path's own work, where each call and each
    intermediate number costs several times what it does in a loop of lines alone
    (docs/performance.md, "Fourth round"). A timing is from one mark to a later one in
    seconds, to the microsecond (a half rounded up), null when either was not reached:
    integer arithmetic, as ``round`` costs three times as much."""
    get = r.marks.get
    end = r.end_ns
    start = get(_RX_START) or end
    attempts = r.attempts
    if attempts:
        attempt = attempts[-1]
        up = attempt.marks.get
        # From when this attempt asked for a connection: not the wait of a pipelined
        # request for its turn, nor an earlier attempt of a resent one.
        connect_from = attempt.started_ns or get(_RX_HEAD_END)
        upstream = attempt.connection
    else:
        attempt, up, connect_from, upstream = None, _NO_MARKS.get, get(_RX_HEAD_END), None
    acquired, up_tx_start, up_head_end, up_rx_end = up(_UP_ACQUIRED), up(_UP_TX_START), up(_UP_HEAD_END), up(_UP_RX_END)
    tx_head, tx_body = get(_TX_HEAD), get(_TX_BODY)
    outcome, blame = _OUTCOME_AND_BLAME[r.outcome.code]
    idle_gap = r.idle_gap_ns
    client = r.connection
    entry = {
        "time": _time_text((start + clock_offset_ns) // 1_000_000),
        "request_id": r.request_id or None,
        "trace_id": "%032x" % r.trace_id if r.trace_id else None,
        "client": client.peer,
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
        "chunk_max_gap": (r.max_chunk_gap_ns + 500) // 1000 / 1e6,
        "upstream_connect_time":
            (acquired - connect_from + 500) // 1000 / 1e6 if acquired and connect_from else None,
        "upstream_header_time": (up_head_end - up_tx_start + 500) // 1000 / 1e6 if up_head_end and up_tx_start else None,
        "upstream_response_time": (up_rx_end - up_tx_start + 500) // 1000 / 1e6 if up_rx_end and up_tx_start else None,
        "time_to_first_byte": (tx_head - start + 500) // 1000 / 1e6 if tx_head and start else None,
        "time_to_first_chunk": (tx_body - start + 500) // 1000 / 1e6 if tx_body and start else None,
        "request_time": (end - start + 500) // 1000 / 1e6 if end and start else None,
        "client_connection": client.id,
        "client_request_sequence": r.sequence,
        "client_idle_gap": None if idle_gap is None else (idle_gap + 500) // 1000 / 1e6,
        "upstream_connection": upstream.id if upstream is not None else None,
        "upstream_reused": attempt.reused if upstream is not None else None,
        "upstream_idle_age": (attempt.idle_age_ns + 500) // 1000 / 1e6 if upstream is not None else None,
        "upstream_connection_request": attempt.connection_request_number if upstream is not None else None,
        "attempts": len(attempts),
        "stalls": [_stall(entry) for entry in r.stalls] if r.stalls else [],
    }
    if engine_stage:
        entry["engine_stage"] = engine_stage
    events = r.stream_events
    if events is not None:  # an event stream, judged on its tokens: read off the record as the rest
        first, output_events = r.first_token_ns, events.output_events
        entry["tokens"] = {
            "output_events": output_events,
            "heartbeats": events.heartbeats,
            "time_to_first_token": (first - start + 500) // 1000 / 1e6 if first and start else None,
            # null until two output events came: a 0 would read as tokens back to back
            "max_token_gap": (r.max_token_gap_ns + 500) // 1000 / 1e6 if has_token_gap(output_events) else None,
        }
    if r.conversation_id:
        entry["conversation_id"] = r.conversation_id
    return orjson.dumps(entry)


def _seconds(later: int | None, earlier: int | None) -> float | None:
    return (later - earlier + 500) // 1000 / 1e6 if later and earlier else None


def _stall(entry: StallEntry) -> dict:
    return {"outcome": entry.code, "phase": entry.phase, "waited": _seconds(entry.detected_ns, entry.since_ns),
            "resolved_after": _seconds(entry.resolved_ns, entry.since_ns)}


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
