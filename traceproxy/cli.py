"""Command line: ``traceproxy serve | upstream | demo | bench | top | sim | repro | diagnose``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from . import __version__
from .config import (ConfigError, Settings, add_flags, listen_argument, load_settings, seconds_argument,
                     unknown_environment)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser(_named_command(argv))
    if argv[:1] == ["bench"]:
        from .bench.runner import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except BrokenPipeError:
        # The reader left (`traceproxy diagnose ID | head`): stop quietly, as other
        # commands in a pipe do. stdout is pointed at /dev/null so that the interpreter's
        # own flush at exit does not fail again and print a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a command ended by it


def _named_command(argv: list[str]) -> str | None:
    """The command argv names (its first word that is not an option), None without one."""
    return next((word for word in argv if not word.startswith("-")), None)


def _add_arguments(sub, name: str, named: str | None, module: str, **parser_options) -> argparse.ArgumentParser:
    """A command whose arguments live in its own module (demo, sim, repro, diagnose): the
    module is imported only when this command is the one named. ``serve`` must not load
    them: through diagnose and demo they import protobuf and the simulator, about 5 MB of
    every proxy process's memory."""
    command = sub.add_parser(name, **parser_options)
    if named is None or name == named:
        import importlib

        importlib.import_module(module, __package__).add_arguments(command)
    return command


def _parser(named: str | None = None) -> argparse.ArgumentParser:
    """``named``: the command given, whose arguments are added; any other command is
    listed with its help but without its arguments (None: every command's)."""
    parser = argparse.ArgumentParser(prog="traceproxy", description=__doc__)
    parser.add_argument("--version", action="version", version=f"traceproxy {__version__}")
    parser.set_defaults(command=None)
    sub = parser.add_subparsers(dest="command")

    serve = sub.add_parser("serve", help="run the proxy", description="Run the proxy. Every flag is also a "
                           "config-file key and a TRACEPROXY_<KEY> environment variable; flags win.")
    add_flags(serve)
    serve.add_argument("--check", action="store_true",
                       help="load flags, environment and config file as serve does, validate them, print the "
                       "listen, upstream and admin addresses and where spans and the access log go, and exit: "
                       "0 when valid, 2 (naming the key) when not. Binds nothing, resolves no names, writes nothing.")
    serve.set_defaults(run=_serve)

    upstream = sub.add_parser("upstream", help="run the built-in OpenAI-compatible test upstream")
    upstream.add_argument("--listen", type=listen_argument, default="127.0.0.1:0",
                          help="HOST:PORT (port 0 picks a free one)")
    upstream.add_argument("--idle-close-after", type=seconds_argument(zero="never"), default=0.0,
                          help="close idle keep-alive connections after this many seconds (0 = never)")
    upstream.set_defaults(run=_upstream)

    demo = _add_arguments(sub, "demo", named, ".demo",
                          help="the quick start: simulated prefill/decode workers behind the router, "
                               "traceproxy in front, and one injected fault at a time with its verdict")
    demo.set_defaults(run=_demo)

    sub.add_parser("bench", help="measure the proxy against a direct connection (see traceproxy bench --help)")

    top = sub.add_parser("top", help="watch the requests in flight, stalls and whose turn it is",
                         description="A live view of GET /debug/inflight from a running proxy's "
                         "admin listener. Stalled requests are marked STALL (red), those past half their "
                         "stall threshold slow (yellow). Ctrl-C quits.")
    top.add_argument("--admin", metavar="HOST:PORT", default=None,
                     help="the proxy's admin listener (default: the serve default, 127.0.0.1:9464)")
    top.add_argument("--interval", metavar="SECONDS", default=1.0,
                     help="seconds between refreshes (default: 1)")
    top.add_argument("--once", action="store_true",
                     help="print one frame without cursor control and exit (2 if the admin is unreachable)")
    top.add_argument("--no-color", action="store_true", help="no ANSI colours (also when NO_COLOR is set)")
    top.set_defaults(run=_top)

    sim = _add_arguments(sub, "sim", named, ".sim.command",
                         help="run a simulated SGLang prefill/decode deployment (with the real router)")
    sim.set_defaults(run=_sim)

    repro = _add_arguments(sub, "repro", named, ".repro.command",
                           help="a multi-turn agent harness that, when a turn hangs, says where it is stuck")
    repro.set_defaults(run=_repro)
    diagnose = _add_arguments(sub, "diagnose", named, ".diagnose",
                              help="one request's timeline from its spans (span file or Jaeger)")
    diagnose.set_defaults(run=_diagnose)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from .app import run

    try:
        settings = load_settings(args)
    except ConfigError as exc:
        print(f"traceproxy: configuration error: {exc}", file=sys.stderr)
        return 2
    for warning in unknown_environment():
        print(f"traceproxy: warning: {warning}", file=sys.stderr)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.check:
        return _check(settings)
    try:
        return run(settings)
    except ConfigError as exc:
        print(f"traceproxy: configuration error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the listen or admin address taken, or not this machine's
        return _stopped(exc)


def _stopped(exc: OSError) -> int:
    print(f"traceproxy: stopped: {exc}", file=sys.stderr)
    return 1


def _check(settings: Settings) -> int:
    from .app import check_settings

    try:
        effective = check_settings(settings)
    except ConfigError as exc:
        print(f"traceproxy: configuration error: {exc}", file=sys.stderr)
        return 2
    width = max(len(label) for label, _ in effective)
    for label, value in effective:
        print(f"{label:<{width}}  {value}")
    print("traceproxy: configuration OK")
    return 0


def _upstream(args: argparse.Namespace) -> int:
    import uvloop

    from .sim.fast import FastUpstream

    async def serve() -> None:
        up = await FastUpstream(args.listen.host, args.listen.port, idle_close_after=args.idle_close_after).start()
        print(f"fast upstream listening on {up.url}", flush=True)
        await asyncio.Event().wait()

    try:
        uvloop.run(serve())
    except KeyboardInterrupt:
        pass
    except OSError as exc:  # the listen address taken, or not this machine's: as serve says it
        return _stopped(exc)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def _top(args: argparse.Namespace) -> int:
    from .top import run

    return run(args)


def _repro(args: argparse.Namespace) -> int:
    from .repro.command import run

    return run(args)


def _diagnose(args: argparse.Namespace) -> int:
    from .diagnose import run_args

    return run_args(args)


def _sim(args: argparse.Namespace) -> int:
    from .sim.command import run

    return run(args)
