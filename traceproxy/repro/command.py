"""``traceproxy repro``: the command-line arguments and the printing around ``run_repro``.

Exit status: 0 when every turn was ok, 1 when a turn hung or failed, 2 on usage
errors and when the target (or the admin listener given) does not answer.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading

from .harness import BOTH, DEFAULT_PATH, MODES, TargetUnreachable, TurnRecord, UsageError, run_repro
from .report import plan_line, result_document, summary_lines, turn_lines

USAGE_EXIT = 2
INTERRUPTED_EXIT = 130

DESCRIPTION = (
    "A multi-turn agent harness on raw sockets (h11): C conversations x R streaming chat turns with a "
    "growing context, each conversation on one reused keep-alive connection (reused), a fresh connection "
    "per turn (fresh), or both side by side. Every turn carries its own x-request-id. When a turn hangs "
    "past --turn-timeout, the harness asks the proxy's admin listener (GET /debug/inflight) where that "
    "request is and prints the verdict: the phase it is stuck in and whose turn it is, or that it never "
    "reached the proxy. Exit status: 0 all ok, 1 something hung or failed, 2 usage error or target "
    "unreachable."
)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.description = DESCRIPTION
    parser.add_argument("--url", required=True, metavar="http://HOST:PORT",
                        help="the proxy (or anything in front of it)")
    parser.add_argument("--admin", metavar="HOST:PORT", default=None,
                        help="the proxy's admin listener, asked where a hung request is (without it: no verdict)")
    parser.add_argument("--conversations", "-c", type=int, default=2, metavar="C",
                        help="concurrent conversations per mode (default: 2)")
    parser.add_argument("--turns", "-r", type=int, default=3, metavar="R", help="turns per conversation (default: 3)")
    parser.add_argument("--turn-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="a turn not complete after this long is hung (default: 30)")
    parser.add_argument("--path", default=DEFAULT_PATH, help=f"the request path (default: {DEFAULT_PATH})")
    parser.add_argument("--mode", choices=MODES, default=BOTH,
                        help="reused: one keep-alive connection per conversation; fresh: one per turn; "
                        "both (default): the two side by side")
    parser.add_argument("--model", default="traceproxy-repro",
                        help="the model field of the requests (default: traceproxy-repro)")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens per turn (default: 16)")
    parser.add_argument("--think", type=float, default=0.0, metavar="SECONDS",
                        help="idle time between turns, as an agent running tools (default: 0)")
    parser.add_argument("--header", "-H", action="append", default=[], metavar="'NAME: VALUE'",
                        help="an extra request header (repeatable); a Host replaces repro's own, while "
                        "Content-Length, Transfer-Encoding, Connection and x-request-id are repro's to set")
    parser.add_argument("--verbose", "-v", action="store_true", help="print every turn, not only hung and failed ones")
    parser.add_argument("--json", action="store_true", help="print one JSON document with every turn instead")
    return parser


def parse_header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise UsageError(f"expected a header as 'NAME: VALUE', got {text!r}")
    return name.strip(), value.strip()


class LivePrinter:
    """Prints turns as they end, from the conversation threads, one block at a time."""

    def __init__(self, verbose: bool, out) -> None:
        self.verbose, self.out = verbose, out
        self._lock = threading.Lock()

    def __call__(self, record: TurnRecord) -> None:
        if record.result == "ok" and not self.verbose:
            return
        with self._lock:
            print("\n".join(turn_lines(record)), file=self.out, flush=True)


def _print_plan(args: argparse.Namespace, out) -> None:
    modes = ("reused", "fresh") if args.mode == BOTH else (args.mode,)
    print(plan_line(args.url, args.admin, args.conversations, args.turns, modes, args.turn_timeout), file=out,
          flush=True)


def run(args: argparse.Namespace, out=None, err=None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    try:
        headers = [parse_header(h) for h in args.header]
        result = run_repro(args.url, args.admin, args.conversations, args.turns, args.turn_timeout, args.mode,
                           headers, path=args.path, model=args.model, max_tokens=args.max_tokens,
                           think=args.think, on_turn=None if args.json else LivePrinter(args.verbose, out),
                           on_start=None if args.json else lambda: _print_plan(args, out))
    except (UsageError, TargetUnreachable) as exc:
        print(f"traceproxy repro: {exc}", file=err)
        return USAGE_EXIT
    except KeyboardInterrupt:
        print("traceproxy repro: interrupted", file=err)
        return INTERRUPTED_EXIT
    if args.json:
        print(json.dumps(result_document(result), indent=1), file=out)
    else:
        print("\n".join(summary_lines(result)), file=out)
    return result.exit_code
