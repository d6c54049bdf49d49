"""The load generator process: ``python -m traceproxy.bench.loadgen --spec F --out F``.

It opens the scenario's connections, prints ``ready``, waits for ``go`` on stdin,
runs the scenario, writes its counters and samples as JSON to ``--out`` and exits.
Everything is bounded: per-request timeouts (hangs) and the scenario's budget
(requests not started by then are counted as skipped).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import uvloop

from .client import Conn, Recorder, connect, expire
from .procs import raise_fd_limit, write_json_file
from .scenarios import RequestSpec, request_from_dict

WATCHDOG_INTERVAL = 0.05
WARMUP = RequestSpec(tokens=1)
WARMUP_TIMEOUT = 5.0


class Job:
    """One scenario run in this process: connections ``offset .. offset + connections``."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.host, self.port = spec["host"], spec["port"]
        self.requests = [request_from_dict(r) for r in spec["requests"]]
        authority = f"{self.host}:{self.port}"
        self.payloads = [r.encode(authority) for r in self.requests]
        self.rec = Recorder()
        self.conns: list[Conn | None] = [None] * spec["connections"]
        self.skipped = 0
        self.connect_failures = 0

    async def open_all(self) -> None:
        results = await asyncio.gather(*(self._open() for _ in self.conns), return_exceptions=True)
        for i, conn in enumerate(results):
            if isinstance(conn, BaseException):
                self.connect_failures += 1
                self.rec.errors["connect"] += 1
            else:
                self.conns[i] = conn

    async def warm_up(self) -> None:
        """One small request per connection, not recorded, so a proxy's upstream pool starts warm."""
        scratch = Recorder()
        live = [c for c in self.conns if c is not None]
        payload = WARMUP.encode(f"{self.host}:{self.port}")
        for conn in live:
            conn.rec = scratch
        waiters = [c.request(payload, False, 0, self.spec["timeout"]) for c in live]
        if waiters:
            await asyncio.wait(waiters, timeout=min(self.spec["timeout"], WARMUP_TIMEOUT))
        expire(live, float("inf"))
        for conn in live:
            conn.rec = self.rec

    async def _open(self) -> Conn:
        return await connect(self.host, self.port, self.rec, self.spec["detail"])

    async def run(self) -> float:
        """Run all connections; return the elapsed seconds."""
        started = time.perf_counter()
        stop_at = started + self.spec["duration"] if self.spec["duration"] else None
        watchdog = asyncio.ensure_future(self._watchdog())
        workers = [asyncio.ensure_future(self._worker(i, stop_at)) for i in range(len(self.conns))]
        try:
            await asyncio.wait(workers, timeout=self.spec["budget"])
        finally:
            expire(self.conns, float("inf"))  # still in flight at the budget: hangs
            watchdog.cancel()
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, watchdog, return_exceptions=True)
        return time.perf_counter() - started

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL)
            expire(self.conns, time.perf_counter())

    async def _worker(self, index: int, stop_at: float | None) -> None:
        global_index = self.spec.get("offset", 0) + index
        rng = random.Random(global_index)
        rounds = self.spec["rounds"]
        started = 0
        try:
            while (time.perf_counter() < stop_at) if stop_at else (started < rounds):
                started += 1
                await self._one(index, (global_index + started - 1) % len(self.requests))
                if self.spec["think_ms"]:
                    await asyncio.sleep(rng.uniform(0, self.spec["think_ms"]) / 1000)
        finally:
            if not stop_at:
                self.skipped += rounds - started

    async def _one(self, index: int, kind: int) -> None:
        conn = self.conns[index]
        if conn is None or conn.closed:
            conn = self.conns[index] = await self._reconnect()
            if conn is None:
                await asyncio.sleep(0.05)
                return
        req = self.requests[kind]
        await conn.request(self.payloads[kind], req.stream, req.expected_events, self.spec["timeout"])

    async def _reconnect(self) -> Conn | None:
        self.rec.reconnects += 1
        try:
            return await self._open()
        except (OSError, asyncio.TimeoutError):
            self.rec.errors["connect"] += 1
            return None

    def close(self) -> None:
        for conn in self.conns:
            if conn is not None and not conn.closed:
                conn.transport.close()

    def result(self, elapsed: float, cpu_s: float) -> dict:
        rec = self.rec
        return {
            "elapsed": elapsed, "cpu_s": cpu_s, "ok": rec.ok, "hangs": rec.hangs, "errors": dict(rec.errors),
            "skipped": self.skipped, "reconnects": rec.reconnects, "server_closes": rec.server_closes,
            "bytes_up": rec.bytes_up, "bytes_down": rec.bytes_down, "events": rec.events, "streams": rec.streams,
            "ttfb": rec.ttfb.export(), "ttft": rec.ttft.export(), "gaps": rec.gaps.export(),
            "delivery": rec.delivery.export(), "latency": rec.latency.export(),
        }


def _read_line() -> str:
    return sys.stdin.readline().strip()


async def run_job(spec: dict) -> dict:
    job = Job(spec)
    await job.open_all()
    if spec.get("warmup", True):
        await job.warm_up()
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    if await loop.run_in_executor(None, _read_line) != "go":
        raise SystemExit("loadgen: no go from the runner")
    cpu0 = time.process_time()
    elapsed = await job.run()
    cpu_s = time.process_time() - cpu0
    job.close()
    return job.result(elapsed, cpu_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="traceproxy.bench.loadgen")
    parser.add_argument("--spec", required=True, help="JSON file: a scenario spec plus host, port, offset")
    parser.add_argument("--out", required=True, help="where to write the JSON result")
    args = parser.parse_args(argv)
    with open(args.spec) as f:
        spec = json.load(f)
    raise_fd_limit()
    result = uvloop.run(run_job(spec))
    write_json_file(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
