"""``traceproxy demo``: the quick start, with nothing else running.

Starts the simulated SGLang prefill and decode workers (behind the real SGLang router
in PD mode when ``sglang-router`` is installed), traceproxy in front with spans to the
local file, and the repro harness; then injects one named fault at a time and prints
each fault against the verdict traceproxy gave, with the trace ids, and where the
spans and the access log are. Everything it starts it stops; it takes well under a
minute.

The last scenario is the story traceproxy was born from: a faulty client-side proxy
that stops forwarding on reused keep-alive connections. The harness hangs, and the
verdict is that the request never reached traceproxy: the hang is in front of it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

import uvloop

from .app import ProxyServer
from .config import default_settings
from .lifecycle.hooks import Fanout
from .lifecycle.timeline import RequestRecord
from .repro.harness import run_repro
from .repro.inflight import IN_FLIGHT, NOT_REACHED
from .sim.faultyproxy import FaultyProxy
from .sim.launch import SimDeployment, router_importable

SPANS = "traceproxy-data/spans.jsonl"
ACCESS_LOG = "traceproxy-data/access.log"
TURN_TIMEOUT = 2.5


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: str | None  # a sim fault spec, set on the worker it acts on
    role: str  # "prefill" or "decode"
    expected: str  # the verdict we expect traceproxy to give
    needs_router: bool = False
    through_faulty_proxy: bool = False


SCENARIOS = (
    Scenario("healthy turns on reused connections", None, "decode", "OK"),
    Scenario("prefill never finishes", "prefill_stall", "prefill", "FBS engine", needs_router=True),
    Scenario("decode stops after 3 tokens", "decode_stall:3", "decode", "MSS engine"),
    Scenario("stream ends without [DONE]", "no_done", "decode", "NDN engine"),
    Scenario("decode resets mid-stream", "reset_mid_stream:3", "decode", "UC engine"),
    Scenario("faulty proxy in front, reused conns", None, "decode", "never reached the proxy",
             through_faulty_proxy=True),
)


class _Outcomes:
    """Every finished request's outcome, by the request id the harness sent."""

    def __init__(self) -> None:
        self.by_request_id: dict[str, RequestRecord] = {}

    def on_done(self, record: RequestRecord) -> None:
        self.by_request_id[record.request_id] = record


def _verdict(result, outcomes: _Outcomes) -> tuple[str, str]:
    """(what traceproxy said, trace id) for the first turn that did not end OK."""
    for turn in result.records:
        record = outcomes.by_request_id.get(turn.request_id)
        if turn.result == "hung" and turn.diagnosis is not None:
            d = turn.diagnosis
            if d.kind == IN_FLIGHT:
                return f"{d.outcome} {d.blame}", d.trace_id or turn.trace_id or "-"
            if d.kind == NOT_REACHED:
                return "never reached the proxy", "-"
            return d.kind.replace("_", " "), turn.trace_id or "-"
        if record is not None and not record.outcome.is_ok:
            return f"{record.outcome.code} {record.outcome.blame.value}", "%032x" % record.trace_id
        if turn.result != "ok" and record is None:
            return turn.result, turn.trace_id or "-"
    last = result.records[-1] if result.records else None
    trace = last.trace_id if last is not None and last.trace_id else "-"
    return ("OK" if result.exit_code == 0 else "failed"), trace


async def _run_scenario(scenario: Scenario, dep: SimDeployment, proxy: ProxyServer, outcomes: _Outcomes,
                        has_router: bool) -> tuple[str, str]:
    if scenario.needs_router and not has_router:
        return "skipped (needs sglang-router)", "-"
    worker = dep.prefill if scenario.role == "prefill" else dep.decode
    worker.set_faults([scenario.fault] if scenario.fault else [])
    faulty = None
    url = f"http://127.0.0.1:{proxy.port}"
    if scenario.through_faulty_proxy:
        faulty = await FaultyProxy(url, hang_after=1, seed=1).start()
        url = faulty.url
    try:
        result = await asyncio.to_thread(
            run_repro, url, f"127.0.0.1:{proxy.admin_port}", 1, 3, TURN_TIMEOUT, "reused", None, max_tokens=6)
        await asyncio.sleep(0.3)  # the last request's outcome reaches the observers
        return _verdict(result, outcomes)
    finally:
        worker.set_faults([])
        await dep.prefill.release_held()
        await dep.decode.release_held()
        if faulty is not None:
            await faulty.stop()


async def _demo() -> int:
    has_router = router_importable()
    outcomes = _Outcomes()
    async with SimDeployment(router=has_router, request_timeout=20) as dep:
        upstream = dep.router_url or dep.decode.url
        settings = default_settings().replace(**{
            "listen": "127.0.0.1:0", "admin": "127.0.0.1:0", "upstream": upstream,
            "tracing.exporter": "file", "tracing.file_path": SPANS, "access_log.path": ACCESS_LOG,
            "stall.first_byte": 1.0, "stall.stream_gap": 1.0,
        })
        proxy = ProxyServer(settings, Fanout([outcomes]))
        await proxy.start()
        behind = "the SGLang router (PD mode) in front of" if has_router else "(sglang-router not installed)"
        print(f"simulated engine: prefill {dep.prefill.url}, decode {dep.decode.url}")
        print(f"traceproxy:       http://127.0.0.1:{proxy.port} -> {upstream} {behind} the workers\n")
        rows, mismatches = [], 0
        for scenario in SCENARIOS:
            verdict, trace_id = await _run_scenario(scenario, dep, proxy, outcomes, has_router)
            matches = verdict == scenario.expected or verdict.startswith("skipped")
            mismatches += not matches
            rows.append((scenario.name, scenario.fault or "-", scenario.expected, verdict,
                         "yes" if matches else "NO", trace_id))
        await proxy.shutdown(grace=1)
    _print_table(rows)
    print(f"\nspans (OTLP/JSON lines): {SPANS}\naccess log (JSON lines): {ACCESS_LOG}")
    print("look one up: traceproxy diagnose <trace id>")
    return 1 if mismatches else 0


def _print_table(rows) -> None:
    header = ("scenario", "injected fault", "expected", "traceproxy said", "match", "trace id")
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, tuple("-" * w for w in widths), *rows):
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())


def run_demo() -> int:
    started = time.monotonic()
    try:
        code = uvloop.run(_demo())
    except KeyboardInterrupt:  # what it started is stopped as _demo unwinds
        print("demo interrupted", file=sys.stderr)
        return 130
    print(f"demo finished in {time.monotonic() - started:.1f} s")
    return code
