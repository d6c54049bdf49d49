"""``traceproxy bench``: run each scenario direct to the upstream and through each proxy, interleaved.

Targets (``--targets``): ``direct``, ``bare`` (traceproxy with tracing, the access log
and the admin listener off), ``proxy`` (the same, or ``--proxy-cmd``), ``proxy-traced``
(traceproxy with tracing over OTLP to a local sink process), ``proxy-logged``
(traceproxy with the access log to a file), ``proxy-receiver`` and ``proxy-receiver-grpc``
(``proxy`` with the engine span receiver on, OTLP/HTTP or OTLP/gRPC) and ``defaults``
(``serve`` as shipped). By default every one but ``proxy``, which is added when
``--proxy-cmd`` is given, and the receiver targets. ``--engine-span-load RATE`` has two
emulated SGLang workers export their spans during every run (see ``session``). Order
per scenario and rep: the targets in turn, rotated by one each rep, so they are measured
side by side in time. Prints a markdown table (with each proxy's CPU µs per request,
its exporter included), what tracing and the access log cost and what each observed
target costs against bare on stdout; ``--json`` writes the raw results. Exit status: 0 when it ran, 1 when a scenario had errors or
hangs through a proxy target but not direct (or a proxy died), 2 when it could not run.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import shutil
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from ..config import MAX_WORKERS, ConfigError
from . import report
from .procs import ChildError, Children
from .proxy_proc import BENCH_CHOSEN_KEYS, RECEIVER_KEYS, build_settings
from .scenarios import SCENARIOS, Scenario, select
from .session import Session

QUICK_SCALE = 0.25
MAX_SCALE = 100.0  # connection counts, rounds and durations times this must stay countable
MAX_REPS = 100  # a hundred interleaved reps of every scenario is hours already
MAX_LOAD_PROCS = 64
MAX_ENGINE_SPAN_LOAD = 5000.0  # requests a second per emulated worker; far past what one Python process sends


def build_parser() -> argparse.ArgumentParser:
    names = ", ".join(f"{s.name} ({s.title})" for s in SCENARIOS)
    parser = argparse.ArgumentParser(
        prog="traceproxy bench",
        description="Measure direct-to-upstream against through-the-proxy (plain, traced, logged, or receiving "
                    "the engines' spans) on this machine, in one run.",
        epilog=f"Scenarios: {names}.")
    parser.add_argument("--scenarios", metavar="S1,S2", help="comma-separated scenario names (default: all)")
    parser.add_argument("--scale", type=float, metavar="F",
                        help="multiply connection counts, rounds and durations (default 1, or %g with --quick)"
                        % QUICK_SCALE)
    parser.add_argument("--quick", action="store_true", help="a short smoke run (about 30 s)")
    parser.add_argument("--reps", type=int, default=1, metavar="N",
                        help=f"runs of each target per scenario, in rotated order, 1 to {MAX_REPS} (default 1)")
    parser.add_argument("--targets", metavar="T1,T2",
                        help=f"comma-separated, from {', '.join(report.TARGETS)} (default: "
                             f"{', '.join(report.DEFAULT_TARGETS)}, and proxy with --proxy-cmd)")
    parser.add_argument("--load-procs", type=int, default=1, metavar="N",
                        help=f"load generator processes, 1 to {MAX_LOAD_PROCS} (default 1)")
    parser.add_argument("--no-warmup", action="store_true",
                        help="skip the one unrecorded request per connection that warms the proxy's upstream pool")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="serve each in-tree proxy target with N worker processes, as serve --workers N "
                             "(default 1)")
    parser.add_argument("--scrape-every", type=float, default=0.0, metavar="SECONDS",
                        help="read each in-tree proxy's /metrics this often during every measured run, as "
                             "Prometheus would (default 0: not scraped)")
    parser.add_argument("--engine-span-load", type=float, default=0.0, metavar="REQ_PER_S",
                        help="during every measured run, two emulated SGLang workers (prefill and decode, the "
                             "simulator's spans in SGLang's shape: 9 and 25 spans a request) each export the spans "
                             "of this many requests a second, 64 spans an export request as SGLang's batch "
                             "processor sends them: to the target's receiver for proxy-receiver (OTLP/HTTP) and "
                             "proxy-receiver-grpc (OTLP/gRPC), to a discard sink for every other target, so each "
                             "target pays the emulated engines' own CPU alike and proxy-receiver against bare is "
                             "what receiving costs. S5's request rate is about 460 (default 0: off)")
    parser.add_argument("--json", metavar="PATH", help="write the raw results as JSON")
    parser.add_argument("--proxy-cmd", metavar="TEMPLATE",
                        help="benchmark this command as the 'proxy' target instead of traceproxy; {port} and "
                             "{upstream_port} are filled in, e.g. a config-templated nginx")
    parser.add_argument("--proxy-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a traceproxy settings override for the in-tree proxies, applied after the "
                             "target's own keys (repeatable; not listen, upstream or admin, which the bench "
                             "chooses)")
    return parser


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[Scenario]]:
    parser = build_parser()
    args = parser.parse_args(argv)
    factor = args.scale if args.scale is not None else (QUICK_SCALE if args.quick else 1.0)
    if not (math.isfinite(factor) and 0 < factor <= MAX_SCALE):
        parser.error(f"--scale must be a number > 0 and at most {MAX_SCALE:g}, got {factor:g}")
    if not 1 <= args.reps <= MAX_REPS:
        parser.error(f"--reps must be from 1 to {MAX_REPS}, got {args.reps}")
    if not 1 <= args.load_procs <= MAX_LOAD_PROCS:
        parser.error(f"--load-procs must be from 1 to {MAX_LOAD_PROCS}, got {args.load_procs}")
    if not 1 <= args.workers <= MAX_WORKERS:
        parser.error(f"--workers must be from 1 to {MAX_WORKERS}, got {args.workers}")
    if not (math.isfinite(args.scrape_every) and 0 <= args.scrape_every <= 3600):
        parser.error(f"--scrape-every must be seconds from 0 (off) to 3600, got {args.scrape_every:g}")
    if not (math.isfinite(args.engine_span_load) and 0 <= args.engine_span_load <= MAX_ENGINE_SPAN_LOAD):
        parser.error(f"--engine-span-load must be requests a second from 0 (off) to {MAX_ENGINE_SPAN_LOAD:g}, "
                     f"got {args.engine_span_load:g}")
    args.factor = factor
    try:
        # Given empty ('--targets ""'), a list names nothing: an error, never the defaults.
        args.targets = parse_targets(default_targets(args.proxy_cmd) if args.targets is None else args.targets)
        check_proxy_settings(args.proxy_set)
        check_proxy_cmd(args.proxy_cmd)
        check_json_path(args.json)
        return args, select(args.scenarios, factor)
    except ValueError as exc:
        parser.error(str(exc))


def check_proxy_cmd(template: str | None) -> None:
    """The ``--proxy-cmd`` template fills in now, with sample ports, as it will at the start."""
    if template is None:
        return
    try:
        argv = shlex.split(template.format(port=1, upstream_port=2))
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"--proxy-cmd {template!r}: only {{port}} and {{upstream_port}} are filled in, "
                         f"and a literal brace is written twice ({exc})") from None
    if not argv:
        raise ValueError("--proxy-cmd is empty")


def check_proxy_settings(items: list[str]) -> None:
    """``--proxy-set`` items checked now, as the proxy would read them, rather than
    once the run has started. What only starting can find (a log path it cannot
    write) the proxy process reports as a configuration error, and the bench stops."""
    for item in items:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--proxy-set {item!r}: expected KEY=VALUE, e.g. pool.idle_timeout=2")
        if key.strip() in RECEIVER_KEYS:
            raise ValueError(f"--proxy-set {item!r}: the engine span receivers are on in the proxy-receiver and "
                             "proxy-receiver-grpc targets, on ports the bench picks (its --engine-span-load "
                             "exports there); add one of those targets instead")
        if key.strip() in BENCH_CHOSEN_KEYS:
            raise ValueError(f"--proxy-set {item!r}: {key.strip()} is chosen by the bench for each target "
                             "(every in-tree target needs its own free port, in front of the bench's upstream)")
        try:
            build_settings("http://127.0.0.1:9", [item])
        except ConfigError as exc:
            raise ValueError(f"--proxy-set {item!r}: {exc}") from None


def check_json_path(path: str | None) -> None:
    """The results file's directory exists and is writable, before the run, not after it."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--json {path}: {folder} is not a writable directory")
    if os.path.isdir(path):
        raise ValueError(f"--json {path}: is a directory")
    # Permission bits do not tell (a read-only mount, /proc, root): open it, as the end will.
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ValueError(f"--json {path}: cannot write it ({exc.strerror or exc})") from None
    if not existed:
        os.remove(path)


def default_targets(proxy_cmd: str | None) -> str:
    return ",".join(t for t in report.TARGETS if t in report.DEFAULT_TARGETS or t == "proxy" and proxy_cmd)


def parse_targets(text: str) -> tuple[str, ...]:
    """Comma-separated target names, in the table's canonical order."""
    wanted = {t.strip().lower() for t in text.split(",") if t.strip()}
    unknown = sorted(wanted - set(report.TARGETS))
    if not wanted:
        raise ValueError(f"no target named in {text!r}; choose from {', '.join(report.TARGETS)}")
    if unknown:
        raise ValueError(f"unknown target {', '.join(unknown)}; choose from {', '.join(report.TARGETS)}")
    return tuple(t for t in report.TARGETS if t in wanted)


def run_order(targets: tuple[str, ...], rep: int) -> tuple[str, ...]:
    """The targets of one rep: rotated by one per rep, so none is always first or last."""
    k = rep % len(targets)
    return targets[k:] + targets[:k]


@contextmanager
def _terminate_as_exit():
    """SIGTERM/SIGHUP unwind like Ctrl-C, so every child is stopped on the way out."""

    def handler(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def run_scenarios(session: Session, scenarios: list[Scenario], reps: int,
                  targets: tuple[str, ...] = report.TARGETS) -> tuple[dict, list[str]]:
    """Every scenario, the targets interleaved; raw runs per scenario and target."""
    runs: dict[str, dict[str, list[dict]]] = {}
    problems: list[str] = []
    for scenario in scenarios:
        runs[scenario.name] = {t: [] for t in targets}
        for rep in range(reps):
            for target in run_order(targets, rep):
                if target != "direct" and not session.proxy_alive(target):
                    problems.append(f"{scenario.name}: the {target} process had exited; {target} run skipped")
                    continue
                started = time.monotonic()
                result = session.measure(scenario, target)
                runs[scenario.name][target].append(result)
                scraped = result.get("scrapes")
                scrapes = f", /metrics read {scraped['count']} times (p50 {scraped['p50_ms']} ms, max " \
                          f"{scraped['max_ms']} ms, {scraped['failed']} failed)" if scraped else ""
                _log(f"{scenario.name} {target} rep {rep + 1}: ok {result['ok']}, "
                     f"errors {sum(result['errors'].values())}, hangs {_hangs(result)} "
                     f"({time.monotonic() - started:.1f} s){scrapes}")
    return runs, problems


def summarize(scenarios: list[Scenario], runs: dict) -> dict[str, dict]:
    summary = {}
    for scenario in scenarios:
        by_target = runs[scenario.name]
        entry = {t: report.combine([report.figures(r) for r in results]) for t, results in by_target.items()}
        entry["error_kinds"] = {t: _error_kinds(results) for t, results in by_target.items()}
        entry["never_started"] = {t: _never_started(results) for t, results in by_target.items()}
        summary[scenario.name] = entry
    return summary


def _hangs(result: dict) -> str:
    """Hangs as the table counts them: requests never started within the time budget included."""
    total = result["hangs"] + result["skipped"]
    return f"{total} ({result['skipped']} never started)" if result["skipped"] else str(total)


def _error_kinds(results: list[dict]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for result in results:
        for kind, n in result["errors"].items():
            kinds[kind] = kinds.get(kind, 0) + n
    return kinds


def _never_started(results: list[dict]) -> int:
    return sum(result["skipped"] for result in results)


def table_rows(scenarios: list[Scenario], summary: dict, memory: dict,
               targets: tuple[str, ...] = report.TARGETS) -> list[list[str]]:
    rows = []
    for scenario in scenarios:
        rows += report.scenario_rows(scenario.name, scenario.metrics, summary[scenario.name], targets)
    if any(t != "direct" for t in targets):
        rows.append(report.memory_row(memory, targets))
    return rows


def _section(title: str, lines: list[str]) -> None:
    if lines:
        print(f"\n{title}")
        for line in lines:
            print(f"- {line}")


def _meta(args: argparse.Namespace, scenarios: list[Scenario]) -> dict:
    return {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "scale": args.factor, "reps": args.reps, "warmup": not args.no_warmup, "load_procs": args.load_procs,
            "workers": args.workers, "scrape_every_s": args.scrape_every,
            "targets": list(args.targets),
            "bare": "traceproxy (in-tree, bench.proxy_proc; tracing, access log and admin listener off)",
            "proxy": args.proxy_cmd or "traceproxy (in-tree, as bare)",
            "proxy-traced": "traceproxy (in-tree; OTLP http/protobuf to the bench's sink, access log off)",
            "proxy-logged": "traceproxy (in-tree; access log to a file, tracing off)",
            "proxy-receiver": "traceproxy (in-tree, as bare, with the engine span receiver on over OTLP/HTTP; "
                              "spans kept for the join only)",
            "proxy-receiver-grpc": "traceproxy (in-tree, as bare, with the engine span receiver on over OTLP/gRPC; "
                                   "spans kept for the join only)",
            "engine_span_load": args.engine_span_load,
            "defaults": "traceproxy (in-tree; serve's defaults: spans to the local file, access log to stdout, "
                        "here /dev/null, admin listener on)",
            "scenarios": [s.to_spec() for s in scenarios]}


def main(argv: list[str] | None = None) -> int:
    try:
        args, scenarios = parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # --help, or a usage error already printed by argparse
        return exc.code if isinstance(exc.code, int) else 2
    workdir = Path(tempfile.mkdtemp(prefix="traceproxy-bench-"))
    try:
        with _terminate_as_exit(), Children(workdir) as children:
            session = Session(children, workdir, args.load_procs, warmup=not args.no_warmup, workers=args.workers,
                              scrape_every=args.scrape_every, engine_span_rate=args.engine_span_load)
            session.start_upstream()
            if args.engine_span_load:
                session.start_discard()
            for target in args.targets:
                if target != "direct":
                    session.start_proxy(target, args.proxy_cmd if target == "proxy" else None, args.proxy_set)
            ports = ", ".join(f"{name} 127.0.0.1:{port}" for name, port in session.ports.items())
            _log(f"{ports}; {len(scenarios)} scenario(s), targets {','.join(args.targets)}, "
                 f"scale {args.factor:g}, reps {args.reps}")
            runs, problems = run_scenarios(session, scenarios, args.reps, args.targets)
            end = session.finish()
    except ChildError as exc:
        _log(f"could not run: {exc}")
        return 2
    except KeyboardInterrupt:
        _log("interrupted; every process started was stopped")
        return 130
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return _output(args, scenarios, runs, problems, end, session.settle_waits)


def _output(args, scenarios, runs, problems, end, settle_waits) -> int:
    summary = summarize(scenarios, runs)
    meta = _meta(args, scenarios)
    memory, tracing, access_log = end["memory"], end["tracing"], end["access_log"]
    targets = args.targets
    served = f"; {args.workers} workers per proxy" if args.workers > 1 else ""
    scraped = f"; /metrics read every {args.scrape_every:g} s" if args.scrape_every else ""
    loaded = f"; engine span load {args.engine_span_load:g} requests/s per worker" if args.engine_span_load else ""
    print(f"traceproxy bench: targets {', '.join(targets)}; proxy = {meta['proxy']}; {meta['cpus']} CPUs, "
          f"Python {meta['python']}, scale {args.factor:g}, reps {args.reps}, load processes {args.load_procs}"
          f"{served}{scraped}{loaded}\n")
    print(report.markdown(table_rows(scenarios, summary, memory, targets), targets))
    base = report.bare_of(targets) or "bare"
    caveat = " (--proxy-cmd: 'proxy' is another program, so this is not the feature alone)" \
        if args.proxy_cmd and base == "proxy" else ""
    _section(f"Tracing cost (spans over OTLP to the sink), proxy-traced against {base}{caveat}:",
             report.added_cost(summary, memory, "proxy-traced", base))
    _section("Tracing ran:", report.tracing_evidence(tracing))
    _section(f"Access log cost (a JSON line per request to a file), proxy-logged against {base}{caveat}:",
             report.added_cost(summary, memory, "proxy-logged", base))
    _section("Access log ran:", report.access_log_evidence(access_log))
    for target in (t for t in report.RECEIVERS if t in targets):
        _section(f"Engine span receiver cost ({report.SHORT[target]}), {target} against {base}{caveat}:",
                 report.receiver_cost(summary, memory, target, base))
    _section("Engine span load ran:", report.engine_load_evidence(summary, args.engine_span_load))
    _section(f"Observers' CPU µs per request against {base} (the proxy's tree, exporter included){caveat}:",
             report.observer_prices(summary, targets))
    _section("Notes:", [*problems, *report.notes(summary)])
    print("\nRates and latencies: medians over reps; counts: totals. CPU %: 100 = one core; 'load' is the "
          "busiest load process; a proxy's CPU includes its child processes (the span exporter, also shown "
          "apart) and 'sink' is the OTLP sink. CPU µs/request: the proxy's tree from the run's start until it "
          "is quiet again, over the requests answered (a receiver target's receivers' process included, and also "
          "shown apart as 'receiver'; 'engines' is the two engine span loads, 'discard' their sink). "
          "Peak RSS: each process's peak (VmHWM), summed over the tree.")
    if args.json:
        report.write_json(args.json, {"meta": meta, "summary": summary, "memory": memory, "tracing": tracing,
                                      "access_log": access_log, "engine_discard": end.get("engine_discard"),
                                      "problems": problems,
                                      "settle_waits_s": settle_waits, "runs": runs})
    failed = [f"{n} ({t})" for n in summary for t in targets
              if t != "direct" and report.regressed(summary[n].get("direct") or {}, summary[n].get(t) or {})]
    if failed:
        _log(f"errors or hangs through a proxy target but not direct in: {', '.join(failed)}")
    return 1 if failed or problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
