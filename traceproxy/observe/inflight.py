"""The live view of every in-flight request, oldest first, with its verdict now.

Read by ``GET /debug/inflight`` and ``traceproxy top``. Built from the records
the proxy keeps anyway; asking costs one pass over the in-flight requests and
nothing when nobody asks.

With the engine scraper on (``[engines] metrics_urls``), each entry also gets a
``correlation`` (the engines' side of its wait: ``ESL`` engine slow, ``LST`` lost
before the engine, or None) and the view gets ``engines`` (latest gauges per URL)
and a top-level ``correlation`` (engine vs proxy counts, the orphan state). Both
read the scraper's last values (in a worker of several, the readings the service's
scraper sent it); nothing here waits for an engine. The watchdog's verdicts are not
changed by any of this.

With engine spans received or gauges labelled by role (``engines.join``, the
``engine_join.EngineStageJoin``), each entry also gets ``engine_stage``: the PD
component, role and SGLang stage that hold the request, the worker, since when, and
whether spans or gauges say so; an engine-blamed stall verdict (FBS, MSS) names its
``component``. The view then gets ``engine_spans`` (the receiver's counts) and, under
``correlation.orphan``, ``engine_work``: the engine work no request in flight has, idle
for ``engines.orphan_after``, by worker and stage (the oldest ``UNEXPLAINED_SHOWN``;
``engine_work_total`` counts them all).

An event stream's entry also has ``tokens`` (``token_view.live_fields``): its output
events and heartbeats so far, the seconds since its last token (or, while none came,
since the response head), its time to first token and longest token gap. A request
with a conversation id (``tracing.conversation_id_header``) has ``conversation_id``.
Neither key is there otherwise.
"""

from __future__ import annotations

import time
from collections import Counter

from ..lifecycle.machine import in_flight_phase
from ..lifecycle.marks import Mark
from ..lifecycle.stall import StallThresholds, judge
from ..lifecycle.timeline import RequestRecord
from ..lifecycle.token_progress import token_progress
from .token_view import live_fields
from .watchdog import NAMES_COMPONENT


UNEXPLAINED_SHOWN = 20


def _age(now: int, stamp: int | None) -> float | None:
    return None if stamp is None else round((now - stamp) / 1e9, 3)


def inflight_entry(record: RequestRecord, now: int, thresholds: StallThresholds, engines=None,
                   prober=None) -> dict:
    judgement = judge(record, now, thresholds)
    attempt = record.attempt
    conn = attempt.connection if attempt is not None else None
    start = record.marks.get(Mark.FIRST_DOWNSTREAM_RX_BYTE, now)
    entry = {
        "trace_id": "%032x" % record.trace_id if record.trace_id else None,
        "request_id": record.request_id or None,
        "method": record.method or None,
        "path": record.target or None,
        # Without a verdict nobody owes it a byte yet: it waits its turn, or is done
        # (finishing in this very loop pass).
        "phase": judgement.verdict.phase.value if judgement else in_flight_phase(record),
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
        "correlation": None,
        "stalls": [{"outcome": e.code, "phase": e.phase, "resolved": e.resolved_ns is not None}
                   for e in record.stalls],
    }
    progress = token_progress(record)
    if progress is not None:  # an event stream: judged on its tokens
        entry["tokens"] = live_fields(progress, now, record.marks.get(Mark.FIRST_DOWNSTREAM_RX_BYTE))
    if record.conversation_id:
        entry["conversation_id"] = record.conversation_id
    join = getattr(engines, "join", None) if engines is not None else None
    if join is not None:
        entry["engine_stage"] = join.as_dict(record, now)
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
        if found.outcome in NAMES_COMPONENT and entry.get("engine_stage"):
            entry["verdict"]["component"] = entry["engine_stage"]["component"]
        if engines is not None:
            entry["correlation"] = _correlation(engines, found)
    if prober is not None:
        entry["probe"] = prober.result_for(record.id)
    return entry


def _correlation(engines, found) -> dict | None:
    outcome = engines.correlate(found.phase, found.since_ns)
    if outcome is None:
        return None
    return {"outcome": outcome.code, "name": outcome.name, "blame": outcome.blame.value,
            "engine_in_flight": engines.work}


def engines_view(engines, now: int, entries: list[dict], proxy_at_engines: int | None) -> dict:
    """The top-level ``engines`` and ``correlation`` keys, and ``engine_spans`` when spans are
    received; empty when the scraper is off. ``proxy_at_engines``: the service's requests at
    the engines as the entries were made."""
    if engines is None:
        return {}
    top = engines.top_level(proxy_at_engines)
    verdicts = [e["correlation"]["outcome"] for e in entries if e["correlation"]]
    top["requests"] = dict(sorted(Counter(verdicts).items()))
    view = {"engines": engines.snapshot(now), "correlation": top}
    receiver = getattr(engines, "receiver", None)
    if receiver is not None:
        view["engine_spans"] = receiver.numbers()
        in_flight = frozenset(int(e["trace_id"], 16) for e in entries if e.get("trace_id"))
        wall = time.time_ns()
        unexplained = engines.unexplained(in_flight, wall)
        top["orphan"]["engine_work_total"] = len(unexplained)
        top["orphan"]["engine_work"] = [{"trace_id": "%032x" % trace_id, **stage.as_dict(wall)}
                                        for trace_id, stage in unexplained[:UNEXPLAINED_SHOWN]]
    return view
