"""The engine span loads' destination for a target without a receiver: ``python -m
traceproxy.bench.discard_proc --port-file F``.

With ``--engine-span-load`` the emulated engines (``span_load``) export in every run, so
that every target pays their CPU alike; a target with no receiver of its own has them
export here. Each ``POST`` is read to the end of its ``Content-Length`` body, dropped
unread, and answered ``200`` with an empty body (an empty ``ExportTraceServiceResponse``),
over keep-alive: as little work as an HTTP server can do, so that the comparison with a
receiver target charges the receiver with nearly all it does. Its CPU is measured and
reported apart, as the part of receiving this sink still does for the other side.

A request without ``Content-Length``, chunked, or with a head past 64 KiB is answered
400 and its connection closed. Counts (requests, bytes, refused) are written as JSON to
``--stats-file`` on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio

import uvloop

from .procs import wait_for_stop_signal, write_json_file, write_port_file

MAX_HEAD = 64 * 1024
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n"
BAD = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class Counts:
    def __init__(self) -> None:
        self.requests = self.bytes = self.refused = 0

    def snapshot(self) -> dict:
        return {"requests": self.requests, "bytes": self.bytes, "refused": self.refused}


class Discard(asyncio.Protocol):
    def __init__(self, counts: Counts) -> None:
        self.counts = counts
        self.head = bytearray()
        self.body_left = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.body_left:
                taken = min(self.body_left, len(view))
                self.body_left -= taken
                self.counts.bytes += taken
                view = view[taken:]
                if not self.body_left:
                    self.transport.write(OK)
                continue
            self.head += view
            view = memoryview(b"")
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                if len(self.head) > MAX_HEAD:
                    self._refuse()
                return
            length = _content_length(bytes(self.head[:end]))
            rest = self.head[end + 4:]
            self.head = bytearray()
            if length is None:
                self._refuse()
                return
            self.counts.requests += 1
            if length == 0:
                self.transport.write(OK)
            self.body_left = length
            view = memoryview(bytes(rest))

    def _refuse(self) -> None:
        self.counts.refused += 1
        self.transport.write(BAD)
        self.transport.close()
        self.head = bytearray()


def _content_length(head: bytes) -> int | None:
    """The body's length from a request head, or None: absent, not a number, or chunked."""
    length = None
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"transfer-encoding":
            return None
        if name == b"content-length":
            if not value.strip().isdigit():
                return None
            length = int(value)
    return length


async def serve(port_file: str, stats_file: str | None) -> None:
    counts = Counts()
    server = await asyncio.get_running_loop().create_server(lambda: Discard(counts), "127.0.0.1", 0)
    write_port_file(port_file, server.sockets[0].getsockname()[1])
    await wait_for_stop_signal()
    server.close()
    if stats_file:
        write_json_file(stats_file, counts.snapshot())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="traceproxy.bench.discard_proc")
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--stats-file", help="where to write the counts as JSON on SIGTERM")
    args = parser.parse_args(argv)
    uvloop.run(serve(args.port_file, args.stats_file))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
