"""``traceproxy bench``: run each scenario direct to the upstream and through the proxy, alternately.

Order per scenario: direct, proxy, direct, proxy, ... (``--reps`` pairs), so the two
are measured side by side in time. Prints a markdown table on stdout; ``--json``
writes the raw results. Exit status: 0 when it ran, 1 when a scenario had errors or
hangs through the proxy but not direct (or the proxy died), 2 when it could not run.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from . import report
from .procs import ChildError, Children
from .scenarios import SCENARIOS, Scenario, select
from .session import Session

QUICK_SCALE = 0.25


def build_parser() -> argparse.ArgumentParser:
    names = ", ".join(f"{s.name} ({s.title})" for s in SCENARIOS)
    parser = argparse.ArgumentParser(
        prog="traceproxy bench",
        description="Measure direct-to-upstream against through-the-proxy on this machine, in one run.",
        epilog=f"Scenarios: {names}.")
    parser.add_argument("--scenarios", metavar="S1,S2", help="comma-separated scenario names (default: all)")
    parser.add_argument("--scale", type=float, metavar="F",
                        help="multiply connection counts, rounds and durations (default 1, or %g with --quick)"
                        % QUICK_SCALE)
    parser.add_argument("--quick", action="store_true", help="a short smoke run (about 15 s)")
    parser.add_argument("--reps", type=int, default=1, metavar="N", help="direct/proxy pairs per scenario (default 1)")
    parser.add_argument("--load-procs", type=int, default=1, metavar="N", help="load generator processes (default 1)")
    parser.add_argument("--no-warmup", action="store_true",
                        help="skip the one unrecorded request per connection that warms the proxy's upstream pool")
    parser.add_argument("--json", metavar="PATH", help="write the raw results as JSON")
    parser.add_argument("--proxy-cmd", metavar="TEMPLATE",
                        help="benchmark this command instead of traceproxy; {port} and {upstream_port} are "
                             "filled in, e.g. a config-templated nginx")
    parser.add_argument("--proxy-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a traceproxy settings override for the proxy under test (repeatable)")
    return parser


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[Scenario]]:
    parser = build_parser()
    args = parser.parse_args(argv)
    factor = args.scale if args.scale is not None else (QUICK_SCALE if args.quick else 1.0)
    if factor <= 0 or args.reps < 1 or args.load_procs < 1:
        parser.error("--scale must be > 0, --reps and --load-procs >= 1")
    args.factor = factor
    try:
        return args, select(args.scenarios, factor)
    except ValueError as exc:
        parser.error(str(exc))


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


def run_scenarios(session: Session, scenarios: list[Scenario], reps: int) -> tuple[dict, list[str]]:
    """Every scenario, direct and proxy alternately; raw runs per scenario and target."""
    runs: dict[str, dict[str, list[dict]]] = {}
    problems: list[str] = []
    for scenario in scenarios:
        runs[scenario.name] = {"direct": [], "proxy": []}
        for rep in range(reps):
            for target in report.TARGETS:
                if target == "proxy" and not session.proxy_alive():
                    problems.append(f"{scenario.name}: the proxy process had exited; proxy run skipped")
                    continue
                started = time.monotonic()
                result = session.measure(scenario, target)
                runs[scenario.name][target].append(result)
                _log(f"{scenario.name} {target} rep {rep + 1}: ok {result['ok']}, "
                     f"errors {sum(result['errors'].values())}, hangs {result['hangs']} "
                     f"({time.monotonic() - started:.1f} s)")
    return runs, problems


def summarize(scenarios: list[Scenario], runs: dict) -> dict[str, dict]:
    summary = {}
    for scenario in scenarios:
        by_target = runs[scenario.name]
        entry = {t: report.combine([report.figures(r) for r in by_target[t]]) for t in report.TARGETS}
        entry["error_kinds"] = {t: _error_kinds(by_target[t]) for t in report.TARGETS}
        summary[scenario.name] = entry
    return summary


def _error_kinds(results: list[dict]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for result in results:
        for kind, n in result["errors"].items():
            kinds[kind] = kinds.get(kind, 0) + n
        if result["skipped"]:
            kinds["skipped"] = kinds.get("skipped", 0) + result["skipped"]
    return kinds


def table_rows(scenarios: list[Scenario], summary: dict, memory: dict) -> list[list[str]]:
    rows = []
    for scenario in scenarios:
        entry = summary[scenario.name]
        rows += report.scenario_rows(scenario.name, scenario.metrics, entry["direct"], entry["proxy"])
    peak = memory.get("peak_bytes")
    rows.append(["all", "proxy peak RSS MiB", "–", f"{peak / 2**20:.1f}" if peak else "–", ""])
    return rows


def _meta(args: argparse.Namespace, scenarios: list[Scenario]) -> dict:
    return {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "scale": args.factor, "reps": args.reps, "warmup": not args.no_warmup, "load_procs": args.load_procs,
            "proxy": args.proxy_cmd or "traceproxy (in-tree, bench.proxy_proc)",
            "scenarios": [s.to_spec() for s in scenarios]}


def main(argv: list[str] | None = None) -> int:
    try:
        args, scenarios = parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # --help, or a usage error already printed by argparse
        return exc.code if isinstance(exc.code, int) else 2
    workdir = Path(tempfile.mkdtemp(prefix="traceproxy-bench-"))
    try:
        with _terminate_as_exit(), Children(workdir) as children:
            session = Session(children, workdir, args.load_procs, warmup=not args.no_warmup)
            session.start_upstream()
            session.start_proxy(args.proxy_cmd, args.proxy_set)
            _log(f"upstream 127.0.0.1:{session.ports['direct']}, proxy 127.0.0.1:{session.ports['proxy']}; "
                 f"{len(scenarios)} scenario(s), scale {args.factor:g}, reps {args.reps}")
            runs, problems = run_scenarios(session, scenarios, args.reps)
            memory = session.proxy_memory()
    except ChildError as exc:
        _log(f"could not run: {exc}")
        return 2
    except KeyboardInterrupt:
        _log("interrupted; every process started was stopped")
        return 130
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return _output(args, scenarios, runs, problems, memory)


def _output(args, scenarios, runs, problems, memory) -> int:
    summary = summarize(scenarios, runs)
    meta = _meta(args, scenarios)
    print(f"traceproxy bench: {meta['proxy']}; {meta['cpus']} CPUs, Python {meta['python']}, "
          f"scale {args.factor:g}, reps {args.reps}, load processes {args.load_procs}\n")
    print(report.markdown(table_rows(scenarios, summary, memory)))
    for line in [*problems, *report.notes(summary)]:
        print(f"\n- {line}", end="")
    print("\n\nRates and latencies: medians over reps; counts: totals. "
          "CPU %: 100 = one core; 'load' is the busiest load process.")
    if args.json:
        report.write_json(args.json, {"meta": meta, "summary": summary, "memory": memory, "problems": problems,
                                      "runs": runs})
    failed = [n for n in summary if report.regressed(summary[n]["direct"], summary[n]["proxy"])]
    if failed:
        _log(f"errors or hangs through the proxy but not direct in: {', '.join(failed)}")
    return 1 if failed or problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
