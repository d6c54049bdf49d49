"""``traceproxy sim`` and ``traceproxy sim worker``: flags and entry point.

Kept apart from ``launch.py`` so that building the CLI parser costs only the stdlib:
aiohttp, the workers and the router launcher are imported when the command runs.
The fault list in ``--help`` is read from the one fault table in ``faults.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import math
import sys
from urllib.parse import urlsplit

from ..hostnames import is_hostname
from .faults import FaultError, check_role, fault_table, parse_faults
from .routers import LOG_LEVELS, ROUTER_NAMES

DESCRIPTION = """\
Run a simulated prefill/decode deployment on loopback: a prefill and a decode worker
and a real router in PD mode in front of them (offline): --router sglang-router, smg
or vllm-router (default: the first of these installed; without any, no router).
The workers speak the PD protocol of either: SGLang's bootstrap rooms (sglang-router,
smg) or vLLM's kv_transfer_params (vllm-router). Optionally a faulty keep-alive proxy
in front of the router or of any URL. Prints one "NAME URL" line per listener
(prefill, decode, router, router-metrics, faulty-proxy, bootstrap) on stdout, and on
stderr which router runs and what the faulty proxy stands in front of, and runs until
SIGINT/SIGTERM. Faults are armed once the router is ready: its start-up traffic never
meets them. A start that fails (a port in use, a router that is not ready in time)
says why in one line and exits non-zero.

To put the faulty proxy where a hang is the harness's own, in front of traceproxy
(harness -> faulty proxy -> traceproxy -> router):
  traceproxy sim --router-port 30000 --faulty-proxy-upstream http://127.0.0.1:8000
  traceproxy serve --listen 127.0.0.1:8000 --upstream http://127.0.0.1:30000
and point the harness at the faulty-proxy URL the sim prints.

"traceproxy sim worker --role prefill|decode --listen HOST:PORT" runs one worker
(for docker-compose: give the decode worker --prefill-url, or give the router the
prefill's --bootstrap-port).
"""

FAULTS_EPILOG = """\
faults: --fault NAME[:ARG], repeatable or comma-separated; (role) is the worker it acts on.
A worker refuses a fault it never acts on. A decode worker behind the router (and every
"sim worker", which is made for one) gets every request paired with its prefill, so it
refuses the (prefill) faults too; only with --no-router, a decode worker serving requests
on its own, does its own prefill and acts on them (per request, or POST /admin/faults), and
--fault arms them there; the handshake and KV-transfer faults need a router and are refused
without one.
Per worker at runtime: POST /admin/faults {"faults": [...]} (POST /admin/release drops held
requests). Per request: header x-sim-fault (every router drops it), or the body field sim_fault
on /v1/completions, or metadata.sim_fault on /v1/chat/completions (both survive the routers).
""" + fault_table()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.epilog = FAULTS_EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--host", type=host_argument, default="127.0.0.1",
                        help="address every listener binds (default: 127.0.0.1)")
    parser.add_argument("--prefill-port", type=port_argument, default=0, help="0 picks a free port (default)")
    parser.add_argument("--decode-port", type=port_argument, default=0, help="0 picks a free port (default)")
    parser.add_argument("--router-port", type=port_argument, default=0, help="0 picks a free port (default)")
    parser.add_argument("--bootstrap-port", type=port_argument, default=0,
                        help="the prefill's KV bootstrap port (0: free)")
    parser.add_argument("--router", choices=ROUTER_NAMES, default=None,
                        help="the router to run in front of the workers (default: the first of these installed)")
    parser.add_argument("--no-router", action="store_true", help="run no router")
    parser.add_argument("--faulty-proxy", action="store_true",
                        help="also start the faulty keep-alive proxy (in front of the router, else of decode)")
    parser.add_argument("--faulty-proxy-upstream", type=upstream_url_argument, default=None, metavar="URL",
                        help="start the faulty proxy in front of URL instead (implies --faulty-proxy), e.g. a "
                        "traceproxy serve whose upstream is this router: harness -> faulty proxy -> traceproxy -> "
                        "router. URL need not answer yet; it is connected to per client connection")
    parser.add_argument("--hang-after", default="1-3", metavar="N|LOW-HIGH",
                        help="faulty proxy: turns forwarded per client connection before it hangs (default 1-3)")
    parser.add_argument("--seed", type=int, default=None, help="faulty proxy: random seed for --hang-after ranges")
    _add_worker_arguments(parser)
    parser.add_argument("--startup-timeout", type=seconds_argument, default=60.0, metavar="SECONDS",
                        help="how long the router may take to answer a warm-up request through both workers "
                        "(default 60)")
    parser.add_argument("--router-log-level", default="warning", choices=list(LOG_LEVELS),
                        help="the router's log level, in each router's own spelling (default: warning; smg makes "
                        "its --enable-trace spans at info)")
    parser.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for the router (repeatable, e.g. --router-arg=--policy"
                        " --router-arg=random)")
    parser.set_defaults(sim_command=None)

    sub = parser.add_subparsers(dest="sim_command")
    worker = sub.add_parser("worker", help="run one simulated worker", epilog=FAULTS_EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    worker.add_argument("--role", required=True, choices=["prefill", "decode"])
    worker.add_argument("--listen", type=listen_argument, default="127.0.0.1:0", metavar="HOST:PORT",
                        help="(default: 127.0.0.1:0)")
    worker.add_argument("--bootstrap-port", type=port_argument, default=0,
                        help="prefill only: KV bootstrap port (0: free)")
    worker.add_argument("--prefill-url", type=upstream_url_argument, default=None, metavar="URL",
                        help="decode only: poll this prefill worker's GET /bootstrap/{room} instead of the "
                        "bootstrap address the router puts in the body (e.g. http://prefill:30001)")
    _add_worker_arguments(worker)


def _add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fault", action="append", default=[], metavar="NAME[:ARG]",
                        help="a worker-wide fault (see below); repeatable")
    parser.add_argument("--model", type=model_argument, default="sim-llama",
                        help="served model name (default: sim-llama)")
    parser.add_argument("--prefill-tps", type=float, default=8000.0, help="prefill tokens/s (default 8000)")
    parser.add_argument("--decode-tps", type=float, default=100.0, help="decode tokens/s per request (default 100)")
    parser.add_argument("--otlp-endpoint", default=None, metavar="ENDPOINT",
                        help="export SGLang's request spans here, as SGLang's --otlp-traces-endpoint: over OTLP/gRPC "
                        "(HOST:PORT), or over HTTP with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf (a base URL "
                        "or the /v1/traces URL); default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
                        "OTEL_EXPORTER_OTLP_ENDPOINT, else no export")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _hang_after(text: str) -> int | tuple[int, int]:
    low, sep, high = text.partition("-")
    try:
        value = (int(low), int(high)) if sep else int(low)
    except ValueError:
        raise ValueError(f"--hang-after takes N or LOW-HIGH (whole turns), not {text!r}") from None
    low_n, high_n = value if sep else (value, value)
    if not 1 <= low_n <= high_n:
        raise ValueError(f"--hang-after must be at least 1 turn, and LOW <= HIGH, not {text!r}")
    return value


def _check_export_settings(endpoint: str | None) -> None:
    """With an endpoint, the export variables must be ones SGLang accepts (a ValueError names the bad
    one), and an endpoint given here one the protocol's exporter takes."""
    from .otel import check_endpoint, configured_endpoint, export_settings

    if configured_endpoint(endpoint) is not None:
        protocol, _, _ = export_settings()
        if endpoint:
            check_endpoint(protocol, endpoint)


def _check_rates(args: argparse.Namespace) -> None:
    for flag, value in (("--prefill-tps", args.prefill_tps), ("--decode-tps", args.decode_tps)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} must be a number of tokens per second above 0, not {value:g}")


# The simulator stands apart from the proxy (it imports only the leaf module that
# says what a host name is), so it checks its few addresses itself.


def host_argument(text: str) -> str:
    """A host name or IP address to bind (IPv6 with or without brackets)."""
    host = text.strip().removeprefix("[").removesuffix("]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not is_hostname(host):
            raise argparse.ArgumentTypeError(f"expected a host name or IP address, got {text!r}") from None
    return host


def port_argument(text: str) -> int:
    if not (text.strip().isascii() and text.strip().isdigit() and int(text) <= 65535):
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535 (0 picks a free one), got {text!r}")
    return int(text)


def seconds_argument(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text!r}")
    return value


def model_argument(text: str) -> str:
    """A served model name: the routers route by it, and requests name it."""
    if not text.strip() or text != text.strip():
        raise argparse.ArgumentTypeError(f"expected a model name without surrounding spaces, got {text!r}")
    return text


def upstream_url_argument(text: str) -> str:
    """http://HOST[:PORT], the only kind of URL the faulty proxy forwards to."""
    try:
        parts = urlsplit(text.strip())
        port = parts.port
    except ValueError:
        parts, port = None, None
    if (parts is None or parts.scheme != "http" or not parts.hostname or parts.username is not None
            or parts.path not in ("", "/") or parts.query or parts.fragment or port == 0):
        raise argparse.ArgumentTypeError(f"expected http://HOST:PORT (no path), got {text!r}")
    return f"http://{parts.netloc}"


def listen_argument(text: str) -> tuple[str, int]:
    """HOST:PORT ([IPv6]:PORT); port 0 picks a free one."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or (":" in host and not host.startswith("[")):
        raise argparse.ArgumentTypeError(f"expected HOST:PORT such as 127.0.0.1:0 or [::1]:0, got {text!r}")
    return host_argument(host), port_argument(port)


def run(args: argparse.Namespace) -> int:
    try:
        faults = parse_faults(args.fault)
        if args.sim_command == "worker":
            check_role(faults, args.role, pd=True)  # the deployment sends each fault to its home itself
            if args.prefill_url is not None and args.role != "decode":
                raise ValueError("--prefill-url is for a decode worker (--role decode): it says where to poll the "
                                 "prefill's bootstrap")
        _check_rates(args)
        # Checked whether or not --faulty-proxy is given: a bad value is a mistake either way.
        hang_after = _hang_after(args.hang_after) if args.sim_command is None else 1
        _check_export_settings(args.otlp_endpoint)
    except (FaultError, ValueError) as exc:
        print(f"traceproxy sim: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.sim_command == "worker":
        return _run_worker(args)
    from .launch import SimDeployment, router_importable, run_deployment

    router = _chosen_router(args, router_importable)
    if router is None:
        return 2
    try:
        deployment = SimDeployment(
            router=router, faults=args.fault, faulty_proxy=args.faulty_proxy, host=args.host,
            prefill_port=args.prefill_port, decode_port=args.decode_port, router_port=args.router_port,
            bootstrap_port=args.bootstrap_port, hang_after=hang_after, seed=args.seed, model=args.model,
            prefill_tokens_per_s=args.prefill_tps, decode_tokens_per_s=args.decode_tps,
            otlp_endpoint=args.otlp_endpoint, router_args=tuple(args.router_arg),
            router_log_level=args.router_log_level, startup_timeout=args.startup_timeout,
            faulty_proxy_upstream=args.faulty_proxy_upstream)
    except FaultError as exc:  # a fault none of its workers would act on (the PD handshake's, without a router)
        print(f"traceproxy sim: {exc}", file=sys.stderr)
        return 2
    given = {"prefill": ("--prefill-port", args.prefill_port), "decode": ("--decode-port", args.decode_port),
             "bootstrap": ("--bootstrap-port", args.bootstrap_port), "router": ("--router-port", args.router_port)}
    return _run_until_stopped(run_deployment(deployment), {name: flag for name, (flag, port) in given.items() if port})


def _chosen_router(args: argparse.Namespace, installed) -> bool | str | None:
    """What to pass SimDeployment as ``router``; None (after saying why) when it cannot run."""
    if args.no_router:
        if args.router is not None or args.router_arg:
            given = "--router" if args.router is not None else "--router-arg"
            print(f"traceproxy sim: {given} and --no-router contradict each other", file=sys.stderr)
            return None
        return False
    if args.router is not None:
        if not installed(args.router):
            print(f"traceproxy sim: --router {args.router}: {args.router} is not installed"
                  f" (pip install {args.router})", file=sys.stderr)
            return None
        return args.router
    if not installed():
        print(f"traceproxy sim: no router is installed ({', '.join(ROUTER_NAMES)}); running without one",
              file=sys.stderr)
        return False
    return True


def _run_worker(args: argparse.Namespace) -> int:
    from .engine import SimWorker
    from .launch import run_worker

    worker = SimWorker(args.role, *args.listen, model=args.model,
                       prefill_tokens_per_s=args.prefill_tps, decode_tokens_per_s=args.decode_tps,
                       default_faults=args.fault, bootstrap_port=args.bootstrap_port,
                       otlp_endpoint=args.otlp_endpoint, prefill_url=args.prefill_url, pd=True)
    given = {args.role: ("--listen", args.listen[1]), "bootstrap": ("--bootstrap-port", args.bootstrap_port)}
    return _run_until_stopped(run_worker(worker), {name: flag for name, (flag, port) in given.items() if port},
                              host_flag="--listen")


def _run_until_stopped(main, port_flags: dict[str, str], host_flag: str = "--host") -> int:
    """Run ``main``; a start that fails is one line on stderr: 2 for a listener that cannot
    bind (naming the flag that gave its port, else the host's), 1 otherwise.

    ``port_flags``: listener name -> the flag that gave it a port, for ports the user gave."""
    from .startup import ListenerError, SimStartError

    try:
        return asyncio.run(main)
    except KeyboardInterrupt:
        return 0
    except ListenerError as exc:
        flag = port_flags.get(exc.listener) or (None if exc.taken else host_flag)
        print(f"traceproxy sim: cannot start: {exc}" + (f" ({flag})" if flag else ""), file=sys.stderr)
        return 2
    except SimStartError as exc:
        if exc.detail:
            logging.getLogger("traceproxy.sim").debug("router log:\n%s", exc.detail)
        print(f"traceproxy sim: cannot start: {exc}", file=sys.stderr)
        return 1
