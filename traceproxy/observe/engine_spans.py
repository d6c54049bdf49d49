"""The engines' spans, kept per trace while they can explain a request: the store behind
the live join (``engine_join.py``); the receivers (``engine_receiver.py``) fill it.

Theory of operation
-------------------
``add`` takes the spans of one export request, as ``read_engine_request`` read them
(protobuf's C parser, then facts built in Python only for the spans the store reads).
Only SGLang's request spans are kept, and of them only what the join needs (``lifecycle.pd_stages``):

* a stage span (a name of SGLang's stage table): its parent is the worker's
  scheduler-thread span (``… [TP n] (host:… | pid:…)``), one per request on each worker,
  exported only when the request ends there; so the parent id groups a worker's stages
  while the thread span is still open. A nested stage (``decode_loop``, ...) hangs under
  its open forward stage and is put with the unfinished worker of its role;
* a thread span: that worker finished the request; it names the role (its thread
  label), the host and the pid.

Everything else (Bootstrap Room and Req spans, other services' spans) is relayed by
the receiver but not kept here.

Which worker: the resource's ``service.name``; the host and pid of its thread span once
that came; before, what earlier thread spans from the same exporter (its connection and
resource, per role) taught, when they all agree (a collector fanning in several workers
over one connection teaches nothing); else the resource's ``host.name`` and
``process.pid`` (``OTEL_RESOURCE_ATTRIBUTES`` sets them); else unknown.

Bounds: at most ``MAX_WORKERS_PER_TRACE`` workers per trace (each a few fields), at most
``max_traces`` traces. A trace past the engines (every worker finished, or ended its
last stage) is dropped ``GRACE_NS`` after its last span (later spans of the same request
still land in it). When a new trace finds the store full, the trace past the engines
updated longest ago goes first (nothing is lost: its request is done there); only when
every kept trace still has work at the engines does the one updated longest ago go, and
its spans count as dropped for lack of room (``spans_dropped``). So a flood of spans for
unknown traces holds at most ``max_traces`` traces, and work stuck at the engines (the
leak an engine orphan is) outlives any number of healthy requests. The stages of the
requests in flight are kept apart, by each proxy process (``engine_join.StageFacts``):
the store's evictions never take them from the live view.

Times: spans carry wall-clock nanoseconds, which the stages keep; the store's own
bookkeeping (grace, eviction order) uses the monotonic time passed in. No clock is read here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..lifecycle.pd_stages import (DECODE, NESTED_IN, PREFILL, STAGE_ORDER, STAGES, EngineStage, Worker,
                                   WorkerProgress, holding, role_of_stage, role_of_thread)
from .otlp_reader import (KEPT_RESOURCE_ATTRIBUTES, ResourceBatch, SpanFacts, check_ids, kept_attributes,
                          parse_export_request, span_facts)

GRACE_NS = 30_000_000_000
SWEEP_EVERY_NS = 1_000_000_000  # when full, finished traces are looked for at most this often
MAX_WORKERS_PER_TRACE = 8
_AMBIGUOUS = ("", None)
_THREAD_MARK = " (host:"


def is_thread_span(name: str, attributes) -> bool:
    """A scheduler-thread span, as SGLang names it: ``… [TP n] (host:… | pid:…)``, or with
    its ``thread_label`` attribute."""
    return _THREAD_MARK in name or "thread_label" in attributes


def pid_of(value) -> int | None:
    """A pid attribute's value when it is one (an int; a bool is not), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(slots=True)
class _WorkerSpans:
    role: str = ""
    ended: list[str] = field(default_factory=list)
    last_end_ns: int = 0
    finished: bool = False
    nested: str = ""
    exporter: str = ""
    service: str = ""
    host: str = ""
    pid: int | None = None
    identity: Worker | None = None  # the last Worker made for it: made again only when it changes


@dataclass(slots=True)
class _Trace:
    workers: dict[int, _WorkerSpans] = field(default_factory=dict)
    updated_ns: int = 0  # monotonic, when its last span came
    stage: EngineStage | None = None  # what the join reads; recomputed at each update
    spans: int = 0  # the spans it was built from


class StageRun(NamedTuple):
    """A worker's top-level stage spans of one request in one export request (same trace,
    same parent: its thread span), as ``read_engine_request`` gathers them: the store
    takes them at once rather than span by span."""

    trace_id: int
    parent_span_id: int
    names: tuple[str, ...]  # in the order they came
    end_ns: int  # the latest end


class EngineSpanStore:
    def __init__(self, max_traces: int) -> None:
        self.max_traces = max_traces
        self.traces: dict[int, _Trace] = {}  # insertion order: updated longest ago first
        self._past: dict[int, None] = {}  # the traces past the engines, updated longest ago first
        self.identities: dict[tuple[str, str], tuple[str, int | None]] = {}  # (exporter, role) -> host, pid
        self.changed: set[int] = set()  # traces whose stage changed since take_changes
        self.seen_engine_spans = False  # an engine has exported a stage span here
        self._swept_ns: int | None = None
        self.spans_received = 0
        self.spans_kept = 0
        self.spans_dropped = 0  # for lack of room: of traces evicted with work still at the engines
        self.traces_evicted = 0

    # -- taking spans ------------------------------------------------------------------
    def add(self, batches: list[ResourceBatch], exporter: str, now_ns: int) -> None:
        """``exporter``: who sent them (the receiver's peer), to learn workers by."""
        touched: dict[int, _Trace] = {}
        for batch in batches:
            self.spans_received += batch.received or len(batch.spans)
            resource = batch.resource
            source = f"{exporter}|{resource.get('service.name', '')}|{resource.get('service.instance.id', '')}"
            nested: dict[int, SpanFacts] = {}  # per trace, its last nested stage: all the others say
            for span in batch.spans:
                if type(span) is StageRun:
                    trace = self._stage_run(span, resource, source, now_ns)
                    if trace is not None:
                        touched[span.trace_id] = trace
                    continue
                name = span.name
                if name in NESTED_IN:
                    last = nested.get(span.trace_id)
                    if last is None or span.end_ns >= last.end_ns:
                        nested[span.trace_id] = span
                    continue
                if name in STAGES:
                    trace = self._stage_run(StageRun(span.trace_id, span.parent_span_id, (name,), span.end_ns),
                                            resource, source, now_ns)
                elif is_thread_span(name, span.attributes):
                    trace = self._thread(span, resource, source, now_ns)
                else:
                    continue
                if trace is not None:
                    touched[span.trace_id] = trace
            for span in nested.values():  # after the top-level stages, which name the workers' roles
                trace = self._nested_stage(span, resource, source, now_ns)
                if trace is not None:
                    touched[span.trace_id] = trace
        # Once per trace and request, not per span: a decode worker's batch is mostly one
        # request's decode_loop steps.
        for trace_id, trace in touched.items():
            if self.traces.get(trace_id) is trace:  # not evicted since, by a later trace of this request
                self._updated(trace_id, trace)

    def _stage_run(self, run: StageRun, resource: dict, source: str, now_ns: int) -> _Trace | None:
        """A worker's top-level stage spans of one request, in one batch (or one such span)."""
        trace = self._trace(run.trace_id, now_ns, spans=len(run.names))
        if trace is None:
            return None
        self.seen_engine_spans = True
        worker = self._worker(trace, run.parent_span_id, resource, source)
        if worker is None:
            return None
        for name in run.names:
            if name not in worker.ended:
                worker.ended.append(name)
            worker.role = worker.role or role_of_stage(name) or ""
        worker.last_end_ns = max(worker.last_end_ns, run.end_ns)
        return trace

    def _nested_stage(self, span: SpanFacts, resource: dict, source: str, now_ns: int) -> _Trace | None:
        trace = self._trace(span.trace_id, now_ns)
        if trace is None:
            return None
        self.seen_engine_spans = True
        worker = self._open_worker_of(trace, span.name, span.parent_span_id, resource, source)
        if worker is None:
            return None
        worker.nested = span.name
        worker.last_end_ns = max(worker.last_end_ns, span.end_ns)
        return trace

    def _thread(self, span: SpanFacts, resource: dict, source: str, now_ns: int) -> _Trace | None:
        trace = self._trace(span.trace_id, now_ns, create=False)
        if trace is None:  # the request's stages never reached us: nothing to explain
            return None
        worker = self._worker(trace, span.span_id, resource, source)
        if worker is None:
            return None
        attrs = span.attributes
        worker.finished = True
        worker.role = role_of_thread(str(attrs.get("thread_label") or span.name)) or worker.role
        worker.host = str(attrs.get("host_id") or worker.host)
        pid = pid_of(attrs.get("pid"))
        worker.pid = pid if pid is not None else worker.pid
        worker.last_end_ns = max(worker.last_end_ns, span.end_ns)
        self._learn(source, worker)
        return trace

    def _trace(self, trace_id: int, now_ns: int, create: bool = True, spans: int = 1) -> _Trace | None:
        trace = self.traces.pop(trace_id, None)  # popped and put back: the dict stays in update order
        if trace is None:
            if not create:
                return None
            self._make_room(now_ns)
            trace = _Trace()
        self.traces[trace_id] = trace
        trace.updated_ns = now_ns
        trace.spans += spans
        self.spans_kept += spans
        return trace

    def _make_room(self, now_ns: int) -> None:
        if len(self.traces) < self.max_traces:
            return
        if self._swept_ns is None or now_ns - self._swept_ns >= SWEEP_EVERY_NS:
            self.sweep(now_ns)
            if len(self.traces) < self.max_traces:
                return
        trace_id = next(iter(self._past)) if self._past else next(iter(self.traces))
        trace = self._drop(trace_id)
        self.traces_evicted += 1
        if trace_id not in self._past and (trace.stage is None or trace.stage.state != "ended"):
            self.spans_dropped += trace.spans

    def _drop(self, trace_id: int) -> _Trace:
        self._past.pop(trace_id, None)
        self.changed.discard(trace_id)
        return self.traces.pop(trace_id)

    def _worker(self, trace: _Trace, key: int, resource: dict, source: str) -> _WorkerSpans | None:
        worker = trace.workers.get(key)
        if worker is None:
            if len(trace.workers) >= MAX_WORKERS_PER_TRACE:
                return None
            worker = trace.workers[key] = _WorkerSpans(exporter=source, service=str(resource.get("service.name", "")))
            host, pid = resource.get("host.name"), resource.get("process.pid")
            worker.host = str(host) if host else ""
            worker.pid = pid_of(pid)
        return worker

    def _open_worker_of(self, trace: _Trace, nested: str, key: int, resource: dict,
                        source: str) -> _WorkerSpans | None:
        """The worker a nested stage belongs to: the latest (after a resend) unfinished one
        whose role has the stage it is nested in; else the latest finished one of that role.
        Hazard: a batch often holds a worker's last nested stages together with its thread
        span, which ``add`` reads first; a worker made here for them would be a second one,
        of no role, never finished: work at the engines that no request has."""
        parent_stage = NESTED_IN[nested]
        finished = None
        for worker in reversed(list(trace.workers.values())):
            if parent_stage in STAGE_ORDER.get(_role_guess(worker), ()):
                if not worker.finished:
                    return worker
                finished = finished or worker
        if finished is not None:
            return finished
        found = self._worker(trace, key, resource, source)
        if found is not None:
            found.role = found.role or role_of_stage(nested) or ""
        return found

    def _learn(self, source: str, worker: _WorkerSpans) -> None:
        """Thread spans from one exporter teach its host and pid, per role, while they agree."""
        if not worker.role or not worker.host:
            return
        key, seen = (source, worker.role), (worker.host, worker.pid)
        known = self.identities.get(key)
        if known is None and len(self.identities) < self.max_traces:
            self.identities[key] = seen
        elif known is not None and known != seen:
            self.identities[key] = _AMBIGUOUS

    def _updated(self, trace_id: int, trace: _Trace) -> None:
        stage = holding(self._progress(w) for w in trace.workers.values())
        self._past.pop(trace_id, None)
        if stage is not None and stage.state == "ended":
            self._past[trace_id] = None
        if stage != trace.stage:
            trace.stage = stage
            self.changed.add(trace_id)

    def _progress(self, worker: _WorkerSpans) -> WorkerProgress:
        host, pid = worker.host, worker.pid
        if not worker.finished and (not host or pid is None):
            learned_host, learned_pid = self.identities.get((worker.exporter, worker.role), _AMBIGUOUS)
            host, pid = host or learned_host, pid if pid is not None else learned_pid
        identity = worker.identity
        if identity is None or identity.host != host or identity.pid != pid:
            identity = worker.identity = Worker(worker.service, host, pid)
        return WorkerProgress(_role_guess(worker), tuple(worker.ended), worker.last_end_ns, worker.finished,
                              identity, worker.nested)

    # -- reading -----------------------------------------------------------------------
    def stage_of(self, trace_id: int) -> EngineStage | None:
        trace = self.traces.get(trace_id)
        return trace.stage if trace is not None else None

    def take_changes(self) -> dict[int, EngineStage | None]:
        """The stage of every trace that changed since the last call (None: dropped)."""
        changes = {trace_id: self.stage_of(trace_id) for trace_id in self.changed}
        self.changed.clear()
        return changes

    def open_traces(self) -> list[tuple[int, EngineStage]]:
        """Work at the engines: the traces with a worker that has not finished, updated
        longest ago first."""
        return [(trace_id, trace.stage) for trace_id, trace in self.traces.items()
                if trace.stage is not None and trace.stage.state == "in"]

    def sweep(self, now_ns: int) -> None:
        """Drop the traces past the engines whose last span came more than ``GRACE_NS`` ago."""
        self._swept_ns = now_ns
        for trace_id in list(self._past):  # updated longest ago first
            if now_ns - self.traces[trace_id].updated_ns <= GRACE_NS:
                break
            self._drop(trace_id)

    def numbers(self) -> dict:
        return {"traces": len(self.traces), "spans_received": self.spans_received, "spans_kept": self.spans_kept,
                "spans_dropped_no_room": self.spans_dropped, "traces_evicted": self.traces_evicted,
                "workers_known": sum(1 for known in self.identities.values() if known != _AMBIGUOUS)}


def _role_guess(worker: _WorkerSpans) -> str:
    """Its role; before a stage or thread span named it, what its stage names suggest."""
    if worker.role:
        return worker.role
    return DECODE if any(name.startswith("decode_") for name in worker.ended) else PREFILL


def read_engine_request(data: bytes) -> list[ResourceBatch]:
    """The spans of one export request that the store reads (``add``), per resource;
    raises ``MalformedOtlp``.

    As ``otlp_reader.read_export_request``, for less: building a span's
    facts in Python, not protobuf's C parse, is what reading a batch costs (about 2 us a
    span against 0.2), so they are built only for the spans ``add`` reads, and at most
    once per worker and request: a worker's top-level stage spans of one request (same
    trace, same parent) become one ``StageRun``; of its nested stages (``decode_loop``,
    ...; most of a decode worker's batch) only the last of each trace is read; a thread
    span's facts are built with the attributes ``_thread`` reads. The runs come first, then the
    thread spans, then the nested stages (a thread span ends after its stages). Every
    stage span's ids are still checked, so a body with a bad one is refused whichever
    span it is."""
    request = parse_export_request(data)
    batches = []
    for resource_spans in request.resource_spans:
        threads, received, runs, nested = [], 0, {}, {}
        for scope_spans in resource_spans.scope_spans:
            spans = scope_spans.spans
            received += len(spans)
            for span in spans:
                name = span.name
                kind = _SPAN_KIND.get(name)
                if kind is None:
                    if _THREAD_MARK in name:
                        threads.append(_thread_facts(span))
                    continue  # Bootstrap Room, Req and other services' spans: relayed, never read
                # Inline, not a call: this runs for nearly every span of a batch.
                trace_id, parent = span.trace_id, span.parent_span_id
                if len(trace_id) != 16 or len(span.span_id) != 8 or len(parent) != 8:
                    check_ids(span, trace_id, span.span_id, parent)  # raises, unless a root span
                end = span.end_time_unix_nano
                if kind is _NESTED:
                    last = nested.get(trace_id)
                    if last is None or end >= last[0]:
                        nested[trace_id] = (end, span)
                else:
                    run = runs.get((trace_id, parent))
                    if run is None:
                        runs[trace_id, parent] = [[name], end]
                    else:
                        run[0].append(name)
                        if end > run[1]:
                            run[1] = end
        kept: list = [StageRun(int.from_bytes(trace_id, "big"), int.from_bytes(parent, "big") if parent else 0,
                               tuple(names), end) for (trace_id, parent), (names, end) in runs.items()]
        kept += threads
        kept.extend(span_facts(span, {}, 0) for _, span in nested.values())
        batches.append(ResourceBatch(kept_attributes(resource_spans.resource.attributes, KEPT_RESOURCE_ATTRIBUTES),
                                     kept, received))
    return batches


_TOP, _NESTED = 1, 2
_SPAN_KIND = {**dict.fromkeys(STAGES, _TOP), **dict.fromkeys(NESTED_IN, _NESTED)}  # nested ones are stages too


_THREAD_ATTRIBUTES = frozenset({"thread_label", "host_id", "pid"})  # what _thread reads


def _thread_facts(span) -> SpanFacts:
    """A thread span's facts, with the attributes the store reads and without its status
    (``otlp_reader.read_export_request`` reads every kept attribute, and the status: a third more)."""
    return span_facts(span, kept_attributes(span.attributes, _THREAD_ATTRIBUTES), 0)
