"""The watchdog: finds stalled requests while they are stalled, on its own timer.

Theory of operation
-------------------
One timer, aimed at the earliest stall deadline over all in-flight requests
(``lifecycle.stall.judge_all``). A new request can bring a deadline earlier than
the one aimed at, so ``on_request_start`` pulls the timer in to ``now + the
smallest threshold`` when needed: the watchdog fires for a lone stuck request on
an idle proxy, and for a request whose marks never moved. A request's deadline
also moves earlier when its wait changes kind (first byte, then a stream gap with
a shorter threshold; a resend that connects anew), which nothing reports here: so
while requests are in flight the timer is never aimed further out than a quarter
of the smallest threshold, which bounds how late such a stall is found. While
stalls are open it also wakes every ``RECHECK_S`` to notice the ones that resolve
by themselves.

On a new stall: the record gets a ``StallEntry``, ``on_stall`` goes to every stall
listener (log line, metric, stall span), and with the abort action the request is
ended through its owner (``lifecycle.timeline.RequestOwner``), which ends it its own way. A stall resolves when the verdict moves on (the awaited
byte came, or the request finished): the entry gets ``resolved_ns`` and listeners
get ``on_stall_resolved``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from ..lifecycle.flags import Blame, Flag
from ..lifecycle.marks import MARK
from ..lifecycle.attribution import client_still_silent
from ..lifecycle.ids import new_request_id, new_span_id, new_trace_id
from ..lifecycle.stall import Judgement, StallThresholds, judge, judge_all
from ..lifecycle.timeline import RequestRecord, StallEntry
from ..lifecycle.token_progress import token_progress
from .token_view import stall_words

log = logging.getLogger("traceproxy.watchdog")
# The stall verdicts that blame the engine side: with the join on, their line names the component.
NAMES_COMPONENT = (Flag.FBS, Flag.MSS)
RECHECK_S = 0.25
TICK_FLOOR_NS = 50_000_000


class StallListener(Protocol):
    def on_stall(self, record: RequestRecord, judgement: Judgement, entry: StallEntry) -> None: ...

    def on_stall_resolved(self, record: RequestRecord, entry: StallEntry) -> None: ...


class Watchdog:
    def __init__(self, in_flight: Callable[[], Iterable[RequestRecord]], thresholds: StallThresholds,
                 abort_kinds: frozenset[str] = frozenset()) -> None:
        self.in_flight = in_flight
        self.thresholds = thresholds
        self.abort_kinds = abort_kinds
        self.listeners: list[StallListener] = []
        self.open: dict[int, tuple[RequestRecord, StallEntry]] = {}
        self.listener_errors = 0
        self.wakeups = 0
        self._timer: asyncio.TimerHandle | None = None
        self._due_ns: int | None = None
        active = [getattr(thresholds, key) for key in ("client_headers", "client_body", "pool_wait", "first_byte",
                                                       "stream_gap", "client_drain")]
        self._min_threshold_ns = int(min((t for t in active if t), default=0) * 1e9)

    # -- lifecycle observer hooks ------------------------------------------------
    def on_request_start(self, record: RequestRecord) -> None:
        # Runs for every request: due from the request's first mark, so that the
        # usual answer (a check is already due sooner) needs no clock read.
        if self._min_threshold_ns:
            self._aim(record.marks[MARK.FIRST_DOWNSTREAM_RX_BYTE] + self._min_threshold_ns)

    def on_done(self, record: RequestRecord) -> None:
        opened = self.open.pop(record.id, None)
        if opened is not None:
            self._resolve(record, opened[1], record.end_ns, finished=True)

    # -- the timer -----------------------------------------------------------------
    def start(self) -> None:
        self._wake()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _aim(self, due_ns: int) -> None:
        if self._due_ns is not None and self._due_ns <= due_ns:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._due_ns = due_ns
        delay = max(due_ns - time.monotonic_ns(), 0) / 1e9
        self._timer = asyncio.get_running_loop().call_later(delay, self._wake)

    def _wake(self) -> None:
        self._timer, self._due_ns = None, None
        self.wakeups += 1
        now = time.monotonic_ns()
        self._check_open(now)
        stalled, earliest = judge_all(self.in_flight(), now, self.thresholds)
        for judgement in stalled:
            if judgement.record.id not in self.open:
                self._report(judgement, now)
        if self.open:
            earliest = min(earliest or now + int(RECHECK_S * 1e9), now + int(RECHECK_S * 1e9))
        if self._min_threshold_ns and len(self.in_flight()):
            tick = now + max(self._min_threshold_ns // 4, TICK_FLOOR_NS)
            earliest = tick if earliest is None else min(earliest, tick)
        if earliest is not None:
            self._aim(earliest)

    # -- stalls --------------------------------------------------------------------
    def _report(self, judgement: Judgement, now: int) -> None:
        record, found = judgement.record, judgement.verdict
        if not record.trace_id:
            # Stalled before its head was complete: give it ids now, so the log
            # line and the stall span can be found.
            record.trace_id, record.span_id = new_trace_id(), new_span_id()
            record.request_id = record.request_id or new_request_id()
        # An upstream-side stall belongs to the attempt it was judged on (a resend ends
        # it unresolved); the client's own silence outlives a resend (-1: no attempt).
        attempt = -1 if found.outcome.blame is Blame.CLIENT else len(record.attempts) - 1
        entry = StallEntry(found.outcome.code, found.phase.value, found.since_ns, now, attempt=attempt)
        record.stalls.append(entry)
        self.open[record.id] = (record, entry)
        for listener in self.listeners:
            try:
                listener.on_stall(record, judgement, entry)
            except Exception:
                self.listener_errors += 1
                log.exception("stall listener %s raised", type(listener).__name__)
        if found.threshold in self.abort_kinds and record.owner is not None:
            waited = judgement.waited_ns / 1e9
            record.owner.abort(found.outcome, f"stalled {waited:.1f} s {found.phase.value.replace('_', ' ')} "
                                              f"(blame {found.outcome.blame.value}); aborted by the watchdog")

    def _check_open(self, now: int) -> None:
        for record_id, (record, entry) in list(self.open.items()):
            current = judge(record, now, self.thresholds)
            same = (current is not None and current.verdict.outcome.code == entry.code
                    and current.verdict.since_ns == entry.since_ns)
            if not same and not self._resend_connecting_behind_the_client(record, entry, current):
                del self.open[record_id]
                resolved_at = current.verdict.since_ns if current is not None else now
                self._resolve(record, entry, max(resolved_at, entry.since_ns), finished=False)

    @staticmethod
    def _resend_connecting_behind_the_client(record: RequestRecord, entry: StallEntry,
                                             current: Judgement | None) -> bool:
        """A stale connection's resend reads as a connect (or a wait at the pool cap)
        until its new connection comes: while that is not a stall of its own, it does
        not end the client's body stall (which would then be reported twice). Any
        other verdict, or a connect that stalls in turn, ends it as usual, so that
        the next stall is reported."""
        return (current is not None and not current.stalled
                and current.verdict.outcome in (Flag.UCS, Flag.PWS)
                and client_still_silent(record, entry.code, entry.since_ns))

    def _resolve(self, record: RequestRecord, entry: StallEntry, at_ns: int | None, finished: bool) -> None:
        # A request that ended because of its stall (aborted, timed out) did not resolve
        # it; one whose response ended cleanly did, [DONE] or not (NDN).
        if finished and record.outcome is not Flag.OK and record.outcome is not Flag.NDN:
            return
        if entry.attempt >= 0 and len(record.attempts) - 1 != entry.attempt:
            return  # its upstream attempt failed and was resent: it ended, but no byte came
        entry.resolved_ns = at_ns or time.monotonic_ns()
        for listener in self.listeners:
            try:
                listener.on_stall_resolved(record, entry)
            except Exception:
                self.listener_errors += 1
                log.exception("stall listener %s raised", type(listener).__name__)


class StallLog:
    """One WARN line per stall and one INFO line when it resolves.

    ``engines`` (the ``EngineScraper``, or in a worker of several the ``EngineReadings``
    the service's scraper sends; set by the composition root when scraping or engine
    spans are on) appends the engines' latest gauges to the stall line, and with its
    ``join`` where the engines have the request: ``engine_stage: kv_transfer (prefill
    prefill_transfer_kv_cache, sglang host 1a2b3c4d pid 7; from spans)``, and after an
    engine-blamed stall's blame (FBS, MSS) its component. The line is unchanged otherwise.
    An event stream's line says, before those, what its tokens were when the stall was
    found: ``tokens: 3 output events, the last 2.1 s ago, 14 heartbeats``, or with no
    token yet ``tokens: none, 2.1 s since the response head, 14 heartbeats``.
    """

    engines = None

    def on_stall(self, record: RequestRecord, judgement: Judgement, entry: StallEntry) -> None:
        found = judgement.verdict
        attempt = record.attempt
        upstream = "none"
        if attempt is not None and attempt.connection is not None:
            upstream = f"#{attempt.connection.id} ({'reused' if attempt.reused else 'new'})"
        engines = self.engines
        join = engines.join if engines is not None else None
        stage = join.stall_stage(record, entry.detected_ns) if join is not None else None
        component = f" ({stage.component})" if stage is not None and found.outcome in NAMES_COMPONENT else ""
        progress = token_progress(record)
        tail = f" tokens: {stall_words(progress, entry.detected_ns)}" if progress is not None else ""
        if stage is not None:
            tail += f" engine_stage: {stage.words()}"
        if engines is not None and engines.scraping:
            tail += f" engines: {engines.summary}"
        log.warning(
            "stall %s: %s waited %.1f s %s, blame %s%s; trace_id=%032x request_id=%s %s %s "
            "client_conn=#%d seq=%d upstream_conn=%s%s",
            found.outcome.code, found.outcome.name, judgement.waited_ns / 1e9, found.phase.value,
            found.outcome.blame.value, component, record.trace_id, record.request_id, record.method, record.target,
            record.connection.id, record.sequence, upstream, tail,
        )

    def on_stall_resolved(self, record: RequestRecord, entry: StallEntry) -> None:
        log.info("stall %s resolved after %.1f s; trace_id=%032x request_id=%s", entry.code,
                 (entry.resolved_ns - entry.since_ns) / 1e9, record.trace_id, record.request_id)
