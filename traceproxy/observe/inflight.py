"""The live view of every in-flight request, oldest first, with its verdict now.

Read by ``GET /debug/inflight`` and ``traceproxy top``. Built from the records
the proxy keeps anyway; asking costs one pass over the in-flight requests and
nothing when nobody asks.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..lifecycle.marks import Mark
from ..lifecycle.stall import StallThresholds, judge
from ..lifecycle.timeline import RequestRecord


def _age(now: int, stamp: int | None) -> float | None:
    return None if stamp is None else round((now - stamp) / 1e9, 3)


def inflight_entry(record: RequestRecord, now: int, thresholds: StallThresholds) -> dict:
    judgement = judge(record, now, thresholds)
    attempt = record.attempt
    conn = attempt.connection if attempt is not None else None
    start = record.marks.get(Mark.FIRST_DOWNSTREAM_RX_BYTE, now)
    entry = {
        "trace_id": "%032x" % record.trace_id if record.trace_id else None,
        "request_id": record.request_id or None,
        "method": record.method or None,
        "path": record.target or None,
        "phase": judgement.verdict.phase.value if judgement else "done",
        "age_s": _age(now, start),
        "since_last_byte_s": {
            "from_client": _age(now, record.last_downstream_rx_ns or record.marks.get(Mark.LAST_DOWNSTREAM_RX_HEADER_BYTE)
                                or start),
            "from_upstream": _age(now, record.last_upstream_rx_ns),
            "to_client": _age(now, record.last_downstream_tx_ns),
        },
        "client_paused_s": _age(now, record.downstream_paused_since_ns),
        "bytes": {"request_in": record.downstream_rx_body_bytes, "response_in": record.upstream_rx_body_bytes,
                  "response_out": record.downstream_tx_body_bytes},
        "chunks": record.upstream_rx_chunks,
        "client_connection": record.connection.id,
        "client_request_sequence": record.sequence,
        "upstream_connection": conn.id if conn is not None else None,
        "upstream_reused": attempt.reused if conn is not None else None,
        "attempts": len(record.attempts),
        "verdict": None,
        "stalls": [{"outcome": e.code, "phase": e.phase, "resolved": e.resolved_ns is not None}
                   for e in record.stalls],
    }
    if judgement is not None:
        found = judgement.verdict
        entry["verdict"] = {
            "outcome": found.outcome.code,
            "name": found.outcome.name,
            "blame": found.outcome.blame.value,
            "waiting_for_s": round(judgement.waited_ns / 1e9, 3),
            "stall_after_s": getattr(thresholds, found.threshold) or None,
            "stalled": judgement.stalled,
        }
    return entry


def inflight_view(records: Iterable[RequestRecord], now: int, thresholds: StallThresholds) -> list[dict]:
    entries = [inflight_entry(r, now, thresholds) for r in records if not r.finished]
    entries.sort(key=lambda e: -(e["age_s"] or 0))
    return entries
