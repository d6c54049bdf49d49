"""The running half of ``traceproxy demo``: the stack it starts and how each scenario drives it.

Theory of operation
-------------------
``run_stack`` starts a ``SimDeployment`` (workers, and the router asked for, else
the first one installed) and one traceproxy in front of it, with stall thresholds of a second so
that every stall shows within the run. The workers export SGLang's request spans over
OTLP/gRPC to the proxy's engine span receiver (``engines.otlp_receiver_grpc``, a free
loopback port chosen before either starts), which relays them to the span file.

The scenarios that share the stack (``Scenario.shares_the_stack``: no fault on a
worker) run at once, then each of the others alone. Each scenario sets its sim fault on
the worker it acts on, or carries it in its request's body, drives requests one of six
ways (``demo.HARNESS`` ...), and gives back what traceproxy said: the live verdict of the
request it asked about (from ``/debug/inflight``, while the request still hangs), or the
outcome the request ended with (from an observer on the proxy). Faults are cleared and
held requests let go after each scenario run alone, and after those run at once.

The component column: ``StallWatch`` asks ``/debug/inflight`` every ``POLL`` while the
scenarios run and keeps, per trace, the ``engine_stage`` of the last answer that had the
request stalled; a scenario's cell is its request's (a PD stall reads its own entry).

The pool scenario needs a proxy with one pooled connection: it starts a second
traceproxy from the same settings with ``pool.max_connections = 1`` and no engine span
receiver (the first one has its port), writing to the same span file and access log,
and stops it after the scenario, so the stack left running is not capped.

The client scenarios are raw sockets run in a worker thread: the proxy runs on this
event loop, so nothing here may block it. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

from .app import ProxyServer
from .config import Settings, default_settings
from .demo import (ENGINE_STALL, HARNESS, HARNESS_VIA_FAULTY_PROXY, LEAVE_MID_STREAM, NOT_REACHED_TEXT, POOL_AT_CAP,
                   SIM_MODEL, STOP_MID_BODY, Row, Said, Scenario, Where, codes_shown, data_paths, engine_stage_lines,
                   expectation, files_lines, legend_lines, note_lines, running_lines, stopped_lines, table_lines,
                   verdict_words)
from .diagnose_engines import stage_from_dict
from .lifecycle.flags import BY_CODE, Flag
from .lifecycle.hooks import Fanout
from .lifecycle.timeline import RequestRecord
from .repro.harness import HUNG, OK, REUSED, run_repro
from .repro.inflight import IN_FLIGHT, NOT_REACHED, AdminError, Diagnosis, ask_proxy, fetch_inflight, from_entry
from .sim.faultyproxy import FaultyProxy
from .ports import free_port
from .sim.launch import SimDeployment, resolve_router, router_importable
from .sim.routers import ROUTER_NAMES, RouterKind

STALL_AFTER = 1.0  # every stall threshold of the demo's proxy, in seconds
TURN_TIMEOUT = 2.5  # the harness gives up on a turn after this long (past STALL_AFTER)
LIVE_VERDICT_WAIT = STALL_AFTER + 4.0  # for a stall to be declared, with room for a loaded machine
OUTCOME_WAIT = 2.0  # for a finished request's outcome to reach the observer
POLL = 0.1
READ_SIZE = 65536
MAX_READS = 10_000
FIRST_TOKEN = b"data: {"
STREAM_TOKENS = 64  # long enough (0.6 s at the sim's 100 tokens/s) to be left in the middle
FAULTY_PROXY_TURNS = 2  # the faulty proxy left running answers two turns per connection, then swallows one


class Outcomes:
    """Every finished request's outcome, by its request id (a proxy observer)."""

    def __init__(self) -> None:
        self.by_request_id: dict[str, RequestRecord] = {}

    def on_done(self, record: RequestRecord) -> None:
        self.by_request_id[record.request_id] = record

    async def wait_for(self, request_ids: list[str], timeout: float = OUTCOME_WAIT) -> None:
        for _ in range(int(timeout / POLL) + 1):
            if all(rid in self.by_request_id for rid in request_ids):
                return
            await asyncio.sleep(POLL)


class Stack:
    """What the scenarios drive: the deployment, the proxy in front of it, and its outcomes."""

    def __init__(self, deployment: SimDeployment, proxy: ProxyServer, outcomes: Outcomes,
                 router_asked: str | None = None) -> None:
        self.deployment, self.proxy, self.outcomes = deployment, proxy, outcomes
        self.router_asked = router_asked  # --router NAME, or None for the default
        self.run_token = secrets.token_hex(3)  # request ids stay unique across runs sharing a span file
        # Set as the stack stops (Ctrl-C, SIGTERM): the clients in threads stop asking the
        # proxy at once, since the loop's end waits for its threads.
        self.stopping = threading.Event()

    @property
    def router(self) -> RouterKind | None:
        return self.deployment.router_kind

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.proxy.port}"

    @property
    def admin(self) -> str:
        return f"127.0.0.1:{self.proxy.admin_port}"

    def request_id(self, scenario: Scenario, role: str) -> str:
        return f"demo-{self.run_token}-{scenario.key}-{role}"

    def where(self, faulty_proxy: FaultyProxy | None = None) -> Where:
        spans, access_log = (Path(p) for p in (self.proxy.settings.tracing.file_path,
                                               self.proxy.settings.access_log.path))
        return Where(self.url, self.admin, spans, access_log, self.deployment.decode.url,
                     faulty_proxy.url if faulty_proxy else None, FAULTY_PROXY_TURNS, self.router_asked)


def proxy_settings(upstream: str, spans: Path, access_log: Path, receiver_port: int | None = None) -> Settings:
    """The demo's proxy; with ``receiver_port``, its OTLP/gRPC engine span receiver there."""
    receiver = {"engines.otlp_receiver_grpc": f"127.0.0.1:{receiver_port}"} if receiver_port else {}
    return default_settings().replace(**{
        "listen": "127.0.0.1:0", "admin": "127.0.0.1:0", "upstream": upstream,
        "tracing.exporter": "file", "tracing.file_path": str(spans), "access_log.path": str(access_log),
        "stall.first_byte": STALL_AFTER, "stall.stream_gap": STALL_AFTER, "stall.client_body": STALL_AFTER,
        "stall.pool_wait": STALL_AFTER, **receiver,
    })


async def run_stack(scenarios: tuple[Scenario, ...], keep_running: bool, router: str | None = None) -> int:
    """Start the stack, run the scenarios, print the report; 0 when every verdict matched.
    ``router``: the router's name; None for the first installed (none: the decode worker alone)."""
    spans, access_log = data_paths()
    outcomes = Outcomes()
    wanted_router = router or router_importable()  # a name, the first installed, or none
    signals = StopSignals()
    # SIGTERM (kill, a supervisor) stops the demo as Ctrl-C does: the main task is
    # cancelled, so everything started is stopped as it unwinds. Left to the default
    # action, the router, in its own session, would outlive the demo.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    # The proxy starts first, its upstream's port chosen ahead, so that its engine span
    # receiver listens before the workers export their first span (the router's warm-up
    # request) and still listens when they flush their last, as the deployment stops.
    upstream_port, receiver_port = free_port(), free_port()
    routed = bool(wanted_router) and resolve_router(wanted_router) is not None
    upstream = f"http://127.0.0.1:{upstream_port}"
    proxy = ProxyServer(proxy_settings(upstream, spans, access_log, receiver_port), Fanout([outcomes]))
    await proxy.start()
    try:
        async with SimDeployment(router=wanted_router, request_timeout=20, otlp_endpoint=f"127.0.0.1:{receiver_port}",
                                 **{"router_port" if routed else "decode_port": upstream_port}) as deployment:
            stack = Stack(deployment, proxy, outcomes, router)
            where = stack.where()  # the addresses are gone once the proxy stops
            _print_header(stack, upstream, receiver_port)
            try:
                said = await _run_scenarios(scenarios, stack)
            finally:
                stack.stopping.set()
            rows = [Row(scenario, said[scenario.key], expectation(scenario, stack.router)) for scenario in scenarios]
            _print(*table_lines(rows), *engine_stage_lines(rows), *note_lines(rows, stack.router), "", "legend:",
                   *legend_lines(codes_shown(rows)), "", *files_lines(where))
            if keep_running:
                signals.catch()  # until everything has stopped, not only until the first signal
                await _keep_running(stack, rows, signals.received)
    finally:
        try:
            await proxy.shutdown(grace=1)
        finally:
            signals.release()
    if not keep_running:
        _print(*stopped_lines(rows, where))
    return 0 if all(row.matches for row in rows) else 1


def _print_header(stack: Stack, upstream: str, receiver_port: int) -> None:
    dep, kind = stack.deployment, stack.router
    behind = (f"{kind.name} {kind.version} (PD mode) in front of the workers" if kind is not None else
              f"the decode worker (no router installed: pip install one of {', '.join(ROUTER_NAMES)})")
    router = [f"router:           {dep.describe_router().removeprefix('router ')}"] if kind is not None else []
    _print(f"simulated engine: prefill {dep.prefill.url}, decode {dep.decode.url}", *router,
           f"traceproxy:       {stack.url} -> {upstream}, {behind}",
           f"engine spans:     the workers export SGLang's request spans (OTLP/gRPC) to traceproxy's receiver "
           f"127.0.0.1:{receiver_port}, relayed to the span file",
           f"admin:            http://{stack.admin} (/healthz, /metrics, /debug/inflight)", "")


def _print(*lines: str) -> None:
    print("\n".join(lines), flush=True)


async def _keep_running(stack: Stack, rows: list[Row], stop: asyncio.Event) -> None:
    faulty = await FaultyProxy(stack.url, hang_after=FAULTY_PROXY_TURNS).start()
    try:
        _print("", *running_lines(rows, stack.where(faulty)))
        await stop.wait()
    finally:
        await faulty.stop()
    _print("stopping the stack")


class StopSignals:
    """From ``catch()`` to ``release()``, SIGINT (Ctrl-C) and SIGTERM set ``received``
    instead of interrupting. Held while the stack stops too: a second Ctrl-C there
    would cut the stopping short and could leave the router running."""

    def __init__(self) -> None:
        self.received = asyncio.Event()
        self._caught: tuple[signal.Signals, ...] = ()

    def catch(self) -> None:
        loop = asyncio.get_running_loop()
        self._caught = (signal.SIGINT, signal.SIGTERM)
        for sig in self._caught:
            loop.add_signal_handler(sig, self.received.set)

    def release(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self._caught:
            loop.remove_signal_handler(sig)
        self._caught = ()


# ----------------------------------------------------------------------------------
# The scenarios: those that share the stack at once, then the others one at a time
# ----------------------------------------------------------------------------------
async def _run_scenarios(scenarios: tuple[Scenario, ...], stack: Stack) -> dict[str, Said]:
    together = [scenario for scenario in scenarios if scenario.shares_the_stack]
    said: dict[str, Said] = {}
    async with StallWatch(stack.admin) as watch:
        if together:
            try:
                answers = await asyncio.gather(*(_drive(scenario, stack) for scenario in together))
            finally:
                await _let_go(stack)
            said.update((scenario.key, answer) for scenario, answer in zip(together, answers))
        for scenario in scenarios:
            if scenario.key not in said:
                said[scenario.key] = await _run_alone(scenario, stack)
    return {key: watch.placed(answer) for key, answer in said.items()}


async def _drive(scenario: Scenario, stack: Stack) -> Said:
    if scenario.needs_router and stack.router is None:
        return Said("skipped (needs a router)")
    return await DRIVES[scenario.drive](scenario, stack)


async def _run_alone(scenario: Scenario, stack: Stack) -> Said:
    dep = stack.deployment
    worker = dep.prefill if scenario.role == "prefill" else dep.decode
    worker.set_faults([scenario.fault] if scenario.fault else [])
    try:
        return await _drive(scenario, stack)
    finally:
        worker.set_faults([])
        await _let_go(stack)


async def _let_go(stack: Stack) -> None:
    await stack.deployment.prefill.release_held()
    await stack.deployment.decode.release_held()


class StallWatch:
    """Asks the proxy's ``/debug/inflight`` every ``POLL`` and keeps, per trace id, the
    ``engine_stage`` of the last answer that had the request stalled: where the engines
    held it when traceproxy declared the stall, for the table's component column."""

    def __init__(self, admin: str) -> None:
        host, _, port = admin.rpartition(":")
        self.admin = (host, int(port))
        self.stalled: dict[str, dict] = {}
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "StallWatch":
        self._task = asyncio.get_running_loop().create_task(self._watch())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass

    async def _watch(self) -> None:
        while True:
            try:
                entries = await asyncio.to_thread(fetch_inflight, self.admin)
            except AdminError:
                entries = []
            for entry in entries:
                stage = entry.get("engine_stage")
                if stage and (entry.get("verdict") or {}).get("stalled") and entry.get("trace_id"):
                    self.stalled[entry["trace_id"]] = stage
            await asyncio.sleep(POLL)

    def placed(self, said: Said) -> Said:
        """``said`` with the component of its request's stall, when the watch saw one and it has none yet."""
        stage = self.stalled.get(said.trace_id)
        if said.component != "-" or stage is None:
            return said
        return replace(said, component=stage["component"], engine_stage=stage_words(stage))


def stage_words(stage: dict) -> str:
    """An ``engine_stage`` object in the words of the stall log line:
    ``kv_transfer (prefill prefill_transfer_kv_cache, sglang host 1a2b3c4d pid 12; from spans)``."""
    return stage_from_dict(stage).words()


async def _harness(scenario: Scenario, stack: Stack, url: str | None = None) -> Said:
    # The model the workers serve: smg routes by model and has no worker for another.
    result = await asyncio.to_thread(run_repro, url or stack.url, stack.admin, 1, 3, TURN_TIMEOUT, REUSED, None,
                                     model=SIM_MODEL, max_tokens=6)
    await stack.outcomes.wait_for([turn.request_id for turn in result.records if turn.status is not None])
    for turn in result.records:  # the first turn that did not end OK
        if turn.result == HUNG and turn.diagnosis is not None:
            return _said_live(turn.diagnosis, turn.trace_id)
        record = stack.outcomes.by_request_id.get(turn.request_id)
        if record is not None and not record.outcome.is_ok:
            return _said_ended(record)
        if turn.result != OK and record is None:
            return Said(turn.result, turn.trace_id or "-")
    last = result.records[-1] if result.records else None
    trace_id = last.trace_id if last and last.trace_id else "-"
    return Said(verdict_words(Flag.OK), trace_id, Flag.OK) if result.exit_code == 0 else Said("failed", trace_id)


async def _harness_via_faulty_proxy(scenario: Scenario, stack: Stack) -> Said:
    faulty = await FaultyProxy(stack.url, hang_after=1, seed=1).start()
    try:
        return await _harness(scenario, stack, faulty.url)
    finally:
        await faulty.stop()


async def _leave_mid_stream(scenario: Scenario, stack: Stack) -> Said:
    request_id = stack.request_id(scenario, "client")
    if not await asyncio.to_thread(leave_after_first_token, stack.proxy.port, request_id):
        return Said(f"no token within {TURN_TIMEOUT:g} s")
    await stack.outcomes.wait_for([request_id])
    record = stack.outcomes.by_request_id.get(request_id)
    return _said_ended(record) if record is not None else Said("no outcome")


async def _stop_mid_body(scenario: Scenario, stack: Stack) -> Said:
    request_id = stack.request_id(scenario, "client")
    diagnosis = await asyncio.to_thread(send_half_the_body, stack.proxy.port, stack.admin, request_id,
                                        stack.stopping)
    return _said_live(diagnosis)


async def _pool_at_cap(scenario: Scenario, stack: Stack) -> Said:
    capped = ProxyServer(stack.proxy.settings.replace(**{"pool.max_connections": 1,
                                                         "engines.otlp_receiver_grpc": None}),
                         Fanout([stack.outcomes]))
    await capped.start()
    try:
        diagnosis = await asyncio.to_thread(wait_behind_a_held_stream, capped.port, f"127.0.0.1:{capped.admin_port}",
                                            stack.request_id(scenario, "holder"), stack.request_id(scenario, "waiter"),
                                            stack.stopping)
    finally:
        await capped.shutdown(grace=1)
    return _said_live(diagnosis)


async def _engine_stall(scenario: Scenario, stack: Stack) -> Said:
    request_id = stack.request_id(scenario, "client")
    entry = await asyncio.to_thread(hang_at_a_pd_stage, stack.proxy.port, stack.admin, request_id,
                                    scenario.request_fault, stack.stopping)
    if entry is None:
        return Said(NOT_REACHED_TEXT)
    said = _said_live(from_entry(entry))
    stage = entry.get("engine_stage")
    if not stage:
        return said
    return replace(said, component=stage["component"], engine_stage=stage_words(stage))


DRIVES = {HARNESS: _harness, HARNESS_VIA_FAULTY_PROXY: _harness_via_faulty_proxy,
          LEAVE_MID_STREAM: _leave_mid_stream, STOP_MID_BODY: _stop_mid_body, POOL_AT_CAP: _pool_at_cap,
          ENGINE_STALL: _engine_stall}


def _said_live(diagnosis: Diagnosis, trace_id: str | None = None) -> Said:
    """A verdict from the proxy's in-flight list, asked while the request hangs."""
    if diagnosis.kind == NOT_REACHED:
        return Said(NOT_REACHED_TEXT)
    if diagnosis.kind != IN_FLIGHT:
        return Said(diagnosis.kind.replace("_", " "), trace_id or "-")
    trace = diagnosis.trace_id or trace_id or "-"
    outcome = BY_CODE.get(diagnosis.outcome or "")
    if outcome is None:
        return Said(f"in phase {diagnosis.phase}, no verdict", trace)
    words = verdict_words(outcome)
    return Said(words if diagnosis.stalled else f"{words}, not yet stalled", trace, outcome)


def _said_ended(record: RequestRecord) -> Said:
    return Said(verdict_words(record.outcome), "%032x" % record.trace_id, record.outcome)


# ----------------------------------------------------------------------------------
# Misbehaving clients (blocking: run them in a thread)
# ----------------------------------------------------------------------------------
def chat_request(request_id: str, max_tokens: int = STREAM_TOKENS) -> tuple[bytes, bytes]:
    """(head, body) of a streaming chat turn carrying its own request id."""
    body = json.dumps({"model": SIM_MODEL, "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "Write a long story."}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nx-request-id: {request_id}\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode(), body


def read_until(sock: socket.socket, marker: bytes, timeout: float = TURN_TIMEOUT) -> bool:
    """Read until ``marker`` has arrived; False at the deadline or when the peer closes."""
    seen, deadline = b"", time.monotonic() + timeout
    for _ in range(MAX_READS):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        sock.settimeout(remaining)
        try:
            data = sock.recv(READ_SIZE)
        except OSError:
            return False
        if not data:
            return False
        seen = seen[-len(marker):] + data
        if marker in seen:
            return True
    return False


def leave_after_first_token(port: int, request_id: str) -> bool:
    """A harness that leaves mid-stream: it reads the first token and closes."""
    head, body = chat_request(request_id)
    with socket.create_connection(("127.0.0.1", port), timeout=TURN_TIMEOUT) as sock:
        sock.sendall(head + body)
        return read_until(sock, FIRST_TOKEN)


def send_half_the_body(port: int, admin: str, request_id: str, stopping: threading.Event) -> Diagnosis:
    """A harness that stops sending its request body half way; the verdict once it stalls."""
    head, body = chat_request(request_id)
    with socket.create_connection(("127.0.0.1", port), timeout=TURN_TIMEOUT) as sock:
        sock.sendall(head + body[: len(body) // 2])
        return await_stall(admin, request_id, stopping)


def wait_behind_a_held_stream(port: int, admin: str, holder_id: str, waiter_id: str,
                              stopping: threading.Event) -> Diagnosis:
    """One stream takes the pool's only connection and the engine stalls it; a second
    request waits for that connection. The waiter's verdict once it stalls."""
    with socket.create_connection(("127.0.0.1", port), timeout=TURN_TIMEOUT) as holder:
        holder.sendall(b"".join(chat_request(holder_id)))
        if not read_until(holder, FIRST_TOKEN):  # streaming: the connection is surely taken
            return Diagnosis("unknown", "the stream meant to hold the pool's connection never started")
        with socket.create_connection(("127.0.0.1", port), timeout=TURN_TIMEOUT) as waiter:
            waiter.sendall(b"".join(chat_request(waiter_id)))
            return await_stall(admin, waiter_id, stopping)


def completion_request(request_id: str, fault: str) -> bytes:
    """A streaming completion whose body carries its own sim fault: a top-level ``sim_fault``
    on /v1/completions is the one every router passes on (see ``sim.faults``)."""
    body = json.dumps({"model": SIM_MODEL, "prompt": "Say hello.", "stream": True, "max_tokens": 8,
                       "sim_fault": fault}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nx-request-id: {request_id}\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


def hang_at_a_pd_stage(port: int, admin: str, request_id: str, fault: str, stopping: threading.Event,
                       timeout: float = LIVE_VERDICT_WAIT) -> dict | None:
    """Send a request its fault hangs in one PD stage; its in-flight entry once it has stalled
    and the engines' spans name its stage (else the last one seen at the deadline; None when
    it never reached the proxy). The client then leaves, before the workers let go, so that
    no router resends it."""
    host, _, admin_port = admin.rpartition(":")
    entry, deadline = None, time.monotonic() + timeout
    with socket.create_connection(("127.0.0.1", port), timeout=TURN_TIMEOUT) as sock:
        sock.sendall(completion_request(request_id, fault))
        for _ in range(int(timeout / POLL) + 1):
            try:
                entry = next((e for e in fetch_inflight((host, int(admin_port)))
                              if e.get("request_id") == request_id), entry)
            except AdminError:
                pass
            if entry is not None and _stalled_and_placed(entry) or time.monotonic() > deadline or stopping.is_set():
                break
            time.sleep(POLL)
    return entry


def _stalled_and_placed(entry: dict) -> bool:
    stage = entry.get("engine_stage") or {}
    return bool((entry.get("verdict") or {}).get("stalled") and stage.get("stage") and stage.get("source") == "spans")


def await_stall(admin: str, request_id: str, stopping: threading.Event,
                timeout: float = LIVE_VERDICT_WAIT) -> Diagnosis:
    """Ask the admin listener until the request is stalled, or the time is up, or the demo
    is stopping (the last answer)."""
    host, _, port = admin.rpartition(":")
    diagnosis, deadline = Diagnosis("unknown", "not asked"), time.monotonic() + timeout
    for _ in range(int(timeout / POLL) + 1):
        diagnosis = ask_proxy((host, int(port)), request_id, answered=False)
        if (diagnosis.kind == IN_FLIGHT and diagnosis.stalled) or time.monotonic() > deadline or stopping.is_set():
            break
        time.sleep(POLL)
    return diagnosis
