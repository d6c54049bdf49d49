"""The live join: where the engines have each request the proxy has in flight, by PD
component and SGLang stage, from the engines' spans or, without them, their gauges.

Theory of operation
-------------------
Beside the watchdog: asked when ``/debug/inflight`` is built, when a stall is reported
(its log line, its span) and when a finished request's summary is made (its access log
line); never on the request path, never waiting for anything. The rules are
``lifecycle.pd_stages``; this module only finds their inputs. For one request, in order:

1. **spans**: the stage of the request's trace, as the engines' spans left it
   (``stages.stage_of``: the span store itself in one process; in a worker of several,
   ``StageFacts``, what the service's parent sends);
2. **no span**: a request sent upstream ``settle`` ago or more, with no response yet,
   of which no engine has exported a span while engines do export spans here: no
   engine has opened it, the router has it (``pd_stages.not_opened``);
3. **gauges**: where the engines hold work, from the metrics URLs labelled by role
   (``EngineReadings.by_role``): the same words, for the engines as a whole
   (``pd_stages.from_gauges``).

Spans carry wall-clock times; the proxy's marks are monotonic. ``clock_offset_ns``
(wall minus monotonic, read once at start) puts both on the wall clock.

The same facts reach a stall's log line (``watchdog.StallLog``, which asks first and
leaves the answer for the stall span, so both say the same), its span and a finished
request's summary (its access log line and span) through the tracing observer, which
holds the join when it is on (``TracingObserver.stage_join``).

``StageFacts`` is a worker's copy of the stages of its own requests. The parent sends
the stages that changed (``stage_message``) after each batch of spans; the worker keeps
those of traces it has in flight (``claim``, refreshed once a second from its records)
plus, for a second, those it cannot place yet, so what it holds is bounded by its
requests in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..lifecycle.correlation import UPSTREAM_PHASES
from ..lifecycle.machine import Phase, phase_of
from ..lifecycle.marks import MARK
from ..lifecycle.pd_stages import EngineStage, Worker, from_gauges, not_opened
from ..lifecycle.timeline import RequestRecord
from .spandata import SpanData
from .spans import engine_stage_attributes

UNPLACED_KEEP_NS = 2_000_000_000  # a worker keeps a stage it cannot place yet this long
STALLS_REMEMBERED = 1024  # stall stages said in a log line and not yet taken by a stall span
_WAITING_FOR_HEAD = frozenset({Phase.SENDING_REQUEST_UPSTREAM, Phase.AWAITING_UPSTREAM_HEADERS})


class EngineStageJoin:
    """``stages``: the span store or a worker's ``StageFacts`` (None: no receiver);
    ``readings``: the ``EngineReadings`` with gauges by role (None: not scraped)."""

    def __init__(self, stages=None, readings=None, *, settle_s: float, clock_offset_ns: int) -> None:
        self.stages, self.readings = stages, readings
        self.settle_ns = int(settle_s * 1e9)
        self.clock_offset_ns = clock_offset_ns
        self._stalls: dict[tuple[int, int], dict | None] = {}

    def stage_of(self, record: RequestRecord, now_ns: int) -> EngineStage | None:
        """Where the engines have ``record`` now (monotonic ``now_ns``); None when nothing says."""
        phase = phase_of(record)
        if phase not in UPSTREAM_PHASES:
            return None
        found = self._from_spans(record, phase in _WAITING_FOR_HEAD, now_ns)
        if found is not None:
            return found
        readings = self.readings
        if readings is None or not readings.by_role:
            return None
        return from_gauges(readings.by_role, readings.router_running, phase is Phase.STREAMING_RESPONSE)

    def _from_spans(self, record: RequestRecord, waiting_for_head: bool, now_ns: int) -> EngineStage | None:
        """What the engines' spans say at monotonic ``now_ns``: the stage they have, else, for a
        request sent and waiting for its answer's head of which no engine has exported a span
        (while some engine does export them), not opened at the engines once ``settle_s`` has
        passed; None before."""
        stages = self.stages
        if stages is None or not record.trace_id:
            return None
        found = stages.stage_of(record.trace_id)
        if found is not None or not stages.seen_engine_spans or not waiting_for_head:
            return found
        sent = record.attempt.marks.get(MARK.FIRST_UPSTREAM_TX_BYTE) if record.attempt is not None else None
        if not sent or now_ns - sent < self.settle_ns:
            return None
        return not_opened(self.wall_ns(sent))

    def as_dict(self, record: RequestRecord, now_ns: int) -> dict | None:
        """The ``engine_stage`` of an in-flight entry."""
        found = self.stage_of(record, now_ns)
        return None if found is None else found.as_dict(self.wall_ns(now_ns))

    def wall_ns(self, monotonic_ns: int) -> int:
        return monotonic_ns + self.clock_offset_ns

    # -- stalls: the log line asks, the stall span says the same -----------------------------
    def stall_stage(self, record: RequestRecord, detected_ns: int) -> EngineStage | None:
        """Where the engines have a request that just stalled; kept for its stall span."""
        found = self.stage_of(record, detected_ns)
        if len(self._stalls) >= STALLS_REMEMBERED:
            self._stalls.pop(next(iter(self._stalls)))
        self._stalls[(record.trace_id, record.span_id)] = (
            None if found is None else found.as_dict(self.wall_ns(detected_ns)))
        return found

    def said_at_stall(self, trace_id: int, span_id: int) -> dict | None:
        return self._stalls.pop((trace_id, span_id), None)

    # -- a finished request ---------------------------------------------------------------
    def stage_at_end(self, record: RequestRecord) -> dict | None:
        """Where the engines had a finished request when it ended (its access log line and
        span say it); None when nothing says."""
        if self.stages is None:  # gauges only: no spans to say it, and this runs for every request
            return None
        attempt = record.attempt
        waiting_for_head = attempt is not None and MARK.FIRST_UPSTREAM_RX_BYTE not in attempt.marks
        found = self._from_spans(record, waiting_for_head, record.end_ns)
        return None if found is None else found.as_dict(self.wall_ns(record.end_ns))

    def placed_stall_span(self, span: SpanData) -> None:
        """A stall span gets the attributes of the stage its log line said."""
        stage = self.said_at_stall(span.trace_id, span.parent_span_id)
        if stage is not None:
            span.attributes.update(engine_stage_attributes(stage))


# ----------------------------------------------------------------------------------
# From the service's parent to each worker
# ----------------------------------------------------------------------------------
def stage_message(changes: dict[int, EngineStage | None], seen_engine_spans: bool) -> dict:
    """Plain data for the worker link: {"stages": [(trace id, stage tuple or None)], "seen": bool}."""
    stages = [(trace_id, None if stage is None else stage_tuple(stage)) for trace_id, stage in changes.items()]
    return {"stages": stages, "seen": seen_engine_spans}


def stage_tuple(stage: EngineStage) -> tuple:
    """An engine-span stage as plain data, for a pipe or the worker link."""
    worker = stage.worker or Worker()
    return (stage.component, stage.role, stage.stage or "", stage.state, stage.since_ns or 0, worker.service,
            worker.host, -1 if worker.pid is None else worker.pid, stage.detail, stage.worker is not None)


def stage_from_tuple(fields: tuple) -> EngineStage:
    component, role, stage, state, since, service, host, pid, detail, has_worker = fields
    worker = Worker(service, host, None if pid < 0 else pid) if has_worker else None
    return EngineStage(component, role, stage or None, state, since or None, worker, "spans", detail)


class StageFacts:
    """A worker's stages of its requests, as the service's parent sends them.

    Kept as they came (plain tuples) and made an ``EngineStage`` only when asked: most
    of the traces that change are not this process's, or are never asked about, and the
    engines change a few a second per request they serve."""

    def __init__(self, max_traces: int) -> None:
        self.max_traces = max_traces
        self.stages: dict[int, EngineStage | tuple] = {}
        self.unplaced: dict[int, int] = {}  # trace id -> when it came (monotonic), not claimed yet
        self.claimed: frozenset[int] = frozenset()
        self.seen_engine_spans = False

    def update(self, message: dict, now_ns: int) -> None:
        self.seen_engine_spans = self.seen_engine_spans or bool(message.get("seen"))
        for trace_id, fields in message.get("stages", ()):
            if fields is None:
                self.stages.pop(trace_id, None)
                continue
            if trace_id not in self.claimed:
                if len(self.unplaced) >= self.max_traces:
                    continue
                self.unplaced[trace_id] = now_ns
            self.stages[trace_id] = fields

    def stage_of(self, trace_id: int) -> EngineStage | None:
        found = self.stages.get(trace_id)
        if found is not None and not isinstance(found, EngineStage):
            found = self.stages[trace_id] = stage_from_tuple(found)
        return found

    def claim(self, trace_ids: Iterable[int], now_ns: int) -> None:
        """The traces this worker has in flight now: keep theirs, forget the rest."""
        self.claimed = frozenset(trace_ids)
        self.unplaced = {t: at for t, at in self.unplaced.items()
                         if t not in self.claimed and now_ns - at < UNPLACED_KEEP_NS}
        self.stages = {t: s for t, s in self.stages.items() if t in self.claimed or t in self.unplaced}


def in_flight_traces(records: Callable[[], Iterable[RequestRecord]]) -> Callable[[], frozenset[int]]:
    """The trace ids of the requests in flight, for ``claim``: one pass over the records."""
    return lambda: frozenset(r.trace_id for r in records() if r.trace_id)
