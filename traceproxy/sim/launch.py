"""Start a simulated PD deployment: prefill + decode workers, a real router, a faulty proxy.

Theory of operation
-------------------
``SimDeployment`` starts, on the running event loop, a prefill and a decode
``SimWorker`` (loopback, ephemeral ports), then, when asked, a real router in PD mode
(sglang-router, smg or vllm-router; see ``routers.py``) as a child process in its own
session (``RouterProcess``), then, when asked, a ``FaultyProxy`` in front of the
router (or of the decode worker when there is no router, or of any URL given).
The router cannot bind port 0 and report it, so its ports are picked just before it
starts (bind 0, read, release); a port given to it is checked to be free first. It
runs offline (``HF_HUB_OFFLINE=1``; the workers' ``model_path`` is an empty
directory, so it never fetches a tokenizer) and is ready when a warm-up
``/generate`` goes through it to both workers *and* the port that answered is
listened on by the router child itself: whatever else answers there (another
deployment's router, taking the port between the check and the child's bind) is
not this deployment's router. The workers' faults are armed only once the router
is ready (its registration calls and warm-up are the deployment's own traffic),
and the workers' records are cleared then. Stopping SIGTERMs the router's process
group, then SIGKILLs it if it lingers; every wait is bounded.

A start that fails raises ``startup.SimStartError``: one line saying why (a port
already in use names its listener), with the router's log tail in ``detail``.

``run_deployment`` and ``run_worker`` are the ``traceproxy sim`` and
``traceproxy sim worker`` commands: start, print one ``name URL`` line per
listener, run until SIGINT/SIGTERM, stop everything started.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import aiohttp
import psutil

from ..ports import free_port
from .engine import SimWorker
from .faults import split_by_home
from .faultyproxy import FaultyProxy
from .routers import ROUTER_NAMES, VLLM_PROTOCOL, RouterKind, default_router, installed_routers, router_kind
from .startup import ListenerError, SimStartError, check_port_taken

STARTUP_TIMEOUT = 60.0
STOP_WAIT = 5.0


class RouterUnavailable(SimStartError):
    """The router asked for is not installed in this interpreter (or none is)."""


def router_importable(name: str | None = None) -> bool:
    """Whether the router ``name`` is installed; without a name, whether any is."""
    if name is None:
        return bool(installed_routers())
    return router_kind(name).installed


def resolve_router(router: bool | str | RouterKind) -> RouterKind | None:
    """``True``: the default router (the first installed); ``False``: none; a name: that router.

    Raises ``RouterUnavailable`` when the router asked for is not installed, and
    ``UnknownRouter`` (a ValueError) for a name that is no router."""
    if router is False or router is None:
        return None
    if router is True:
        kind = default_router()
        if kind is None:
            raise RouterUnavailable(f"no router is installed (pip install one of: {', '.join(ROUTER_NAMES)})")
        return kind
    kind = router if isinstance(router, RouterKind) else router_kind(router)
    if not kind.installed:
        raise RouterUnavailable(f"{kind.name} is not installed (pip install {kind.name})")
    return kind


class RouterProcess:
    """A router (``router``: a name or ``RouterKind``; True for the default one) in PD mode,
    as a child in its own session."""

    def __init__(self, prefill_url: str, bootstrap_port: int, decode_url: str, workdir: str, *,
                 router: bool | str | RouterKind = True, host: str = "127.0.0.1", port: int = 0,
                 request_timeout: float = 60.0, log_level: str = "warning", extra_args: tuple[str, ...] = ()) -> None:
        self.kind = resolve_router(router) if router else None
        if self.kind is None:
            raise ValueError("a RouterProcess needs a router")
        self.kind.log_level(log_level)  # a bad level is an error here, not a router that never starts
        self.prefill_url, self.bootstrap_port, self.decode_url = prefill_url, bootstrap_port, decode_url
        self.workdir, self.host = workdir, host
        self.port = port or free_port(host)
        self.prometheus_port = free_port(host)
        self.request_timeout, self.log_level, self.extra_args = request_timeout, log_level, tuple(extra_args)
        self.log_path = os.path.join(workdir, "router.log")
        self.proc: subprocess.Popen | None = None
        self.startup_seconds = 0.0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        """Its Prometheus endpoint: ``[engines] router_metrics_urls`` takes it."""
        return f"http://{self.host}:{self.prometheus_port}/metrics"

    @property
    def name(self) -> str:
        return self.kind.name

    def command(self) -> list[str]:
        return self.kind.command(sys.executable, host=self.host, port=self.port,
                                 prometheus_port=self.prometheus_port, prefill_url=self.prefill_url,
                                 bootstrap_port=self.bootstrap_port, decode_url=self.decode_url,
                                 log_level=self.log_level, request_timeout=self.request_timeout,
                                 extra_args=self.extra_args)

    async def start(self, timeout: float = STARTUP_TIMEOUT) -> "RouterProcess":
        if not self.kind.installed:
            raise RouterUnavailable(f"{self.name} is not installed (pip install {self.name})")
        check_port_taken("router", self.host, self.port)
        t0 = time.monotonic()
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", NO_COLOR="1")
        for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            env.pop(name, None)  # the router traces only when told to with its own flags
        with open(self.log_path, "wb") as log_file:
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log_file,
                                         stderr=subprocess.STDOUT, env=env, cwd=self.workdir,
                                         start_new_session=True)
        try:
            await self._wait_ready(t0 + timeout, timeout)
        except BaseException:
            await self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    async def _wait_ready(self, deadline: float, timeout: float) -> None:
        """Until a /generate goes through the router (which needs both workers registered),
        answered by the child started here."""
        last = "no answer yet"
        async with aiohttp.ClientSession() as session:
            for _ in range(100_000):
                if self.proc.poll() is not None:
                    raise self._exit_error()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    status, text = await self._warm_up(session, remaining)
                    if status == 200 and self._holds_port():
                        return
                    last = (f"HTTP {status}: {text[:200]!r}" if status != 200 else
                            f"port {self.port} answers, but not from the {self.name} started here")
                except asyncio.TimeoutError:
                    last = f"no answer within {min(10.0, remaining):g} s"
                except aiohttp.ClientError as exc:
                    last = str(exc) or type(exc).__name__
                await asyncio.sleep(0.1)
        raise SimStartError(f"{self.name} at {self.url} was not ready within {timeout:g} s"
                            f" (a warm-up /generate through it to both workers; last: {last})", self.log_tail())

    async def _warm_up(self, session: aiohttp.ClientSession, remaining: float) -> tuple[int, bytes]:
        body = json.dumps({"text": "warm-up", "sampling_params": {"max_new_tokens": 1}})
        async with session.post(f"{self.url}/generate", data=body,
                                headers={"Content-Type": "application/json", "X-Request-ID": "sim-warmup"},
                                timeout=aiohttp.ClientTimeout(total=min(10.0, remaining))) as resp:
            return resp.status, await resp.read()

    def _holds_port(self) -> bool:
        """Whether the router child (or a process of its own) listens on the router port."""
        try:
            leader = psutil.Process(self.proc.pid)
            for proc in (leader, *leader.children(recursive=True)):
                connections = getattr(proc, "net_connections", None) or proc.connections
                if any(conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == self.port
                       for conn in connections(kind="tcp")):
                    return True
        except psutil.AccessDenied:  # a platform that hides even a child's sockets: its life is all we know
            return self.proc is not None and self.proc.poll() is None
        except psutil.Error:
            return False
        return False

    def _exit_error(self) -> SimStartError:
        """Why the child exited before it was ready: its port was taken, else its last log line."""
        try:
            check_port_taken("router", self.host, self.port)
        except ListenerError as exc:
            exc.detail = self.log_tail()
            return exc
        last_line = next((line for line in reversed(self.log_tail().splitlines()) if line.strip()), "no output")
        return SimStartError(f"{self.name} exited with status {self.proc.returncode} before it was ready:"
                             f" {last_line[:300]}", self.log_tail())

    async def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not _signal_group(proc.pid, sig):
                break
            if await _wait_exit(proc, STOP_WAIT):
                break
        _signal_group(proc.pid, signal.SIGKILL)  # stragglers left in the group after the leader exited

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                text = f.read()[-20000:].decode(errors="replace")
        except OSError:
            return "(no router log)"
        text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # it colours its log even into a file
        return "\n".join(text.splitlines()[-lines:])


def _signal_group(pgid: int, sig: int) -> bool:
    """Signal the router's own process group (start_new_session: its pid is the group id)."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


async def _wait_exit(proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return True
        await asyncio.sleep(0.05)
    return proc.poll() is not None


class SimDeployment:
    """``async with SimDeployment(router=True, faults=(), faulty_proxy=False) as dep: ...``

    ``router``: True for the default router (the first installed of ``routers.ROUTERS``),
    a router's name (``"sglang-router"``, ``"smg"``, ``"vllm-router"``), or False for
    none; a router that is not installed is ``RouterUnavailable`` from ``start()``.
    ``faults`` (specs like ``"decode_stall:3"``) go to the worker each fault disturbs
    (its home role, see ``faults.py``), armed once the router is ready; without a router
    the decode worker serves alone and does its own prefill, so it takes them all, and
    those of the PD handshake, which it would never act on, raise FaultError.
    ``faulty_proxy_upstream`` (a URL, implies ``faulty_proxy``) puts the faulty proxy
    in front of that URL instead of the router: e.g. a traceproxy in front of this
    router, so that the harness, not traceproxy's pool, meets the hang. Attributes
    once started: ``prefill``, ``decode`` (``SimWorker``), ``router``
    (``RouterProcess`` or None), ``router_kind`` (its ``RouterKind``: name, version,
    PD protocol; None without a router), ``router_url``, ``faulty_proxy`` and
    ``faulty_proxy_url`` (None when not asked for), ``faulty_proxy_target`` (what
    the faulty proxy stands in front of: ``(name, URL)``).
    """

    def __init__(self, router: bool | str = True, faults=(), faulty_proxy: bool = False, *, host: str = "127.0.0.1",
                 prefill_port: int = 0, decode_port: int = 0, router_port: int = 0, bootstrap_port: int = 0,
                 hang_after: int | tuple[int, int] = (1, 3), seed: int | None = None, model: str = "sim-llama",
                 prefill_tokens_per_s: float = 8000.0, decode_tokens_per_s: float = 100.0,
                 otlp_endpoint: str | None = None, router_args: tuple[str, ...] = (), router_log_level: str = "warning",
                 request_timeout: float = 60.0, startup_timeout: float = STARTUP_TIMEOUT,
                 faulty_proxy_upstream: str | None = None) -> None:
        self.want_router, self.want_faulty_proxy = router, faulty_proxy or faulty_proxy_upstream is not None
        self.faulty_proxy_upstream = faulty_proxy_upstream
        self.host, self.router_port = host, router_port
        self.hang_after, self.seed = hang_after, seed
        self.router_args, self.router_log_level = tuple(router_args), router_log_level
        self.request_timeout, self.startup_timeout = request_timeout, startup_timeout
        self.workdir = ""
        by_home = split_by_home(faults, pd=bool(router))  # raises FaultError for a fault no worker acts on
        common = dict(host=host, model=model, prefill_tokens_per_s=prefill_tokens_per_s,
                      decode_tokens_per_s=decode_tokens_per_s, otlp_endpoint=otlp_endpoint, pd=bool(router))
        self.prefill = SimWorker("prefill", port=prefill_port, default_faults=by_home["prefill"],
                                 bootstrap_port=bootstrap_port, **common)
        self.decode = SimWorker("decode", port=decode_port, default_faults=by_home["decode"], **common)
        self.router: RouterProcess | None = None
        self.router_kind: RouterKind | None = None
        self.startup_calls: list = []  # what the router asked the workers while it started (engine.Call)
        self.faulty_proxy: FaultyProxy | None = None
        self.faulty_proxy_target: tuple[str, str] | None = None

    @property
    def router_url(self) -> str | None:
        return self.router.url if self.router is not None else None

    @property
    def faulty_proxy_url(self) -> str | None:
        return self.faulty_proxy.url if self.faulty_proxy is not None else None

    def urls(self) -> list[tuple[str, str]]:
        """(name, URL) of every listener: prefill, decode, router, router-metrics, faulty-proxy, bootstrap."""
        out = [("prefill", self.prefill.url), ("decode", self.decode.url)]
        if self.router is not None:
            out += [("router", self.router.url), ("router-metrics", self.router.metrics_url)]
        if self.faulty_proxy is not None:
            out.append(("faulty-proxy", self.faulty_proxy.url))
        out.append(("bootstrap", self.prefill.bootstrap_url))  # the prefill's KV bootstrap listener
        return out

    async def start(self) -> "SimDeployment":
        self.router_kind = resolve_router(self.want_router) if self.want_router else None
        self.workdir = tempfile.mkdtemp(prefix="traceproxy-sim-")
        model_path = os.path.join(self.workdir, "model")  # exists, holds no tokenizer
        os.mkdir(model_path)
        try:
            for worker in (self.prefill, self.decode):
                worker.model_path = model_path
                await worker.start()
            if self.router_kind is not None:
                await self._start_router()
            if self.want_faulty_proxy:
                await self._start_faulty_proxy()
            return self
        except BaseException:
            await self.stop()
            raise

    async def _start_router(self) -> None:
        self.router = RouterProcess(self.prefill.url, self.prefill.bootstrap_port, self.decode.url,
                                    self.workdir, router=self.router_kind, host=self.host, port=self.router_port,
                                    request_timeout=self.request_timeout, log_level=self.router_log_level,
                                    extra_args=self.router_args)
        # The router's registration calls and its warm-up /generate are this deployment's
        # own traffic: a fault that holds requests (prefill_stall) would hold the warm-up
        # and the deployment would never start. The faults are armed once it is ready.
        armed = [(worker, worker.faults) for worker in (self.prefill, self.decode)]
        for worker, _ in armed:
            worker.faults = {}
        try:
            await self.router.start(self.startup_timeout)
        finally:
            for worker, faults in armed:
                worker.faults = faults
        self.startup_calls = self.prefill.calls + self.decode.calls
        self.prefill.clear()
        self.decode.clear()

    async def _start_faulty_proxy(self) -> None:
        if self.faulty_proxy_upstream is not None:
            self.faulty_proxy_target = ("the given upstream", self.faulty_proxy_upstream)
        elif self.router is not None:
            self.faulty_proxy_target = ("the router", self.router.url)
        else:
            self.faulty_proxy_target = ("the decode worker", self.decode.url)
        proxy = FaultyProxy(self.faulty_proxy_target[1], self.hang_after, host=self.host, seed=self.seed)
        try:
            self.faulty_proxy = await proxy.start()
        except OSError as exc:
            raise ListenerError("faulty-proxy", self.host, proxy.port, exc) from None

    def describe_router(self) -> str:
        """One line: which router runs where, and the PD protocol it speaks to the workers."""
        kind = self.router_kind
        pairing = ("prefill, then decode, paired by kv_transfer_params" if kind.protocol == VLLM_PROTOCOL
                   else "prefill and decode at once, paired by bootstrap_room")
        return f"router {kind.name} {kind.version} at {self.router_url}: {pairing}"

    def describe_faulty_proxy(self) -> str:
        """One line: where the faulty proxy listens, what it stands in front of, when it hangs."""
        if self.faulty_proxy is None:
            return "no faulty proxy"
        what, url = self.faulty_proxy_target
        low, high = self.faulty_proxy.hang_range
        turns = f"{low}" if low == high else f"{low}-{high}"
        return (f"faulty-proxy {self.faulty_proxy.url} stands in front of {what} {url}: on each client connection,"
                f" the request after {turns} answered turn(s) is swallowed and the connection left open")

    async def stop(self) -> None:
        if self.faulty_proxy is not None:
            await self.faulty_proxy.stop()
            self.faulty_proxy = None
        if self.router is not None:
            await self.router.stop()
            self.router = None
        for worker in (self.prefill, self.decode):
            await worker.stop()
        if self.workdir and not os.environ.get("TRACEPROXY_SIM_KEEP"):
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = ""

    async def __aenter__(self) -> "SimDeployment":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()


# ----------------------------------------------------------------------------------
# The commands
# ----------------------------------------------------------------------------------
async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def run_deployment(deployment: SimDeployment) -> int:
    """Start, print one ``NAME URL`` line per listener on stdout (and, on stderr, which
    router runs and what the faulty proxy stands in front of), run until signalled. A
    failed start raises ``SimStartError``."""
    async with deployment:
        for name, url in deployment.urls():
            print(f"{name} {url}", flush=True)
        if deployment.router is not None:
            print(deployment.describe_router(), file=sys.stderr, flush=True)
        if deployment.faulty_proxy is not None:
            print(deployment.describe_faulty_proxy(), file=sys.stderr, flush=True)
        await _until_signalled()
    return 0


async def run_worker(worker: SimWorker) -> int:
    await worker.start()
    try:
        print(f"{worker.role} {worker.url}", flush=True)
        if worker.role == "prefill":
            print(f"bootstrap {worker.bootstrap_url}", flush=True)
        await _until_signalled()
    finally:
        await worker.stop()
    return 0
