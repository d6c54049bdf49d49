"""The read-only admin listener: ``GET /healthz``, ``GET /debug/inflight``, ``GET /metrics``."""

from __future__ import annotations

import json
import math
import os
import time

from aiohttp import web

from . import __version__
from .lifecycle.stall import StallThresholds
from .observe.inflight import engines_view, inflight_view
from .observe.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .proxy.context import ServerContext


def _dumps(value) -> str:
    return json.dumps(_finite(value), indent=1)


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


def build_admin_app(ctx: ServerContext, started_ns: int, watchdog=None, metrics=None,
                    engines=None, prober=None) -> web.Application:
    """``metrics`` is a ``ProxyMetrics``; without one there is no ``/metrics`` route.
    ``engines`` is an ``EngineScraper`` or None (then ``/debug/inflight`` is as before).
    ``prober`` is a ``StallProber`` or None; with one, in-flight entries get ``probe``."""

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "draining" if ctx.shutting_down else "ok",
                "version": __version__,
                "pid": os.getpid(),
                "uptime_s": round((time.monotonic_ns() - started_ns) / 1e9, 3),
                "upstream": str(ctx.settings.upstream),
                "client_connections": len(ctx.connections),
                "requests_in_flight": len(ctx.in_flight),
                "upstream_connections_open": ctx.pool.open_count,
                "upstream_connections_idle": len(ctx.pool.idle),
                "upstream_keepalive_timeout_s": ctx.pool.keepalive.learned,
                "upstream_keepalive_misaligned": ctx.pool.keepalive.misaligned,
                "pool_idle_timeout_s": ctx.settings.pool.idle_timeout,
                "client_keepalive_timeout_s": ctx.settings.timeouts.client_keepalive,
            },
            status=503 if ctx.shutting_down else 200,
        )

    async def inflight(_request: web.Request) -> web.Response:
        now = time.monotonic_ns()
        thresholds = watchdog.thresholds if watchdog is not None else StallThresholds()
        requests = inflight_view(list(ctx.in_flight.values()), now, thresholds, engines, prober)
        return web.json_response({"pid": os.getpid(), "count": len(requests), "requests": requests,
                                  **engines_view(engines, now, requests)}, dumps=_dumps)

    async def prometheus(_request: web.Request) -> web.Response:
        return web.Response(body=metrics.render().encode("utf-8"), headers={"Content-Type": METRICS_CONTENT_TYPE})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/debug/inflight", inflight)
    if metrics is not None:
        app.router.add_get("/metrics", prometheus)
    return app
