"""The read-only admin listener: ``GET /healthz``, ``GET /debug/inflight``, ``GET /metrics``.

One view of the service, however many workers serve it. ``ServiceAdmin`` asks its
source for the workers' answers (``workers.LocalSource``: this process, the only
worker; ``workers.WorkerLinks``: every worker of the service, from the parent, each
within a deadline) and merges them: counters and histograms summed, gauges that
count things summed, in-flight requests in one list, oldest first. A worker that
did not answer in time is named in the answer (``workers``, ``answered: false``)
and counted (``traceproxy_worker_answers_late_total``); the answer is then partial
or its counters that worker's last, never a number that goes backwards.
"""

from __future__ import annotations

import json
import math
import os
import time

from . import __version__
from .admin_http import AdminHttpServer
from .observe.exposition import Exposition, wants_openmetrics
from .observe.inflight import engines_view
from .observe.service_metrics import merge, render


JSON = "application/json; charset=utf-8"


def _dumps(value) -> bytes:
    return json.dumps(_finite(value), indent=1).encode("utf-8")


def _finite(value):
    """NaN and infinities as null: JSON (RFC 8259) has no such numbers, and jq or a
    strict parser would refuse the whole answer or read a huge number instead."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


SUMMED_HEALTH = ("client_connections", "requests_in_flight", "upstream_connections_open",
                 "upstream_connections_idle")


class ServiceAdmin:
    """The three answers, from ``source`` (see the module doc). ``engines``: the
    service's ``EngineScraper`` or None; ``stopping``: a callable saying the service
    was asked to stop (a worker's own draining says so too); ``spans``: where the spans go,
    in the start-up line's words (``destinations.spans_destination``: a span file's
    absolute path, an OTLP address, or off), for tools that point at the file."""

    def __init__(self, source, settings, started_ns: int, engines=None, stopping=lambda: False,
                 spans: str = "off") -> None:
        self.source, self.settings, self.engines, self.spans = source, settings, engines, spans
        self.started_ns = started_ns
        self.stopping = stopping
        # Counting began when the service started: the _created of every OpenMetrics counter.
        self.created_s = round((time.time_ns() - time.monotonic_ns() + started_ns) / 1e9, 3)

    async def health(self) -> tuple[dict, int]:
        answers = await self.source.ask("health")
        return self._health(answers.answered, answers.missing)

    def _health(self, answered: dict, missing: list[int]) -> tuple[dict, int]:
        healths = list(answered.values())
        draining = self.stopping() or any(h["status"] == "draining" for h in healths)
        learned = [h["upstream_keepalive_timeout_s"] for h in healths if h["upstream_keepalive_timeout_s"] is not None]
        body = {
            "status": "draining" if draining else "ok",
            "version": __version__,
            "pid": os.getpid(),
            "uptime_s": round((time.monotonic_ns() - self.started_ns) / 1e9, 3),
            "upstream": str(self.settings.upstream),
            "spans": self.spans,
            **{key: sum(h[key] for h in healths) for key in SUMMED_HEALTH},
            "upstream_keepalive_timeout_s": min(learned) if learned else None,
            "upstream_keepalive_misaligned": any(h["upstream_keepalive_misaligned"] for h in healths),
            "pool_idle_timeout_s": self.settings.pool.idle_timeout,
            "client_keepalive_timeout_s": self.settings.timeouts.client_keepalive,
            "workers": self._workers(answered, missing, lambda h: h),
            "workers_answering": len(answered),
        }
        return body, 503 if draining else 200

    def _workers(self, answered: dict, missing: list[int], fields) -> list[dict]:
        return [{"pid": pid, "answered": True, **fields(answered[pid])} if pid in answered
                else {"pid": pid, "answered": False} for pid in self.source.workers]

    async def inflight(self) -> dict:
        answers = await self.source.ask("inflight")
        answered = answers.answered
        pairs = [pair for answer in answered.values() for pair in answer["entries"]]
        pairs.sort(key=lambda pair: pair[0])  # oldest first: the earliest first byte, whichever worker
        # Each worker measured its ages when it answered; measured again here from the
        # first byte (the monotonic clock is the host's), the list reads as one moment.
        now = time.monotonic_ns()
        for start, entry in pairs:
            entry["age_s"] = round((now - start) / 1e9, 3)
        requests = [entry for _, entry in pairs]
        health, _ = self._health({pid: answer["health"] for pid, answer in answered.items()}, answers.missing)
        at_engines = None if answers.missing else sum(answer["at_engines"] for answer in answered.values())
        return {"pid": os.getpid(), "count": len(requests), "requests": requests,
                "workers": self._workers(answered, answers.missing, lambda a: {"count": len(a["entries"])}),
                "workers_answering": len(answered), "health": health,
                **engines_view(self.engines, time.monotonic_ns(), requests, at_engines)}

    async def metrics(self, openmetrics: bool = False) -> Exposition:
        answers = await self.source.ask("numbers")
        late = [self.source.last_numbers(pid) for pid in answers.missing]
        service = merge(list(answers.answered.values()), [numbers for numbers in late if numbers is not None])
        out = Exposition(openmetrics, created=self.created_s)
        render(out, service, self.engines, {"count": len(self.source.workers), "answering": len(answers.answered),
                                            "late_total": self.source.late_total})
        return out


def admin_server(admin: ServiceAdmin) -> AdminHttpServer:
    """The listener's server, its three routes answered by ``admin``."""

    async def healthz(_accept: str) -> tuple[int, str, bytes]:
        body, status = await admin.health()
        return status, JSON, _dumps(body)

    async def inflight(_accept: str) -> tuple[int, str, bytes]:
        return 200, JSON, _dumps(await admin.inflight())

    async def prometheus(accept: str) -> tuple[int, str, bytes]:
        out = await admin.metrics(wants_openmetrics(accept or None))
        return 200, out.content_type, out.text().encode("utf-8")

    return AdminHttpServer({b"/healthz": healthz, b"/debug/inflight": inflight, b"/metrics": prometheus})
