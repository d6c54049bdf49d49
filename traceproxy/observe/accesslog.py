"""The access log: one JSON line per finished request, from its record.

Timings follow nginx's names where they exist (``upstream_connect_time``,
``upstream_header_time``, ``upstream_response_time``, ``request_time``), in
seconds; the outcome code and blame come from the one outcome table; the
keep-alive ledger says which connections carried the request and how idle they
were. Lines are buffered and written at most every ``FLUSH_S`` (or when the buffer
is large), never per request: the write is a system call we do not pay per request.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import TextIO

from ..lifecycle.marks import Mark
from ..lifecycle.timeline import RequestRecord

FLUSH_S = 0.5
FLUSH_BYTES = 64 * 1024


def _seconds(later: int | None, earlier: int | None) -> float | None:
    if later is None or earlier is None:
        return None
    return round((later - earlier) / 1e9, 6)


def access_entry(record: RequestRecord, clock_offset_ns: int) -> dict:
    marks = record.marks
    start = marks.get(Mark.FIRST_DOWNSTREAM_RX_BYTE, record.end_ns)
    attempt = record.attempt
    upstream = attempt.marks if attempt is not None else {}
    conn = attempt.connection if attempt is not None else None
    outcome = record.outcome
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime((start + clock_offset_ns) / 1e9)) + "Z",
        "request_id": record.request_id,
        "trace_id": "%032x" % record.trace_id if record.trace_id else None,
        "client": record.connection.peer,
        "method": record.method,
        "path": record.target,
        "protocol": f"HTTP/{record.http_version}",
        "status": record.status,
        "outcome": outcome.code,
        "blame": outcome.blame.value,
        "error": record.error,
        "request_bytes": record.downstream_rx_body_bytes,
        "response_bytes": record.downstream_tx_body_bytes,
        "chunks": record.upstream_rx_chunks,
        "chunk_max_gap": round(record.max_chunk_gap_ns / 1e9, 6),
        "upstream_connect_time": _seconds(upstream.get(Mark.POOL_ACQUIRED), marks.get(Mark.LAST_DOWNSTREAM_RX_HEADER_BYTE)),
        "upstream_header_time": _seconds(upstream.get(Mark.LAST_UPSTREAM_RX_HEADER_BYTE),
                                         upstream.get(Mark.FIRST_UPSTREAM_TX_BYTE)),
        "upstream_response_time": _seconds(upstream.get(Mark.LAST_UPSTREAM_RX_BYTE), upstream.get(Mark.FIRST_UPSTREAM_TX_BYTE)),
        "time_to_first_byte": _seconds(marks.get(Mark.FIRST_DOWNSTREAM_TX_BYTE), start),
        "time_to_first_chunk": _seconds(marks.get(Mark.FIRST_DOWNSTREAM_TX_BODY_BYTE), start),
        "request_time": _seconds(record.end_ns, start),
        "client_connection": record.connection.id,
        "client_request_sequence": record.sequence,
        "client_idle_gap": _seconds(record.idle_gap_ns, 0) if record.idle_gap_ns is not None else None,
        "upstream_connection": conn.id if conn is not None else None,
        "upstream_reused": attempt.reused if conn is not None else None,
        "upstream_idle_age": round(attempt.idle_age_ns / 1e9, 6) if conn is not None else None,
        "upstream_connection_request": attempt.connection_request_number if conn is not None else None,
        "attempts": len(record.attempts),
        "stalls": [{"outcome": e.code, "phase": e.phase, "waited": _seconds(e.detected_ns, e.since_ns),
                    "resolved_after": _seconds(e.resolved_ns, e.since_ns)} for e in record.stalls],
    }


class AccessLog:
    def __init__(self, path: str) -> None:
        self.path = path
        self._stream: TextIO | None = None
        self._lines: list[str] = []
        self._size = 0
        self._timer: asyncio.TimerHandle | None = None
        self.clock_offset_ns = time.time_ns() - time.monotonic_ns()
        self.write_errors = 0

    def open(self) -> None:
        if self.path == "-":
            self._stream = sys.stdout
        else:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._stream = open(self.path, "a", encoding="utf-8", buffering=1 << 16)

    def on_done(self, record: RequestRecord) -> None:
        line = json.dumps(access_entry(record, self.clock_offset_ns), separators=(",", ":"))
        self._lines.append(line)
        self._size += len(line)
        if self._size >= FLUSH_BYTES:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(FLUSH_S, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._lines or self._stream is None:
            return
        text = "\n".join(self._lines) + "\n"
        self._lines, self._size = [], 0
        try:
            self._stream.write(text)
            self._stream.flush()
        except OSError:
            self.write_errors += 1  # a full disk must not stop proxying

    def close(self) -> None:
        self.flush()
        if self._stream is not None and self._stream is not sys.stdout:
            self._stream.close()
