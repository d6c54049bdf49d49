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

from .lifecycle.pd_stages import STAGES, EngineStage, role_of_stage, role_of_thread
from .observe.engine_spans import EngineSpanStore
from .observe.otlp_reader import ResourceBatch, SpanFacts

ENGINE_WHERE = "engine"  # the timeline's "where" of an engine stage, which does not cut the proxy's waits
_THREAD_MARK = " (host:"


def is_engine_span(span) -> bool:
    """A stage span or a scheduler-thread span, as SGLang names them."""
    return span.name in STAGES or _THREAD_MARK in span.name or "thread_label" in span.attributes


def engine_spans(spans: list, trace_id: str) -> list:
    return sorted((s for s in spans if s.trace_id == trace_id and is_engine_span(s)), key=lambda s: s.end_ns)


def where_it_was(spans: list) -> EngineStage | None:
    """Where the engines had the request as its spans (``diagnose.Span``) leave it."""
    store = EngineSpanStore(max_traces=1)
    by_service: dict[str, list[SpanFacts]] = {}
    for span in spans:
        try:
            facts = SpanFacts(int(span.trace_id, 16), int(span.span_id, 16),
                              int(span.parent_id, 16) if span.parent_id else 0, span.name, span.start_ns,
                              span.end_ns, span.attributes, 0)
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


def summary_lines(spans: list) -> list[str]:
    stage = where_it_was(spans)
    if stage is None:
        return []
    if stage.state == "ended":
        return [f"  engines: every worker finished; the last stage that ended: {stage.words()}"]
    return [f"  engines: when these spans were written the request was in {stage.words()}"]


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
