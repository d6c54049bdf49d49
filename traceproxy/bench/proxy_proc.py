"""The proxy under test, as its own process: one ``ProxyServer`` on an ephemeral port.

``python -m traceproxy.bench.proxy_proc --upstream URL --port-file F [--set KEY=VALUE ...]``
writes the port to F and serves until SIGTERM, then shuts down with a 1 s grace.
"""

from __future__ import annotations

import argparse
import logging

import uvloop

from ..app import ProxyServer
from ..config import default_settings
from .procs import raise_fd_limit, wait_for_stop_signal, write_port_file


def build_settings(upstream: str, overrides: list[str]):
    extra = dict(item.split("=", 1) for item in overrides)
    return default_settings().replace(**{"listen": "127.0.0.1:0", "upstream": upstream, "admin": "off", **extra})


async def serve(settings, port_file: str) -> None:
    server = ProxyServer(settings)
    await server.start()
    write_port_file(port_file, server.port)
    await wait_for_stop_signal()
    await server.shutdown(grace=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="traceproxy.bench.proxy_proc")
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a settings override, e.g. pool.max_connections=2048")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    raise_fd_limit()
    uvloop.run(serve(build_settings(args.upstream, args.set), args.port_file))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
