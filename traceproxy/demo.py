"""``traceproxy demo``: the quick start, with nothing else installed or running.

Starts the built-in upstream and the proxy on free loopback ports in this process,
then plays a short multi-turn streaming conversation on one keep-alive connection,
lets the upstream close its idle connections between turns (the race that hangs
naive proxies), and finally asks for a response from an upstream that is down.
Prints each turn with the proxy's outcome code and what happened to the pooled
upstream connection.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import uvloop

from .app import ProxyServer
from .config import default_settings
from .lifecycle.hooks import Fanout
from .lifecycle.timeline import RequestRecord
from .sim.fast import FastUpstream

TURNS = 6
SLOW_TURN = 5  # prefill takes 1.2 s while the first_byte stall threshold is 0.5 s
SPANS = "traceproxy-data/spans.jsonl"
ACCESS_LOG = "traceproxy-data/access.log"


class _Collect:
    def __init__(self) -> None:
        self.done: list[RequestRecord] = []

    def on_done(self, record):
        self.done.append(record)


async def _turn(reader, writer, body: dict, ttft_ms: int = 0) -> tuple[int, int, bool]:
    payload = json.dumps(body).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: demo\r\nContent-Type: application/json\r\n"
                 b"x-fake-ttft-ms: %d\r\nContent-Length: %d\r\n\r\n%s" % (ttft_ms, len(payload), payload))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status = int(head.split(b" ")[1])
    events, done = 0, False
    while True:
        size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)).split(b";")[0], 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return status, events, done
        events += data.count(b"data: ")
        done = done or b"data: [DONE]" in data


async def _demo() -> int:
    collect = _Collect()
    up = await FastUpstream(idle_close_after=0.3).start()
    settings = default_settings().replace(**{
        "listen": "127.0.0.1:0", "admin": "off", "upstream": up.url,
        "tracing.exporter": "file", "tracing.file_path": SPANS, "access_log.path": ACCESS_LOG,
        "stall.first_byte": 0.5,
    })
    proxy = ProxyServer(settings, Fanout([collect]))
    await proxy.start()
    print(f"built-in upstream: {up.url}   (closes idle connections after 0.3 s)")
    print(f"traceproxy:        http://127.0.0.1:{proxy.port}\n")
    print(f"{'turn':>4}  {'status':>6}  {'events':>6}  {'[DONE]':>6}  {'outcome':>7}  upstream connection")
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    messages = [{"role": "user", "content": "hello"}]
    failures = 0
    for turn in range(1, TURNS + 1):
        body = {"model": "demo", "stream": True, "max_tokens": 8, "messages": messages}
        slow = turn == SLOW_TURN
        status, events, done = await _turn(reader, writer, body, ttft_ms=1200 if slow else 0)
        record = collect.done[-1]
        failures += status != 200 or not done
        note = f"  <- slow prefill: {_stalls(record)}" if slow else ""
        print(f"{turn:>4}  {status:>6}  {events:>6}  {str(done):>6}  {record.outcome.code:>7}  {_ledger(record)}{note}")
        messages.append({"role": "assistant", "content": "tok " * 8})
        messages.append({"role": "user", "content": f"turn {turn + 1}"})
        await asyncio.sleep(0.4 if turn % 2 else 0.05)
    writer.close()
    await _down_upstream_turn(collect)
    await proxy.shutdown(grace=1)
    await up.stop()
    print(f"\n{TURNS - failures}/{TURNS} turns complete on one client connection; "
          f"stale pooled connections resent: {proxy.ctx.pool.stats['stale_retried']}")
    print(f"spans (OTLP/JSON lines): {SPANS}\naccess log (JSON lines): {ACCESS_LOG}")
    return 1 if failures else 0


async def _down_upstream_turn(collect: _Collect) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    settings = default_settings().replace(**{
        "listen": "127.0.0.1:0", "admin": "off", "upstream": f"http://127.0.0.1:{dead_port}",
        "tracing.exporter": "off", "access_log.path": ACCESS_LOG,
    })
    proxy = ProxyServer(settings, Fanout([collect]))
    await proxy.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: demo\r\nConnection: close\r\n\r\n")
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    record = collect.done[-1]
    status_line = raw.split(b"\r\n", 1)[0].decode()
    body = raw.split(b"\r\n\r\n", 1)[1].decode()
    print(f"\nupstream down: {status_line}, outcome {record.outcome.code} "
          f"(blame {record.outcome.blame.value}): {record.error}")
    print(f"  body: {body}")
    await proxy.shutdown(grace=0)


def _stalls(record: RequestRecord) -> str:
    if not record.stalls:
        return "no stall"
    parts = []
    for entry in record.stalls:
        state = (f"resolved after {(entry.resolved_ns - entry.since_ns) / 1e9:.1f} s" if entry.resolved_ns
                 else "unresolved")
        parts.append(f"stall {entry.code} ({entry.phase.replace('_', ' ')}), {state}")
    return "; ".join(parts)


def _ledger(record: RequestRecord) -> str:
    parts = []
    for attempt in record.attempts:
        conn = attempt.connection
        if conn is None:
            parts.append("none")
            continue
        kind = f"reused #{conn.id} (idle {attempt.idle_age_ns / 1e9:.2f} s)" if attempt.reused else f"new #{conn.id}"
        if attempt.outcome is not None:
            kind += f" -> {attempt.outcome.code}, resent"
        parts.append(kind)
    return "; ".join(parts)


def run_demo() -> int:
    started = time.monotonic()
    code = uvloop.run(_demo())
    print(f"demo finished in {time.monotonic() - started:.1f} s")
    return code
