"""``traceproxy demo``: the quick start, with nothing else running.

Starts the simulated prefill and decode workers behind a real router in PD mode
(``--router sglang-router|smg|vllm-router``; by default the first of these installed,
and without any the decode worker alone), traceproxy in front with spans to the
local file, and the repro harness; then runs the scenarios and prints each against
the verdict traceproxy gave, with the trace ids, a legend for every outcome code shown,
and where the spans and the access log are. The scenarios that set no fault on a
worker (their faults, if any, ride in their requests' bodies) run at once, on the one
stack; each of the others runs alone, since its fault reaches every request. The scenarios put the hang on
each side in turn: the engine (injected sim faults), the client (a harness that leaves
mid-stream, one that stops sending its body), the proxy (its pool at its connection
cap), and in front of traceproxy: a faulty client-side keep-alive proxy that stops
forwarding on reused connections, the story traceproxy was born from. Its verdict is
that the request never reached traceproxy.

Inside the engine, behind a router: the workers export SGLang's request spans to
traceproxy's own engine span receiver, and three scenarios hang a request in one PD
stage each (the handshake, the KV transfer, decode's wait for the KV cache). The
table's component column is the PD component traceproxy named live for the stalled
request (``engine_stage`` in ``/debug/inflight``), and a list under it gives the SGLang
stage and worker with it.

Where routers differ, so does what the table expects (``expectation``, from each
router's observed behaviour in ``sim.routers``), and a line under the table says what
the router made of the scenario: vllm-router never calls decode while prefill hangs,
and drops a silent decode when its client leaves; smg reports decode's failure inside
a clean stream (an SSE error event, then ``[DONE]``), which is still an engine failure.

Everything it starts it stops: at once, or with ``--keep-running`` when it gets
Ctrl-C (or SIGTERM), after printing the commands (curl, repro, top, diagnose) that
work against the stack it leaves up, with its real addresses.

This module is the command and everything it prints, and imports little, so that
building the CLI stays cheap; ``demo_stack`` starts and drives the stack.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from .lifecycle.flags import BY_CODE, Blame, Flag, Outcome
from .repro.report import diagnose_command
from .sim.routers import ROUTER_NAMES, RouterKind, router_kind

DATA_DIR = "traceproxy-data"
SIM_MODEL = "sim-llama"  # the model the simulated workers serve
NOT_REACHED_TEXT = "never reached the proxy"
USAGE_EXIT = 2
INTERRUPTED_EXIT = 130
TERMINATED_EXIT = 143  # 128 + SIGTERM, as a shell reports it

# How a scenario is driven (``demo_stack`` has one coroutine for each).
HARNESS = "harness"  # the repro harness, on reused connections, straight to traceproxy
HARNESS_VIA_FAULTY_PROXY = "harness_via_faulty_proxy"  # the same, through a faulty proxy in front of traceproxy
LEAVE_MID_STREAM = "leave_mid_stream"  # a client that closes after the first token
STOP_MID_BODY = "stop_mid_body"  # a client that sends half its body and goes quiet
POOL_AT_CAP = "pool_at_cap"  # a traceproxy with one pooled connection, held by a stalled stream
ENGINE_STALL = "engine_stall"  # one streaming request whose body carries its sim fault, asked about until it stalls


@dataclass(frozen=True)
class Scenario:
    key: str  # what --scenario names
    title: str
    drive: str
    expected: Outcome | None  # None: the request never reaches traceproxy
    fault: str | None = None  # a sim fault spec, set on the worker it acts on
    role: str = "decode"  # the worker the fault is set on: "prefill" or "decode"
    injected: str | None = None  # what the table says was done, when it is not a sim fault
    needs_router: bool = False
    request_fault: str | None = None  # a sim fault carried in the request's own body (no worker-wide fault)
    component: str | None = None  # the PD component traceproxy should name for the stalled request

    @property
    def injected_text(self) -> str:
        return self.injected or self.fault or self.request_fault or "-"

    @property
    def shares_the_stack(self) -> bool:
        """Whether it can run at the same time as the other such scenarios: it sets no
        fault on a worker (which would reach every request) and starts no proxy of its own."""
        return self.fault is None and self.drive != POOL_AT_CAP



SCENARIOS = (
    Scenario("healthy", "healthy turns on reused connections", HARNESS, Flag.OK),
    Scenario("prefill-stall", "prefill never finishes", ENGINE_STALL, Flag.FBS, role="prefill", needs_router=True,
             request_fault="prefill_stall", component="prefill"),
    Scenario("decode-stall", "decode stops after 3 tokens", ENGINE_STALL, Flag.MSS, request_fault="decode_stall:3",
             component="decode"),
    Scenario("bootstrap-stall", "PD handshake never completes", ENGINE_STALL, Flag.FBS, role="prefill",
             needs_router=True, request_fault="bootstrap_stall", component="bootstrap"),
    Scenario("kv-transfer-stall", "KV transfer never completes", ENGINE_STALL, Flag.FBS, role="prefill",
             needs_router=True, request_fault="kv_transfer_stall", component="kv_transfer"),
    Scenario("decode-waiting-stall", "decode never gets the KV cache", ENGINE_STALL, Flag.FBS, needs_router=True,
             request_fault="decode_waiting_stall", component="kv_transfer"),
    Scenario("no-done", "stream ends without [DONE]", HARNESS, Flag.NDN, "no_done"),
    Scenario("decode-reset", "decode resets mid-stream", HARNESS, Flag.UC, "reset_mid_stream:3"),
    Scenario("client-leaves", "harness leaves mid-stream", LEAVE_MID_STREAM, Flag.DC,
             injected="closes after 1st token"),
    Scenario("client-body-stall", "harness stops sending its body", STOP_MID_BODY, Flag.DBS,
             injected="half the body, then quiet"),
    Scenario("pool-cap", "pool full: a stalled stream holds it", POOL_AT_CAP, Flag.PWS, "decode_stall:1",
             injected="max_connections=1, decode_stall:1"),
    Scenario("faulty-proxy", "faulty proxy in front, reused conns", HARNESS_VIA_FAULTY_PROXY, None,
             injected="faulty keep-alive proxy"),
)
BY_KEY = {scenario.key: scenario for scenario in SCENARIOS}


def verdict_words(outcome: Outcome) -> str:
    """``FBS engine``: an outcome's code and the side it blames, as the table shows them."""
    return outcome.code if outcome.blame is Blame.NONE else f"{outcome.code} {outcome.blame.value}"


@dataclass(frozen=True)
class Said:
    """What traceproxy said about a scenario: the table's verdict and trace id cells, the
    outcome the verdict names, if it names one, and where the engines held the request
    when it stalled (``component``, the column; ``engine_stage``, its words in full)."""

    text: str
    trace_id: str = "-"
    outcome: Outcome | None = None
    component: str = "-"
    engine_stage: str = ""


@dataclass(frozen=True)
class Expectation:
    """What a scenario should get behind one router: this verdict (``outcome``), or any
    failure blamed on one side (``failure_of``), or, with neither, a request that never
    reaches traceproxy; and what the router makes of the scenario where routers differ."""

    outcome: Outcome | None = None
    failure_of: Blame | None = None
    note: str = ""
    if_said_ok: str = ""  # added to the note when traceproxy took this failure for a success
    component: str | None = None  # the PD component the stalled request must be named by, when one is

    @property
    def text(self) -> str:
        if self.outcome is not None:
            return verdict_words(self.outcome)
        if self.failure_of is not None:
            return f"{self.failure_of.value} failure"
        return NOT_REACHED_TEXT

    def met_by(self, said: Said) -> bool:
        if self.component is not None and said.component != self.component:
            return False
        if self.failure_of is None:
            return said.text == self.text
        # A final or stalled verdict (not "..., not yet stalled") of a failure blamed on that side.
        outcome = said.outcome
        return (outcome is not None and not outcome.is_ok and outcome.blame is self.failure_of
                and said.text == verdict_words(outcome))


def expectation(scenario: Scenario, router: RouterKind | None) -> Expectation:
    """The scenario's expectation behind ``router`` (None: the decode worker alone), from
    the router's observed behaviour (``sim.routers``)."""
    plain = Expectation(scenario.expected, component=scenario.component)
    vary = _BEHIND_A_ROUTER.get(scenario.key)
    return vary(router, plain) if vary is not None and router is not None else plain


def _prefill_stall(router: RouterKind, plain: Expectation) -> Expectation:
    if router.decode_waits_for_prefill:
        return replace(plain, note=f"{router.name} calls decode only once prefill has answered: decode is never "
                       "called; the request waits in prefill")
    return replace(plain, note=f"{router.name} sends prefill and decode the request at once: decode waits for "
                   "the prefill's KV cache")


def _decode_stall(router: RouterKind, plain: Expectation) -> Expectation:
    if router.behaviour.cancels_silent_decode:
        return replace(plain, note=f"when its client leaves, {router.name} drops the silent decode at once")
    return replace(plain, note=f"when its client leaves, {router.name} keeps the silent decode running until it "
                   "sends something (here the demo releases it)")


def _decode_reset(router: RouterKind, plain: Expectation) -> Expectation:
    if router.behaviour.reports_stream_errors_in_band:
        return Expectation(failure_of=Blame.ENGINE, note=(
            f"{router.name} {router.version} reports decode's reset inside a clean stream: an SSE error event, "
            "then [DONE] and a proper end; that is still an upstream failure, blamed on the engine"),
            if_said_ok="traceproxy said OK: it took the in-band error event for a success")
    return replace(plain, note=f"{router.name} cuts the client's stream when decode's connection goes")


_BEHIND_A_ROUTER = {"prefill-stall": _prefill_stall, "decode-stall": _decode_stall, "pool-cap": _decode_stall,
                    "decode-reset": _decode_reset}


@dataclass(frozen=True)
class Row:
    scenario: Scenario
    said: Said
    expected: Expectation

    @property
    def matches(self) -> bool:
        return self.expected.met_by(self.said) or self.skipped

    @property
    def skipped(self) -> bool:
        return self.said.text.startswith("skipped")

    @property
    def note(self) -> str:
        said_ok = self.said.outcome is not None and self.said.outcome.is_ok
        if said_ok and self.expected.if_said_ok and not self.matches:
            return f"{self.expected.note}. {self.expected.if_said_ok}"
        return self.expected.note

    @property
    def component_missed(self) -> bool:
        """The verdict is right but the stalled request was not named by the component expected."""
        expected = self.expected.component
        return (expected is not None and self.said.component != expected and not self.skipped
                and replace(self.expected, component=None).met_by(self.said))

    def cells(self) -> tuple[str, ...]:
        return (self.scenario.title, self.scenario.injected_text, self.expected.text, self.said.text,
                self.said.component, "yes" if self.matches else "NO", self.said.trace_id)


@dataclass(frozen=True)
class Where:
    """The stack's addresses and files, as the printed commands need them."""

    proxy_url: str
    admin: str  # HOST:PORT
    spans: Path  # absolute
    access_log: Path  # absolute
    decode_url: str
    faulty_proxy_url: str | None = None  # only while the stack keeps running
    faulty_proxy_turns: int = 0  # answered turns per connection before it swallows one
    router: str | None = None  # the --router the demo was given, to offer the same run again


def data_paths(folder: Path | None = None) -> tuple[Path, Path]:
    """(spans file, access log), absolute, so the commands printed work from any folder."""
    data = (folder or Path.cwd()).resolve() / DATA_DIR
    return data / "spans.jsonl", data / "access.log"


# ----------------------------------------------------------------------------------
# What it prints
# ----------------------------------------------------------------------------------
def table_lines(rows: list[Row]) -> list[str]:
    header = ("scenario", "injected", "expected", "traceproxy said", "component", "match", "trace id")
    body = [row.cells() for row in rows]
    widths = [max(len(cells[i]) for cells in (header, *body)) for i in range(len(header))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()
            for cells in (header, tuple("-" * w for w in widths), *body)]


def note_lines(rows: Iterable[Row], router: RouterKind | None) -> list[str]:
    """What the router makes of the scenarios shown, where routers differ."""
    notes = [f"  {row.scenario.title}: {row.note}" for row in rows if row.note and not row.skipped]
    return ["", f"behind {router.name} {router.version}:", *notes] if notes else []


def engine_stage_lines(rows: Iterable[Row]) -> list[str]:
    """Where the engines held each stalled request, as traceproxy named it live: the
    component column's words in full (SGLang stage, worker), and any component missed."""
    lines = []
    for row in rows:
        if row.said.engine_stage:
            lines.append(f"  {row.scenario.title}: {row.said.engine_stage}")
        if row.component_missed:
            lines.append(f"  {row.scenario.title}: expected component {row.expected.component}, "
                         f"traceproxy named {row.said.component}")
    return ["", "where the engines held each stalled request (engine_stage, named live from the engines' spans):",
            *lines] if lines else []


def codes_shown(rows: Iterable[Row]) -> list[str]:
    """Every outcome code in the table's expected and said columns, in order of appearance."""
    codes: dict[str, None] = {}
    for row in rows:
        for outcome in (row.expected.outcome, row.said.outcome):
            if outcome is not None:
                codes.setdefault(outcome.code)
    return list(codes)


def legend_lines(codes: Iterable[str]) -> list[str]:
    """One line per code, from the flag table itself."""
    lines = []
    for code in codes:
        outcome = BY_CODE[code]
        blame = "" if outcome.blame is Blame.NONE else f", blame {outcome.blame.value}"
        lines.append(f"  {code:<4} {outcome.name}{blame}: {outcome.meaning}")
    return lines


def example_trace_id(rows: Iterable[Row]) -> str | None:
    """A trace id from the table worth looking up: the first of a request that went wrong."""
    traced = [row for row in rows if row.said.trace_id != "-"]
    wrong = [row for row in traced if row.said.outcome not in (None, Flag.OK)]
    return (wrong or traced)[0].said.trace_id if traced else None


def fault_command(where: Where, faults: list[str]) -> str:
    return (f"curl -s {where.decode_url}/admin/faults -H 'Content-Type: application/json' "
            f"-d {shlex.quote(json.dumps({'faults': faults}))}")


def repro_command(where: Where, url: str | None = None) -> str:
    # The model the workers serve: smg routes by model and answers 503 for another.
    return f"traceproxy repro --url {url or where.proxy_url} --admin {where.admin} --model {SIM_MODEL}"


def curl_command(where: Where) -> str:
    body = {"model": SIM_MODEL, "stream": True, "max_tokens": 8,
            "messages": [{"role": "user", "content": "Say hello."}]}
    return (f"curl -sN {where.proxy_url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d {shlex.quote(json.dumps(body))}")


def files_lines(where: Where) -> list[str]:
    return [f"spans (OTLP/JSON lines): {where.spans}", f"access log (JSON lines): {where.access_log}"]


def stopped_lines(rows: list[Row], where: Where) -> list[str]:
    """After a run that stopped its stack: what still works (the span file)."""
    lines = []
    trace_id = example_trace_id(rows)
    if trace_id is not None:
        lines += ["look a request up (from any folder):", f"  {diagnose_command(trace_id, str(where.spans))}"]
    # The same scenarios again, kept running: a run of some scenarios offers those.
    chosen = "" if len(rows) == len(SCENARIOS) else "".join(f" --scenario {row.scenario.key}" for row in rows)
    if where.router is not None:
        chosen = f" --router {where.router}{chosen}"
    return lines + ["the stack is stopped; to leave it up for curl, repro and top: "
                    f"traceproxy demo{chosen} --keep-running"]


def running_lines(rows: list[Row], where: Where) -> list[str]:
    """While the stack keeps running: the commands that work against it, with its real addresses."""
    lines = ["the stack keeps running until Ctrl-C (or SIGTERM); from another terminal:",
             f"  {curl_command(where)}",
             f"  {repro_command(where)}",
             f"  traceproxy top --admin {where.admin}"]
    trace_id = example_trace_id(rows)
    if trace_id is not None:
        lines.append(f"  {diagnose_command(trace_id, str(where.spans))}")
    lines += ["make decode stall after 3 tokens; repro then says where each turn is stuck (its phase, "
              "blame and outcome, the PD component, SGLang stage and worker that hold it, and the diagnose "
              "command for it), and top shows the stalls live while repro waits; then clear the fault:",
              f"  {fault_command(where, ['decode_stall:3'])}",
              f"  {repro_command(where)} --turn-timeout 5",
              f"  {fault_command(where, [])}"]
    if where.faulty_proxy_url is not None:
        lines += [f"the original hang: a faulty keep-alive proxy in front of traceproxy swallows the request after "
                  f"{where.faulty_proxy_turns} turns on a reused connection (fresh connections work):",
                  f"  {repro_command(where, where.faulty_proxy_url)} --turn-timeout 3"]
    return lines


# ----------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------
DESCRIPTION = (
    "The quick start: simulated prefill/decode workers behind a real router in PD mode (sglang-router, smg or "
    "vllm-router: --router), exporting SGLang's request spans to traceproxy's engine span receiver, traceproxy "
    "in front, and the scenarios, each hang placed on the engine (down to one PD stage: the handshake, the KV "
    "transfer, decode's wait for the KV cache), the client, the proxy, or in front of traceproxy; a table shows "
    "each against the verdict traceproxy gave and the PD component it named live, with trace ids and a legend "
    "of the outcome codes. Everything it starts it stops. "
    "Exit status: 0 when every verdict matched, 1 when one did not, 2 when the router asked for is not installed, "
    "130 when interrupted (Ctrl-C), 143 when stopped by SIGTERM."
)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.description = DESCRIPTION
    parser.add_argument("--keep-running", action="store_true",
                        help="after the table, leave the stack up until Ctrl-C (or SIGTERM) and print the curl, "
                        "repro, top and diagnose commands that work against it; then stop everything started")
    parser.add_argument("--scenario", action="append", choices=list(BY_KEY), default=None, metavar="NAME",
                        help=f"run only this scenario (repeatable; default: all): {', '.join(BY_KEY)}")
    parser.add_argument("--router", choices=ROUTER_NAMES, default=None,
                        help="the router in front of the workers (default: the first of these installed; "
                        "without any, the decode worker alone)")
    return parser


def selected_scenarios(keys: list[str] | None) -> tuple[Scenario, ...]:
    if not keys:
        return SCENARIOS
    wanted = set(keys)
    return tuple(scenario for scenario in SCENARIOS if scenario.key in wanted)


def run_demo(args: argparse.Namespace | None = None) -> int:
    """``traceproxy demo``; ``args`` from a parser given ``add_arguments`` (None: the defaults)."""
    import asyncio

    import uvloop

    from .demo_stack import run_stack
    from .sim.startup import SimStartError

    if args is None:
        args = add_arguments(argparse.ArgumentParser()).parse_args([])
    if args.router is not None and not router_kind(args.router).installed:
        print(f"traceproxy demo: --router {args.router}: not installed (pip install {args.router})", file=sys.stderr)
        return USAGE_EXIT
    started = time.monotonic()
    try:
        code = uvloop.run(run_stack(selected_scenarios(args.scenario), args.keep_running, args.router))
    except KeyboardInterrupt:  # what it started is stopped as run_stack unwinds
        print("demo interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
    except asyncio.CancelledError:  # SIGTERM, likewise
        print("demo stopped (SIGTERM)", file=sys.stderr)
        return TERMINATED_EXIT
    except SimStartError as exc:  # one line saying why, no traceback
        print(f"traceproxy demo: {exc}", file=sys.stderr)
        return 1
    print(f"demo finished in {time.monotonic() - started:.1f} s", flush=True)
    return code
