"""The read-only admin listener: ``GET /healthz`` (later: metrics, in-flight view)."""

from __future__ import annotations

import os
import time

from aiohttp import web

from . import __version__
from .proxy.context import ServerContext


def build_admin_app(ctx: ServerContext, started_ns: int) -> web.Application:
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
            },
            status=503 if ctx.shutting_down else 200,
        )

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    return app
