"""``traceproxy diagnose``: the engines' own stage spans (SGLang ``--enable-trace``) of a
request, merged into its timeline, and where the engines had it when its spans were
written.

The stage spans of a request that hangs are not under the proxy's spans yet: each hangs
under its worker's scheduler-thread span, which is exported only when the request ends
there. So they are found by trace id and name (SGLang's stage table,
``lifecycle.pd_stages``), whatever their parent, and read as the live join reads them
(``observe.engine_spans``): grouped per worker, the worker named by its thread span
when that came, the stage it was in the one after the last that ended.
"""

from __future__ import annotations

from .lifecycle.pd_stages import (NESTED_IN, STAGE_ORDER, STAGES, EngineStage, Worker, role_of_stage, role_of_thread,
                                  stage_in)
from .observe import semconv as sc
from .observe.engine_spans import EngineSpanStore, is_thread_span, pid_of
from .observe.otlp_reader import ResourceBatch, SpanFacts

ENGINE_WHERE = "engine"  # the timeline's "where" of an engine stage's end


def is_engine_span(span) -> bool:
    """A stage span or a scheduler-thread span, as SGLang names them."""
    return span.name in STAGES or is_thread_span(span.name, span.attributes)


def time_order(ns: int | None) -> tuple[bool, int]:
    """A sort key for a span file's time, which can be unknown (None): after every known time."""
    return ns is None, ns or 0


def engine_spans(spans: list, trace_id: str) -> list:
    return sorted((s for s in spans if s.trace_id == trace_id and is_engine_span(s)),
                  key=lambda s: time_order(s.end_ns))


def where_it_was(spans: list) -> EngineStage | None:
    """Where the engines had the request as its spans (``diagnose.Span``) leave it."""
    store = EngineSpanStore(max_traces=1)
    by_service: dict[str, list[SpanFacts]] = {}
    for span in spans:
        try:
            # A time that is unknown is the store's 0, "none seen": a stage that ended at an
            # unknown time counts as ended, before any whose end is known.
            facts = SpanFacts(int(span.trace_id, 16), int(span.span_id, 16),
                              int(span.parent_id, 16) if span.parent_id else 0, span.name, span.start_ns or 0,
                              span.end_ns or 0, span.attributes, 0)
        except ValueError:  # an id that is not hex: not a span the engines wrote
            continue
        by_service.setdefault(span.service, []).append(facts)
    store.add([ResourceBatch({"service.name": service}, facts) for service, facts in by_service.items()],
              "diagnose", 0)
    return next((trace.stage for trace in store.traces.values()), None)


def timeline_entries(spans: list) -> list[tuple[int, str, str]]:
    """(time, what, where) for each stage span's end."""
    roles = _roles(spans)
    entries = []
    for span in spans:
        if span.name not in STAGES:
            continue
        role = roles.get(span.parent_id) or role_of_stage(span.name) or "?"
        entries.append((span.end_ns, f"{span.name} ended", f"{ENGINE_WHERE} {role}, {span.service or '-'}"))
    return entries


def summary_lines(spans: list, at_stall: dict | None = None,
                  at_end: tuple[str, EngineStage] | None = None) -> list[str]:
    """Where the engines had the request. ``at_stall``: the attributes of the stall span of
    the stall it ended in (or is still in), which say what the live join named then.
    ``at_end``: (outcome, stage) the proxy knew when the request ended (its access log line).

    A stage's span is exported only when the stage ends: a request that ended stalled in
    a stage whose span never came was not finished there, whatever the spans that did
    come say (a worker's thread span ends when it drops the request, not when its stage
    ends). The stall's words then stand, with the last stage the spans saw end. Without
    a stall, what the proxy knew at the end stands the same way; and from the spans
    alone, a worker that ended with error status, or before its last stage did, dropped
    the request: it did not finish it."""
    stage = where_it_was(spans)
    stalled_in = stage_at_stall(at_stall) if at_stall else None
    if (stalled_in is not None and not any(s.name == stalled_in.stage for s in spans)
            and (stage is None or stage.state == "ended")):
        line = (f"  engines: the request ended stalled in {stalled_in.words()}, as the proxy named it at the "
                f"stall; that stage's span never ended")
        if stage is not None and stage.state == "ended":
            line += f" (the last stage that ended: {stage.words()})"
        return [line]
    if at_end is not None and at_end[1].state == "in" and (stage is None or stage.state == "ended"):
        outcome, held = at_end
        line = f"  engines: when the request ended ({outcome}) the engines had it in {held.words()}"
        if stage is not None:
            line += f"; afterwards {_how_workers_ended(spans)}"
        return [line]
    if stage is None:
        return []
    if stage.state == "ended":
        return [f"  engines: {_how_workers_ended(spans)}; the last stage that ended: {stage.words()}"]
    return [f"  engines: when these spans were written the request was in {stage.words()}"]


def _threads(spans: list) -> list:
    return [s for s in spans if s.name not in STAGES]


def stages_dropped_in(spans: list) -> list[tuple[str, str]]:
    """(role, stage) for each worker whose thread span ended before its last stage did:
    the stage it had the request in when it dropped it, the one after the last that
    ended (its span is never exported). The worker may have been running that stage or
    still waiting to start it: the spans cannot tell, so the words never say it ran.

    A worker that ends a request with error status may end the forward stage it was in
    with it (the simulator ends an open stage that holds others so): such a stage span
    ending at the very moment its thread span does with error status was cut by the
    drop, not finished. A flat stage is only ever ended by its own end."""
    roles = _roles(spans)
    found = []
    for thread in _threads(spans):
        role = roles.get(thread.span_id)
        if role not in STAGE_ORDER:
            continue
        ended = [s.name for s in spans if s.parent_id == thread.span_id and s.name in STAGES
                 and not _cut_by_the_drop(s, thread)]
        current = stage_in(role, ended)
        if current is not None:
            found.append((role, current))
    return sorted(found, key=lambda found_in: list(STAGE_ORDER).index(found_in[0]))  # prefill, then decode


_HOLDS_OTHERS = frozenset(NESTED_IN.values())  # prefill_forward, decode_forward


def _cut_by_the_drop(stage, thread) -> bool:
    return (stage.name in _HOLDS_OTHERS and thread.status == "error" and stage.end_ns is not None
            and thread.end_ns is not None and stage.end_ns >= thread.end_ns)


def _how_workers_ended(spans: list) -> str:
    """``every worker ended (status error); dropped in: prefill_transfer_kv_cache (prefill)``;
    ``every worker finished`` when none dropped it (none ended with error status, or before
    its last stage did)."""
    threads = _threads(spans)
    errors = sum(s.status == "error" for s in threads)
    dropped = stages_dropped_in(spans)
    if not errors and not dropped:
        return "every worker finished"
    words = "every worker ended"
    if errors:
        words += " (status error)" if errors == len(threads) else f" ({errors} of {len(threads)} with status error)"
    if dropped:
        words += "; dropped in: " + ", ".join(f"{name} ({role})" for role, name in dropped)
    return words


def stage_from_dict(stage) -> EngineStage | None:
    """An ``engine_stage`` object (``EngineStage.as_dict``: an access log line's, an entry
    of ``/debug/inflight``), None when it is not of that shape."""
    if not isinstance(stage, dict) or not isinstance(stage.get("component"), str):
        return None
    worker = stage.get("worker") if isinstance(stage.get("worker"), dict) else None
    return EngineStage(stage["component"], str(stage.get("role") or ""), stage.get("stage") or None,
                       str(stage.get("state") or "in"), None,
                       Worker(str(worker.get("service") or ""), str(worker.get("host") or ""),
                              pid_of(worker.get("pid")))
                       if worker else None,
                       str(stage.get("source") or "-"), str(stage.get("detail") or ""))


def stage_at_stall(attributes: dict) -> EngineStage | None:
    """The stage a stall span names (what the live join said at the stall), when it names
    one the request was in, from spans; None otherwise (gauges speak for the engines as a
    whole, not for this request)."""
    if (attributes.get(sc.ENGINE_SOURCE) != "spans" or attributes.get(sc.ENGINE_STAGE_STATE, "in") != "in"
            or not attributes.get(sc.ENGINE_STAGE)):
        return None
    return stage_from_attributes(attributes)


def stage_from_attributes(attributes: dict) -> EngineStage | None:
    """The engine stage a span's ``traceproxy.engine.*`` attributes name; None without one."""
    if not attributes.get(sc.ENGINE_COMPONENT):
        return None
    worker = Worker(str(attributes.get(sc.ENGINE_WORKER_SERVICE) or ""), str(attributes.get(sc.ENGINE_WORKER_HOST)
                                                                           or ""),
                    pid_of(attributes.get(sc.ENGINE_WORKER_PID)))
    return EngineStage(str(attributes[sc.ENGINE_COMPONENT]), str(attributes.get(sc.ENGINE_ROLE) or ""),
                       str(attributes.get(sc.ENGINE_STAGE) or "") or None,
                       str(attributes.get(sc.ENGINE_STAGE_STATE) or "in"), None,
                       worker if worker.service or worker.host or worker.pid is not None else None,
                       str(attributes.get(sc.ENGINE_SOURCE) or "-"), str(attributes.get(sc.ENGINE_DETAIL) or ""))


def _roles(spans: list) -> dict[str, str]:
    """The role of each worker (its thread span's id): from the thread span, else its stages."""
    roles: dict[str, str] = {}
    for span in spans:
        if span.name in STAGES and role_of_stage(span.name) and span.parent_id:
            roles.setdefault(span.parent_id, role_of_stage(span.name))
    for span in spans:
        role = role_of_thread(str(span.attributes.get("thread_label") or ""))
        if role:
            roles[span.span_id] = role
    return roles
