"""The tracing observer: one decision and one summary per finished request.

Two outputs: the spans (when tracing is on and the request is kept), built by the
exporter process from the summary sent to it, and the access log line (for every
request, when the access log is on), made here from the record and sent to the exporter
process to be written. A line costs the loop less to make than a summary costs to send
and restore (decision 0030); spans cost far more, and stay there.

Tail-biased sampling, decided when the request ends: a request that did not end
``OK`` (or got a 5xx) is always kept; a healthy one is kept when its trace id falls
under ``healthy_sample_ratio`` (the same test as OpenTelemetry's TraceIdRatioBased
sampler, so every service sampling by ratio agrees on a trace) and the client did
not ask for it not to be sampled. The span work itself happens in the exporter
process (see ``spans``); here we only copy the record into a tuple.

Shedding, tail-biased too, for two reasons (``SHED_REASONS``), both counted:

* ``rate``: healthy traces beyond ``healthy_max_per_second`` (a token bucket, bursts
  of up to one second's worth), for the whole service: with several workers they
  share one bucket (``SharedRateCeiling``). This is what bounds tracing's CPU: the
  exporter's work per trace is several times the proxy's own per request, so on a
  saturated machine an unbounded exporter takes the cores proxying needs even when
  niced. The default ceiling sits far above LLM request rates, where every trace is
  kept.
* ``backlog``: the exporter process is behind (its queue past the shedding mark,
  ``SpanExportPipe.backlogged``): a slow collector or a lower ceiling's worth of CPU
  missing.

Either way a healthy request's spans are shed before anything is copied. A request
that errored or stalled is never shed; it is dropped only when the queue is full.
So a flood costs the event loop almost nothing, and the traces that explain a
failure still get through. The access log line is not shed: with the access log
on, a shed request still sends its line.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import multiprocessing
import os
import time
from typing import Protocol

from ..lifecycle.flags import Flag
from ..lifecycle.ids import new_span_id
from ..lifecycle.timeline import RequestRecord
from .accesslog import access_line
from .spans import RequestSummary, stall_span, summarize

log = logging.getLogger("traceproxy.tracing")
_RATIO_BOUND = 1 << 64
_RATIO_MASK = _RATIO_BOUND - 1
_OK = Flag.OK
SHED_REASONS = ("rate", "backlog")


class SummarySink(Protocol):
    def submit(self, items) -> None: ...

    def submit_line(self, line: bytes) -> None: ...  # an access log line, without its newline

    def backlogged(self) -> bool: ...  # the exporter is behind: shed healthy spans


class TracingObserver:
    # The engine scraper (observe.engines), set by the composition root when it runs:
    # its ``summary`` ("running=1 queued=0 ...") goes on stall spans.
    engines = None
    # The live join (engine_join.EngineStageJoin), set by the composition root when it is
    # on: where the engines had each request goes on its summary and its stall spans.
    stage_join = None

    def __init__(self, sink: SummarySink, server: tuple[str, int], upstream: tuple[str, int],
                 healthy_sample_ratio: float, spans: bool = True, access_log: bool = False,
                 healthy_max_per_second: int = 0, healthy_ceiling: "RateCeiling | None" = None) -> None:
        self.sink = sink
        self.spans = spans  # tracing is on
        # GenAI attributes read the end of long request bodies too (see Fanout).
        self.request_body_tail_bytes = 4096 if spans else 0
        self.access_log = access_log  # every request's summary is wanted for its log line
        self.server = server
        self.upstream = upstream
        self.threshold = int(healthy_sample_ratio * _RATIO_BOUND)
        self.clock_offset_ns = time.time_ns() - time.monotonic_ns()
        self.sampled_out = 0
        self.shed = dict.fromkeys(SHED_REASONS, 0)  # healthy requests whose spans were shed, by reason
        # The service's shared ceiling when given (several workers), else this process's own.
        self.healthy_ceiling = healthy_ceiling or RateCeiling(healthy_max_per_second)

    def on_done(self, record: RequestRecord) -> None:
        keep = self.spans and self._keep_spans(record)
        if not keep and not self.access_log:
            return
        stage = self.stage_join.stage_at_end(record) if self.stage_join is not None else None
        if keep:
            summary: RequestSummary = summarize(record, self.clock_offset_ns, self.server, self.upstream,
                                                engine_stage=stage)
            self.sink.submit((summary,))
        if self.access_log:
            self.sink.submit_line(access_line(record, self.clock_offset_ns, stage))

    def _keep_spans(self, record: RequestRecord) -> bool:
        # The tests written out rather than a call each: this runs for every request.
        if record.outcome is not _OK or record.stalls or (record.status or 0) >= 500:
            return True  # errored or stalled: always kept
        if not (record.sampled and (record.trace_id & _RATIO_MASK) < self.threshold):
            self.sampled_out += 1
            return False
        if not self.healthy_ceiling.take(record.end_ns):
            self.shed["rate"] += 1
            return False
        if self.sink.backlogged():
            self.shed["backlog"] += 1
            return False
        return True

    # -- stall listener: the stall span goes out at once, not when the request ends
    def on_stall(self, record: RequestRecord, judgement, entry) -> None:
        if not self.spans:
            return
        engines = self.engines.summary if self.engines is not None else ""
        span = stall_span(record, entry.code, entry.phase, entry.since_ns, entry.detected_ns,
                          self.clock_offset_ns, new_span_id(), engines)
        if self.stage_join is not None:
            self.stage_join.placed_stall_span(span)
        self.sink.submit_now((span,))

    def on_stall_resolved(self, record: RequestRecord, entry) -> None:
        pass  # recorded on the request (entry.resolved_ns) and exported with its span


class RateCeiling:
    """At most ``per_second`` takes a second, in bursts of up to one second's worth;
    0 means no ceiling. The generic cell rate algorithm: a token bucket kept as one
    time, when the bucket is full again, so a refused take (the common case under a
    flood) is one comparison. Time is the caller's monotonic nanoseconds (a
    request's end mark), never a clock read here; a time earlier than the last one
    seen (ends are not stamped in exact order) only makes a take likelier refused."""

    def __init__(self, per_second: int) -> None:
        self.per_second = per_second
        self._interval_ns = 1_000_000_000 // per_second if per_second else 0
        self._burst_ns = (per_second - 1) * self._interval_ns if per_second else 0
        self._full_at_ns = -(1 << 62)  # long ago: the bucket starts full

    def take(self, now_ns: int) -> bool:
        if not self.per_second:
            return True
        full_at = self._full_at_ns
        if full_at - self._burst_ns > now_ns:
            return False
        self._full_at_ns = (full_at if full_at > now_ns else now_ns) + self._interval_ns
        return True


class SharedRateCeiling(RateCeiling):
    """``RateCeiling`` for every worker of a service at once: made in the parent before
    the workers are forked, its one time (when the bucket is full again) lives in
    shared memory and is moved under a lock shared by the workers.

    The hot path never waits: a take that the bucket would refuse is refused on one
    read, with no lock (an aligned 8-byte word is read whole); a take that would
    succeed tries the lock a few times (another worker holds it for well under a
    microsecond) and is refused if it still cannot have it, counted as shed by rate.
    So a worker that died holding the lock (the service stops then anyway) can only
    make takes fail, never hang a worker's loop. A take costs about 0.3 us."""

    LOCK_TRIES = 4

    @classmethod
    def for_service(cls, per_second: int, workers: int) -> RateCeiling:
        """The ceiling the workers about to be forked share; where a lock shared by
        processes cannot be made (no POSIX semaphores), each worker keeps its own
        ceiling with a 1/``workers`` share, so the service still stays under it."""
        if not per_second:
            return RateCeiling(0)
        try:
            return cls(per_second)
        except OSError as exc:
            log.warning("tracing.healthy_max_per_second = %d is split between the %d workers (%d each): a lock "
                        "they could share cannot be made here (%s)", per_second, workers,
                        max(1, per_second // workers), exc.strerror or exc)
            return RateCeiling(max(1, per_second // workers))

    def __init__(self, per_second: int) -> None:
        super().__init__(per_second)
        self._memory = mmap.mmap(-1, ctypes.sizeof(ctypes.c_int64))
        self._full_at = ctypes.c_int64.from_buffer(self._memory)
        self._full_at.value = -(1 << 62)  # long ago: the bucket starts full
        self._lock = multiprocessing.get_context("fork").Lock()

    def take(self, now_ns: int) -> bool:
        if not self.per_second:
            return True
        if self._full_at.value - self._burst_ns > now_ns:
            return False
        lock = self._lock
        for _ in range(self.LOCK_TRIES):
            if lock.acquire(False):
                break
        else:
            return False
        try:
            full_at = self._full_at.value
            if full_at - self._burst_ns > now_ns:
                return False
            self._full_at.value = (full_at if full_at > now_ns else now_ns) + self._interval_ns
            return True
        finally:
            lock.release()


def healthy_ratio_from_environment(configured: float | None, environ=os.environ) -> float:
    """The configured ratio, else the one OTEL_TRACES_SAMPLER implies, else 1."""
    if configured is not None:
        return configured
    sampler = environ.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if sampler in ("always_off", "parentbased_always_off"):
        return 0.0
    if sampler in ("traceidratio", "parentbased_traceidratio"):
        try:
            return min(max(float(environ.get("OTEL_TRACES_SAMPLER_ARG", "1")), 0.0), 1.0)
        except ValueError:
            return 1.0
    return 1.0
