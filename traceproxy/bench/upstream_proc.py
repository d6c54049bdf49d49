"""The benchmark's upstream process: ``traceproxy.sim.fast.FastUpstream`` on an ephemeral port.

``python -m traceproxy.bench.upstream_proc --port-file F`` writes the port to F and
serves until SIGTERM.
"""

from __future__ import annotations

import argparse

import uvloop

from ..sim.fast import FastUpstream
from .procs import raise_fd_limit, wait_for_stop_signal, write_port_file


async def serve(port_file: str, idle_close_after: float) -> None:
    upstream = await FastUpstream("127.0.0.1", 0, idle_close_after=idle_close_after).start()
    write_port_file(port_file, upstream.port)
    await wait_for_stop_signal()
    await upstream.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="traceproxy.bench.upstream_proc")
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--idle-close-after", type=float, default=0.0)
    args = parser.parse_args(argv)
    raise_fd_limit()
    uvloop.run(serve(args.port_file, args.idle_close_after))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
