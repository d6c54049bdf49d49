"""One worker's answers to the admin side, built without holding its event loop.

Theory of operation
-------------------
The admin side (this process's own admin listener, or the service's, which asks
every worker over its link) asks for one of ``KINDS``:

* ``health``: a handful of numbers read in place, microseconds;
* ``numbers``: ``ProxyMetrics.numbers()`` (one pass, microseconds) plus the requests
  in flight by phase and how many of them are at the engines;
* ``at_engines``: that last count alone, for the engine orphan check;
* ``inflight``: the ``/debug/inflight`` entry of every request in flight, with the
  worker's pid, and its health as of the same moment.

Counting or describing the requests in flight costs per request (about 0.5 us to
count one, 9 us to describe one), so it is done in slices: the records are listed
once, then visited until ``SLICE_NS`` (0.25 ms) of loop time has gone, then the loop runs
whatever else is ready (the requests being proxied) before the next slice. A scrape
therefore never holds the loop for much more than ``SLICE_NS``, however many
requests are in flight; each slice judges its requests at its own ``now``, and a
request that finished meanwhile is left out. ``on_slice`` lets a caller send each
slice on as it is made.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

from ..lifecycle.correlation import UPSTREAM_PHASES
from ..lifecycle.machine import in_flight_phase
from ..lifecycle.marks import MARK
from ..lifecycle.stall import StallThresholds
from .inflight import inflight_entry
from .metrics import IN_FLIGHT_PHASES

KINDS = ("health", "numbers", "at_engines", "inflight")
# Loop time one slice may take before the loop runs what else is ready.
SLICE_NS = 250_000
# Records visited between two clock reads (a described request is ~9 us).
CLOCK_EVERY = 8
UPSTREAM_PHASE_NAMES = frozenset(phase.value for phase in UPSTREAM_PHASES)


class WorkerView:
    """``ctx`` as ``ProxyMetrics`` needs it; ``metrics`` a ``ProxyMetrics``; ``watchdog``
    (for its thresholds), ``engines`` (what correlates a waiting request with the
    engines: a scraper or the readings the service sends) and ``prober`` may be None."""

    def __init__(self, ctx, metrics, watchdog=None, engines=None, prober=None,
                 started_ns: int | None = None) -> None:
        self.ctx, self.metrics, self.watchdog = ctx, metrics, watchdog
        self.engines, self.prober = engines, prober
        self.started_ns = time.monotonic_ns() if started_ns is None else started_ns
        self.pid = os.getpid()

    async def answer(self, kind: str, on_slice: Callable[[list], None] | None = None):
        if kind == "health":
            return self.health()
        if kind == "numbers":
            return await self.numbers()
        if kind == "at_engines":
            return (await self._count())[1]
        if kind == "inflight":
            return await self.inflight(on_slice)
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")

    def health(self) -> dict:
        ctx = self.ctx
        pool = ctx.pool
        return {
            "pid": self.pid,
            "status": "draining" if ctx.shutting_down else "ok",
            "uptime_s": round((time.monotonic_ns() - self.started_ns) / 1e9, 3),
            "client_connections": len(ctx.connections),
            "requests_in_flight": len(ctx.in_flight),
            "upstream_connections_open": pool.open_count,
            "upstream_connections_idle": len(pool.idle),
            "upstream_keepalive_timeout_s": pool.keepalive.learned,
            "upstream_keepalive_misaligned": pool.keepalive.misaligned,
        }

    async def numbers(self) -> dict:
        # Counters first, in this very pass: they are consistent with each other.
        numbers = self.metrics.numbers()
        numbers["in_flight"], numbers["at_engines"] = await self._count()
        numbers["pid"] = self.pid
        return numbers

    async def _count(self) -> tuple[dict[str, int], int]:
        phases = dict.fromkeys(IN_FLIGHT_PHASES, 0)
        at_engines = 0
        records = list(self.ctx.in_flight.values())
        deadline = time.monotonic_ns() + SLICE_NS
        for index, record in enumerate(records):
            if index % CLOCK_EVERY == 0 and index and time.monotonic_ns() > deadline:
                await asyncio.sleep(0)
                deadline = time.monotonic_ns() + SLICE_NS
            if record.finished:
                continue
            phase = in_flight_phase(record)
            phases[phase] = phases.get(phase, 0) + 1
            at_engines += phase in UPSTREAM_PHASE_NAMES
        return phases, at_engines

    async def inflight(self, on_slice: Callable[[list], None] | None = None) -> dict:
        """{"health", "at_engines", "entries"}; entries are (start ns, entry) pairs, in
        no order, all here or (with ``on_slice``) handed over slice by slice."""
        health = self.health()
        thresholds = self.watchdog.thresholds if self.watchdog is not None else StallThresholds()
        records = list(self.ctx.in_flight.values())
        kept: list = []
        piece: list = []
        at_engines = described = 0
        now = time.monotonic_ns()
        deadline = now + SLICE_NS
        for index, record in enumerate(records):
            if index % CLOCK_EVERY == 0 and index and time.monotonic_ns() > deadline:
                self._hand_over(piece, kept, on_slice)
                piece = []
                await asyncio.sleep(0)
                now = time.monotonic_ns()
                deadline = now + SLICE_NS
            if record.finished:
                continue
            entry = inflight_entry(record, now, thresholds, self.engines, self.prober)
            entry["worker"] = self.pid
            described += 1
            at_engines += in_flight_phase(record) in UPSTREAM_PHASE_NAMES
            piece.append((record.marks.get(MARK.FIRST_DOWNSTREAM_RX_BYTE, now), entry))
        self._hand_over(piece, kept, on_slice)
        health["requests_in_flight"] = described  # as the entries say, not as the first slice found them
        return {"health": health, "at_engines": at_engines, "entries": kept}

    @staticmethod
    def _hand_over(piece: list, kept: list, on_slice) -> None:
        if on_slice is None:
            kept.extend(piece)
        elif piece:
            on_slice(piece)
