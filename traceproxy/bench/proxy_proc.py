"""The proxy under test, as its own process: one ``ProxyServer`` on an ephemeral port.

``python -m traceproxy.bench.proxy_proc --upstream URL --port-file F [--admin-port-file F]
[--set KEY=VALUE ...]`` writes the port to F and serves until SIGTERM, then shuts down
with a 1 s grace (and then stops its span exporter, which exports what it still holds).
It sets glibc's allocator thresholds as ``serve`` does (``allocator.py``), so an in-tree
target costs what ``serve`` with the same keys costs.

``--workers N --listen-port P [--admin-port A]`` (N > 1) serves as ``traceproxy serve
--workers N`` does, this process the service's parent: the workers share a fixed port,
so the bench picks it and waits for it (and for the admin listener, which the parent
starts once every worker serves) instead of reading a port file.

The bench's in-tree targets differ only in their observability keys, laid over
``default_settings()`` (``--set`` items come after, so they win):

* ``proxy``: tracing off, access log off (``minimal_overrides``). The watchdog and the
  metrics are always on.
* ``proxy-traced``: tracing to an OTLP http/protobuf endpoint (the bench's sink), with
  the access log off, so it measures tracing alone (``traced_overrides``).
* ``proxy-logged``: the access log to a file, tracing off (``logged_overrides``).
* ``proxy-receiver`` and ``proxy-receiver-grpc``: ``proxy``'s keys with the engine span
  receiver on, OTLP/HTTP or OTLP/gRPC, on a port the bench picks (``receiver_overrides``).
  With tracing off the spans are kept for the join only, relayed nowhere.
* ``defaults``: ``serve`` as shipped (``defaults_overrides``): spans to the local file,
  the access log to stdout (the bench's children write it to ``/dev/null``), the admin
  listener on.

``bare`` is ``proxy``'s keys under its own name, so that a ``--proxy-cmd`` can take the
``proxy`` column while the in-tree proxy with every observer off stays in the table.
All but ``proxy`` and ``bare`` run the admin listener on an ephemeral port, so the bench
can read their counters from ``/metrics``.
"""

from __future__ import annotations

import argparse
import logging
import sys

import uvloop

from ..allocator import tune_allocator
from ..app import ProxyServer
from ..config import ConfigError, default_settings
from .procs import raise_fd_limit, wait_for_stop_signal, write_port_file


def minimal_overrides() -> list[str]:
    return ["tracing.exporter=off", "access_log.path="]


def defaults_overrides() -> list[str]:
    """Only what the bench must choose: the admin listener's port (the default one may be taken)."""
    return ["admin=127.0.0.1:0"]


def traced_overrides(otlp_endpoint: str) -> list[str]:
    return ["tracing.exporter=otlp", f"tracing.otlp_endpoint={otlp_endpoint}",
            "tracing.otlp_protocol=http/protobuf", "access_log.path=", "admin=127.0.0.1:0"]


def logged_overrides(access_log_path: str) -> list[str]:
    return ["tracing.exporter=off", f"access_log.path={access_log_path}", "admin=127.0.0.1:0"]


def receiver_overrides(http_port: int | None = None, grpc_port: int | None = None) -> list[str]:
    """``bare``'s keys with one engine span receiver on: what receiving the engines' spans costs,
    kept for the join only (with tracing off there is nowhere to relay them)."""
    keys = minimal_overrides()
    if http_port is not None:
        keys.append(f"engines.otlp_receiver=127.0.0.1:{http_port}")
    if grpc_port is not None:
        keys.append(f"engines.otlp_receiver_grpc=127.0.0.1:{grpc_port}")
    return keys


# Keys each target's process gets from the bench: its own ephemeral ports, and the
# bench's upstream. A --proxy-set for them would put every target on one port.
BENCH_CHOSEN_KEYS = ("listen", "upstream", "admin")
# The engine span receivers: on in the receiver targets only, on ports the bench picks, so that
# its span loads know where to export.
RECEIVER_KEYS = ("engines.otlp_receiver", "engines.otlp_receiver_grpc")


def build_settings(upstream: str, overrides: list[str]):
    extra = dict(item.split("=", 1) for item in overrides)
    return default_settings().replace_from({"listen": "127.0.0.1:0", "upstream": upstream, "admin": "off", **extra},
                                           "--proxy-set")


async def serve(settings, port_file: str, admin_port_file: str | None = None) -> None:
    server = ProxyServer(settings)
    await server.start()
    if admin_port_file and server.admin_port is not None:
        write_port_file(admin_port_file, server.admin_port)
    write_port_file(port_file, server.port)  # last: the bench waits for this one
    await wait_for_stop_signal()
    await server.shutdown(grace=1)


def serve_workers(settings, workers: int, listen_port: int, admin_port: int | None) -> int:
    from ..app import run

    addresses = {"workers": str(workers), "listen": f"127.0.0.1:{listen_port}",
                 "admin": f"127.0.0.1:{admin_port}" if admin_port else "off"}
    return run(settings.replace_from(addresses, "the bench"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="traceproxy.bench.proxy_proc")
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port-file", help="where to write the port (one process)")
    parser.add_argument("--admin-port-file", help="where to write the admin port, when the admin listener is on")
    parser.add_argument("--workers", type=int, default=1, help="worker processes; above 1, --listen-port is needed")
    parser.add_argument("--listen-port", type=int, help="the port the workers share")
    parser.add_argument("--admin-port", type=int, help="the service's admin port (workers > 1)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a settings override, e.g. pool.max_connections=2048")
    args = parser.parse_args(argv)
    if args.workers > 1 and not args.listen_port or args.workers <= 1 and not args.port_file:
        parser.error("--port-file with one worker, --listen-port with several")
    logging.basicConfig(level=logging.WARNING)
    raise_fd_limit()
    try:
        settings = build_settings(args.upstream, args.set)
        if args.workers > 1:
            return serve_workers(settings, args.workers, args.listen_port, args.admin_port)
        tune_allocator()  # as serve does (app.run): the targets are serve's process, priced alike
        uvloop.run(serve(settings, args.port_file, args.admin_port_file))
    except ConfigError as exc:  # found at startup (a log path it cannot write): said, not a traceback
        sys.stderr.write(f"configuration error: {exc}\n")
        return 2
    except OSError as exc:  # a port it cannot bind: said, not a traceback
        sys.stderr.write(f"could not start: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
