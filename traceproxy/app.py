"""The composition root: what starts, in which order, and how it stops.

Start: the proxy context, the client listener, then the admin listener (so
``/healthz`` answering means the proxy port is open). Stop (SIGTERM/SIGINT): stop
accepting, close idle client connections, let in-flight requests finish within
``timeouts.shutdown_grace``, reset what is left, then close the pool and admin.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time

from aiohttp import web

from .admin import build_admin_app
from .config import Settings
from .lifecycle.flags import Flag
from .lifecycle.hooks import Fanout
from .proxy.context import ServerContext
from .proxy.downstream import ClientConnection

log = logging.getLogger("traceproxy")


class ProxyServer:
    def __init__(self, settings: Settings, fanout: Fanout | None = None) -> None:
        self.settings = settings
        self.fanout = fanout or Fanout()
        self.ctx: ServerContext | None = None
        self._server: asyncio.base_events.Server | None = None
        self._admin_runner: web.AppRunner | None = None
        self.admin_port: int | None = None
        self.started_ns = time.monotonic_ns()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.ctx = ServerContext(self.settings, self.fanout)
        listen = self.settings.listen
        self._server = await loop.create_server(
            lambda: ClientConnection(self.ctx),
            host=listen.host,
            port=listen.port,
            reuse_port=self.settings.workers > 1,
            backlog=4096,
        )
        if self.settings.admin is not None:
            await self._start_admin()

    async def _start_admin(self) -> None:
        self._admin_runner = web.AppRunner(build_admin_app(self.ctx, self.started_ns), access_log=None)
        await self._admin_runner.setup()
        admin = self.settings.admin
        site = web.TCPSite(self._admin_runner, admin.host, admin.port, reuse_port=self.settings.workers > 1)
        await site.start()
        self.admin_port = site._server.sockets[0].getsockname()[1]

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    async def shutdown(self, grace: float | None = None) -> None:
        grace = self.settings.timeouts.shutdown_grace if grace is None else grace
        ctx = self.ctx
        self._server.close()
        ctx.begin_shutdown()
        deadline = time.monotonic() + grace
        while ctx.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(ctx.connections):
            if conn.active is not None:
                conn.active.abort(Flag.LR, f"shutdown grace of {grace:g} s ran out")
            conn.close()
        ctx.pool.close_all()
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()
        await asyncio.sleep(0)


async def serve_until_signalled(settings: Settings) -> None:
    server = ProxyServer(settings)
    await server.start()
    log.info("traceproxy listening on %s, upstream %s, admin %s (pid %d)",
             settings.listen, settings.upstream, settings.admin or "off", os.getpid())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: %d requests in flight, grace %g s", len(server.ctx.in_flight),
             settings.timeouts.shutdown_grace)
    await server.shutdown()


def run(settings: Settings) -> int:
    """Run in this process (workers == 1) or supervise N forked workers."""
    if settings.workers <= 1:
        _run_one(settings)
        return 0
    return _run_workers(settings)


def _run_one(settings: Settings) -> None:
    import uvloop

    _raise_fd_limit()
    uvloop.run(serve_until_signalled(settings))


def _run_workers(settings: Settings) -> int:
    # Every worker binds the same port with SO_REUSEPORT and the kernel spreads
    # new connections across them; the parent only supervises and relays signals.
    _check_port_bindable(settings)
    children: list[int] = []
    for _ in range(settings.workers):
        pid = os.fork()
        if pid == 0:
            try:
                _run_one(settings)
            finally:
                os._exit(0)
        children.append(pid)

    def relay(signum, _frame):
        for child in children:
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, relay)
    signal.signal(signal.SIGINT, relay)
    status = 0
    for child in children:
        _, code = os.waitpid(child, 0)
        status = status or os.waitstatus_to_exitcode(code)
    return status


def _check_port_bindable(settings: Settings) -> None:
    """Fail in the parent, with one clear message, if the port is taken."""
    family = socket.AF_INET6 if ":" in settings.listen.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        probe.bind((settings.listen.host, settings.listen.port))


def _raise_fd_limit() -> None:
    """Thousands of keep-alive clients need thousands of descriptors."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        print("traceproxy: could not raise the open-file limit", file=sys.stderr)
