"""The simulation's aiohttp servers: starting one on a port (0 picks a free one), and
quieting the tracebacks the router's gRPC health probes cause."""

from __future__ import annotations

import logging

from aiohttp import web


class DropProtocolProbes(logging.Filter):
    """The router's gRPC probe (HTTP/2 bytes) makes aiohttp log a 400 traceback; drop it."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and type(exc).__name__ == "BadHttpMessage")


def quiet_logger(name: str) -> logging.Logger:
    """An aiohttp server logger without the probes' tracebacks."""
    logger = logging.getLogger(name)
    logger.addFilter(DropProtocolProbes())
    return logger


async def start_app(app: web.Application, host: str, port: int, **runner_options) -> tuple[web.AppRunner, int]:
    """Serve ``app``; returns its runner (``cleanup()`` stops it) and the bound port."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False, **runner_options)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:  # a taken port: nothing is left set up behind the error
        await runner.cleanup()
        raise
    return runner, site._server.sockets[0].getsockname()[1]
