"""The composition root: what starts, in which order, and how it stops.

Start: the proxy context, the client listener, then the admin listener (so
``/healthz`` answering means the proxy port is open). Stop (SIGTERM/SIGINT): stop
accepting, close idle client connections, let in-flight requests finish within
``timeouts.shutdown_grace``, reset what is left, then close the pool and admin.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import time
import traceback

from typing import TYPE_CHECKING

from .allocator import IdleHeapTrim, tune_allocator
from .config import ConfigError, HostPort, Settings, check_appendable, check_otlp_endpoint, named_setting
from .destinations import access_log_destination, admin_url, spans_destination
from .engine_wiring import check_receiver_exposure, engine_receivers
from .lifecycle.hooks import Fanout
from .lifecycle.stall import THRESHOLD_KEYS, StallThresholds
from .observe.metrics import ProxyMetrics
from .observe.watchdog import StallLog, Watchdog
from .observe.worker_view import WorkerView
from .proxy.context import DESCRIPTORS_RESERVED, ServerContext, descriptors_needed
from .proxy.downstream import ClientConnection
from .workers import LocalSource

if TYPE_CHECKING:
    from .admin import ServiceAdmin
    from .admin_http import AdminHttpServer

log = logging.getLogger("traceproxy")

# Net new tracked objects (allocations minus frees) before the cycle collector walks
# the young generation; CPython's default is 700. A request's objects are freed by
# reference counting when it ends, so walking them finds nothing, and a stream
# start leaves about 80 of them alive: at 700, 256 streams starting within 20 ms
# (the benchmark's S2) ran some 25 young and 2 middle collections, 5 to 9 ms of the
# event loop, inside the window where those requests wait to be read. 50,000 lets
# about 600 streams start at once without a collection. That holds only while what
# requests and connections leave behind is freed by reference counting, not left in
# reference cycles for the collector (see docs/architecture.md, "Hot-path rules"
# and "The garbage collector"; tests/test_collector.py).
YOUNG_COLLECTION_THRESHOLD = 50_000

# How long shutdown lets the span exporter export and log what it still holds, after
# the requests' grace, before it is told to stop now (and then killed).
EXPORTER_STOP_TIMEOUT = 5.0

# How often the proxy asks whether it went quiet after work, to give its freed heap
# back (allocator.IdleHeapTrim): a trim comes one to two of these after the last request.
IDLE_TRIM_CHECK_S = 1.0


def tracing_export_config(settings: Settings, environ=os.environ, *, create_files: bool = True):
    """The exporter process's configuration, or None when neither tracing nor the
    access log is on.

    Config keys win; where one is empty the standard OTEL_* variable applies. With
    ``create_files`` false (serve --check) the span and access log files are judged
    from what exists, and nothing is made.
    """
    from .observe.export import ExportConfig

    tracing = settings.tracing
    endpoint_env = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    exporter = tracing.exporter
    if exporter == "auto":
        exporter = "otlp" if (tracing.otlp_endpoint or endpoint_env) else "file"
    access_log = settings.access_log.path
    if exporter == "off" and not access_log:
        return None
    protocol = (tracing.otlp_protocol or environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip().lower()
    if exporter == "otlp" and protocol not in ("grpc", "http/protobuf"):
        raise ConfigError(f"OTLP protocol {protocol!r} (from tracing.otlp_protocol or OTEL_EXPORTER_OTLP_"
                          f"[TRACES_]PROTOCOL): expected grpc or http/protobuf")
    if exporter == "otlp":
        check_otlp_endpoint(settings, environ, protocol)
    if exporter == "file":
        check_appendable(settings, "tracing.file_path", tracing.file_path, create_files)
    if access_log and access_log != "-":
        check_appendable(settings, "access_log.path", access_log, create_files)
    return ExportConfig(
        exporter=exporter,
        otlp_endpoint=tracing.otlp_endpoint,
        otlp_protocol=protocol,
        file_path=tracing.file_path,
        service_name=tracing.service_name or environ.get("OTEL_SERVICE_NAME") or "traceproxy",
        resource_attributes=_resource_attributes(environ.get("OTEL_RESOURCE_ATTRIBUTES", "")),
        queue_spans=tracing.queue_spans,
        nice=tracing.exporter_nice,
        access_log_path=access_log,
        genai_provider=tracing.genai_provider,
    )


def check_settings(settings: Settings, environ=os.environ) -> list[tuple[str, str]]:
    """``serve --check``: the checks serve makes at startup that bind nothing, resolve
    no name and write nothing; then, as (label, value) pairs, what it would listen on,
    forward to and write to.

    Left to startup: whether the ports are free and their names resolve (only binding
    tells, see _check_port_bindable), and whether the upstream answers."""
    export = tracing_export_config(settings, environ, create_files=False)
    check_request_id_headers(settings)
    check_receiver_exposure(settings)
    fit_to_open_file_limit(settings, _open_file_limit(raised=True))  # its warning, as serve would log it
    effective = [
        ("listen", str(settings.listen)),
        ("upstream", str(settings.upstream)),
        ("admin", admin_url(settings.admin)),
        ("spans", spans_destination(export, environ)),
        ("access log", access_log_destination(settings.access_log.path)),
    ]
    receivers = engine_receivers(settings)
    return effective + ([("engine spans", receivers)] if receivers else [])


def check_request_id_headers(settings: Settings) -> None:
    """A request id under a framing, connection or tracing field would be written
    beside the proxy's own (a second Content-Length: every request refused)."""
    from .proxy.headers import PROXY_MANAGED

    names = settings.request_id.headers
    managed = [name for name in names if name.encode("ascii") in PROXY_MANAGED]
    if managed:
        named = named_setting(settings, "request_id.headers", ",".join(names))
        raise ConfigError(f"{named}: {managed[0]} is a header "
                          "the proxy manages itself (framing, connection, forwarding or tracing); expected "
                          "request id headers such as x-request-id")


def _resource_attributes(raw: str) -> dict[str, str]:
    pairs = (item.partition("=") for item in raw.split(",") if "=" in item)
    return {key.strip(): value.strip() for key, _, value in pairs if key.strip()}


class ProxyServer:
    """One process's proxy. ``link`` (a ``workers.WorkerLink``): this process is one
    worker of several, answering the service's parent instead of serving an admin
    listener, and reading the engines through the readings the parent sends."""

    def __init__(self, settings: Settings, fanout: Fanout | None = None, link=None) -> None:
        self.settings = settings
        self.fanout = fanout or Fanout()
        self.link = link
        self.ctx: ServerContext | None = None
        self.export_config = None  # ExportConfig when tracing or the access log is on
        self.spans = "off"  # where the spans go, in the start-up line's words
        self.span_export = None  # SpanExportPipe when tracing is on
        self.tracing = None  # TracingObserver when tracing is on
        self.watchdog: Watchdog | None = None
        self.metrics: ProxyMetrics | None = None
        self.engines = None  # EngineScraper when engine metrics or spans are on, in one process
        self.engine_readings = None  # what correlates requests with the engines: the scraper or the link's readings
        self.engine_side = None  # engine_wiring.LocalEngines when engine metrics or spans are on
        self.prober = None  # StallProber when [engines] probe_on_stall is true
        self.heap_trim: IdleHeapTrim | None = None  # on glibc, unless the operator tuned it
        self._idle_trim_timer: asyncio.TimerHandle | None = None
        self._server: asyncio.base_events.Server | None = None
        self._admin_server: AdminHttpServer | None = None
        self.admin_port: int | None = None
        self.started_ns = time.monotonic_ns()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        check_request_id_headers(self.settings)
        check_receiver_exposure(self.settings)
        await self._start_tracing()
        self.ctx = ServerContext(self.settings, self.fanout)
        self._start_watchdog()
        self._start_metrics()
        await self._start_engines()
        self._start_prober()
        self._start_idle_trim()
        listen = self.settings.listen
        with _binding("listen", listen):
            self._server = await loop.create_server(
                lambda: ClientConnection(self.ctx),
                host=listen.host,
                port=listen.port,
                reuse_port=self.settings.workers > 1,
                backlog=4096,
            )
        if self.tracing is not None:
            self.tracing.server = (listen.host, self.port)
        view = WorkerView(self.ctx, self.metrics, self.watchdog, self.engine_readings, self.prober, self.started_ns)
        if self.link is not None:
            await self.link.serve(view)
        elif self.settings.admin is not None:
            await self._start_admin(view)
        # Everything allocated so far (modules, config, the app itself) lives as long
        # as the process: move it out of the collector's reach, so that a full
        # collection (one landed ~11 ms into the first burst of 256 streams) only
        # walks what requests allocate.
        gc.freeze()
        gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, *gc.get_threshold()[1:])

    async def _start_tracing(self) -> None:
        config = self.export_config = tracing_export_config(self.settings)
        self.spans = spans_destination(config, os.environ)  # for the start-up line and /healthz
        if config is None:
            return
        from .observe.export import SpanExportPipe
        from .observe.tracing import TracingObserver, healthy_ratio_from_environment

        self.span_export = SpanExportPipe(config)
        await self.span_export.start()
        settings = self.settings
        self.tracing = TracingObserver(
            self.span_export,
            server=(settings.listen.host, settings.listen.port),
            upstream=(settings.upstream.host, settings.upstream.port),
            healthy_sample_ratio=healthy_ratio_from_environment(settings.tracing.healthy_sample_ratio),
            spans=config.exporter != "off",
            access_log=bool(config.access_log_path),
            healthy_max_per_second=settings.tracing.healthy_max_per_second,
            healthy_ceiling=self.link.healthy_ceiling if self.link is not None else None,
        )

    def _start_watchdog(self) -> None:
        stall = self.settings.stall
        thresholds = StallThresholds(**{key: getattr(stall, key) for key in THRESHOLD_KEYS})
        abort_kinds = frozenset(THRESHOLD_KEYS) if stall.action == "abort" else frozenset(stall.abort_on)
        ctx = self.ctx
        self.watchdog = Watchdog(ctx.in_flight.values, thresholds, abort_kinds)
        self.stall_log = StallLog()
        self.watchdog.listeners.append(self.stall_log)
        if self.tracing is not None:
            self.watchdog.listeners.append(self.tracing)
        # Order matters at on_done: the watchdog closes a request's open stall
        # (resolved_ns) before the tracer copies the record into its summary.
        self.fanout.add(self.watchdog)
        if self.tracing is not None:
            self.fanout.add(self.tracing)
        self.watchdog.start()

    def _start_metrics(self) -> None:
        self.metrics = ProxyMetrics(self.ctx, self.watchdog, self.span_export, self.tracing)
        self.fanout.add(self.metrics)
        self.watchdog.listeners.append(self.metrics)
        self.ctx.connection_closed_listeners.append(self.metrics.on_client_connection_closed)

    async def _start_engines(self) -> None:
        """The engine scraper, the engine span receiver and the join, only when metrics URLs
        or a receiver are configured: otherwise nothing starts and nothing is added to any path."""
        from .engine_wiring import start_local

        side = self.engine_side = await start_local(self.settings, self.ctx, self.link, self.span_export,
                                                    self.export_config)
        if side is None:
            return
        self.engine_readings = side.readings
        if side.scraper is not None:
            self.engines = self.metrics.engines = side.scraper
        # Readers of the latest gauges and stages: attributes set once per scrape or batch
        # of spans, never a scrape or a wait.
        self.stall_log.engines = side.readings
        if self.tracing is not None:
            if side.readings.scraping:
                self.tracing.engines = side.readings
            self.tracing.stage_join = side.readings.join

    def _start_prober(self) -> None:
        """The fresh-connection stall probe, only when ``probe_on_stall`` is on."""
        engines = self.settings.engines
        if not engines.probe_on_stall:
            return
        from .observe.probe import StallProber

        upstream = self.settings.upstream
        self.prober = StallProber(upstream.host, upstream.port, engines.probe_path, engines.probe_timeout,
                                  authority=upstream.authority)
        self.watchdog.listeners.append(self.prober)

    def _start_idle_trim(self) -> None:
        """Once a second, whether the proxy went quiet after work: then its freed heap goes
        back to the kernel (allocator.IdleHeapTrim), never while a request is in flight."""
        self.heap_trim = IdleHeapTrim.for_this_process()
        if self.heap_trim is None:
            return
        loop = asyncio.get_running_loop()
        requests, in_flight = self.metrics.requests, self.ctx.in_flight

        def tick() -> None:
            try:
                self.heap_trim.check(sum(requests.values()), bool(in_flight))
            finally:  # a check that raised must not end the checks
                self._idle_trim_timer = loop.call_later(IDLE_TRIM_CHECK_S, tick)

        self._idle_trim_timer = loop.call_later(IDLE_TRIM_CHECK_S, tick)

    async def _start_admin(self, view: WorkerView) -> None:
        from .admin import ServiceAdmin

        admin = ServiceAdmin(LocalSource(view), self.settings, self.started_ns, self.engines,
                             stopping=lambda: self.ctx.shutting_down,
                             spans=self.spans)
        self._admin_server, self.admin_port = await start_admin_listener(admin, self.settings.admin)

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    async def shutdown(self, grace: float | None = None, exporter_stop: float = EXPORTER_STOP_TIMEOUT) -> None:
        """Stop taking requests, give those in flight ``grace`` seconds (the configured
        shutdown grace by default), then stop the rest; the span exporter gets
        ``exporter_stop`` seconds to export and log what it still holds before it is
        told to stop now, then killed."""
        grace = self.settings.timeouts.shutdown_grace if grace is None else grace
        ctx = self.ctx
        self._server.close()
        ctx.begin_shutdown()
        deadline = time.monotonic() + grace
        while ctx.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(ctx.connections):
            conn.shut_down(f"shutdown grace of {grace:g} s ran out")
        for exchange in list(ctx.tail_waits):
            exchange.end_without_tail()
        await self._let_clients_take_what_is_written(deadline)
        ctx.pool.close_all()
        self.watchdog.stop()
        if self._idle_trim_timer is not None:
            self._idle_trim_timer.cancel()
        if self.prober is not None:
            self.prober.stop()
        if self.engine_side is not None:
            await self.engine_side.stop()
        if self.span_export is not None:
            await self.span_export.stop(timeout=exporter_stop)
        if self._admin_server is not None:
            await self._admin_server.stop()
        if self.link is not None:
            self.link.close()
        await asyncio.sleep(0)

    async def _let_clients_take_what_is_written(self, deadline: float) -> None:
        """A closed client transport still holds what a slow reader has not taken yet
        (a response that ended within the grace, up to the transport's pause mark):
        it goes out before the connection is gone, within the grace. After it, what is
        left is dropped with a reset, so that no client reads a cut response as whole."""
        connections = self.ctx.connections
        await asyncio.sleep(0)  # the closes with nothing left to send complete now
        while connections and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(connections):
            conn.reset()
        if connections:
            await asyncio.sleep(0)  # their connection_lost runs on the next loop pass


async def start_admin_listener(admin: ServiceAdmin, address: HostPort) -> tuple[AdminHttpServer, int]:
    """The admin listener on ``address``; its server and the port it bound."""
    from .admin import admin_server

    server = admin_server(admin)
    with _binding("admin", address):
        port = await server.start(address.host, address.port)
    return server, port


@contextlib.contextmanager
def _binding(key: str, address: HostPort):
    """An address taken (or not this machine's) is said with its key."""
    try:
        yield
    except OSError as exc:
        raise OSError(exc.errno, f"{key} {address}: {exc.strerror or exc}") from None


STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


async def serve_until_signalled(settings: Settings, link=None) -> None:
    """``link``: this process is a worker of several (see ``ProxyServer``)."""
    server = ProxyServer(settings, link=link)
    await server.start()
    # The addresses actually bound: with port 0 the kernel picked them. A worker's
    # admin listener is the service's, in the parent.
    listen = HostPort(settings.listen.host, server.port)
    admin = settings.admin if link is not None else (
        HostPort(settings.admin.host, server.admin_port) if settings.admin is not None else None)
    log.info("traceproxy listening on %s, upstream %s, admin %s (%spid %d)", listen, settings.upstream,
             admin_url(admin), "worker " if link is not None else "", os.getpid())
    log.info("spans: %s; access log: %s", server.spans,
             access_log_destination(settings.access_log.path))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    # A stop signal that came while starting (held back by run) is taken now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    await stop.wait()
    log.info("shutting down: %d requests in flight, grace %g s", len(server.ctx.in_flight),
             settings.timeouts.shutdown_grace)
    await server.shutdown()


def run(settings: Settings) -> int:
    """Run in this process (workers == 1) or supervise N forked workers.

    Stop signals are held back (blocked, not lost) until the process that gets them
    can act on them: a worker once its event loop's handlers are in place, the parent
    once it relays them. Before that, SIGTERM's default action would end a starting
    worker by the signal (a failed service, status 143) and SIGINT would raise
    KeyboardInterrupt inside its startup. Forked workers inherit the block."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        if settings.workers <= 1:
            _run_one(settings)
            return 0
        return _run_workers(settings)
    finally:
        # A stop asked for during a startup that then failed: the failure is what is
        # said (unblocked, the signal's default action would end the process first).
        while hasattr(signal, "sigtimedwait") and signal.sigpending() & STOP_SIGNALS:  # not on macOS
            signal.sigtimedwait(STOP_SIGNALS, 0)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _run_one(settings: Settings, link=None) -> None:
    import uvloop

    _raise_fd_limit()
    settings = fit_to_open_file_limit(settings)
    log.debug("%s", tune_allocator())
    uvloop.run(serve_until_signalled(settings, link))


def _run_workers(settings: Settings) -> int:
    # Every worker binds the listen port with SO_REUSEPORT and the kernel spreads new
    # connections across them. The parent supervises, relays signals, and is the
    # service's admin side: it serves the admin listener, asking every worker over
    # its link (workers.py), and scrapes the engines once for the service.
    # What every worker would refuse, the parent refuses first: one message, not N.
    spans = spans_destination(tracing_export_config(settings), os.environ)  # as the workers resolve it
    check_request_id_headers(settings)
    check_receiver_exposure(settings)
    _check_port_bindable(settings)
    started_ns = time.monotonic_ns()
    from .observe.tracing import SharedRateCeiling
    from .workers import WorkerLink, WorkerPeer

    healthy_ceiling = SharedRateCeiling.for_service(settings.tracing.healthy_max_per_second, settings.workers)
    pairs = [socket.socketpair() for _ in range(settings.workers)]
    peers: list[WorkerPeer] = []
    parent = os.getpid()
    for index, (parent_end, worker_end) in enumerate(pairs):
        pid = os.fork()
        if pid == 0:
            for other_parent_end, other_worker_end in pairs:  # this worker keeps its own end only
                other_parent_end.close()
                if other_worker_end is not worker_end:
                    other_worker_end.close()
            _stop_when_orphaned(parent)
            os._exit(_worker_main(settings, WorkerLink(worker_end, healthy_ceiling)))
        peers.append(WorkerPeer(pid, parent_end))
    for _, worker_end in pairs:
        worker_end.close()
    return asyncio.run(_supervise(settings, peers, started_ns, spans))


async def _supervise(settings: Settings, peers, started_ns: int, spans: str) -> int:
    """The parent's life once the workers are forked; the service's exit status.
    ``spans``: where the workers' spans go, for the admin listener to say.

    Workers are not restarted: one that ends before the service was asked to stop
    stops the others, and the whole service exits with its status (0 when that worker
    was itself stopped by a signal sent to it), so a supervisor sees it. Reaping and
    relaying both run on this loop, one at a time: a worker is taken out of
    ``running`` as it is reaped, so a relay never signals a PID that may already be
    another process's."""
    loop = asyncio.get_running_loop()
    running = {peer.pid for peer in peers}
    all_ended = asyncio.Event()
    state = {"asked_to_stop": False, "status": 0}

    def relay(signum: int) -> None:
        state["asked_to_stop"] = True
        for child in list(running):
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass

    def reap() -> None:
        while running:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                running.clear()
                break
            if pid == 0:
                break
            running.discard(pid)
            _worker_ended(pid, os.waitstatus_to_exitcode(wait_status))
        if not running:
            all_ended.set()

    def _worker_ended(pid: int, code: int) -> None:
        if state["asked_to_stop"]:
            log.log(logging.WARNING if code else logging.INFO, "worker %d ended: %s", pid, _exit_status(code))
            state["status"] = state["status"] or _service_status(code)
            return
        log.error("worker %d ended before the service was asked to stop (%s): stopping the other %d",
                  pid, _exit_status(code), len(running))
        state["status"] = _service_status(code)
        relay(signal.SIGTERM)

    loop.add_signal_handler(signal.SIGCHLD, reap)
    reap()  # a worker that ended before the handler was in place
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, relay, sig)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    service = await _start_service_admin(settings, peers, started_ns, lambda: state["asked_to_stop"], spans)
    if service is None:  # said why; the workers stop
        state["status"] = 1
        relay(signal.SIGTERM)
    await all_ended.wait()
    if service is not None:
        await service.stop()
    return state["status"]


class _ServiceAdminSide:
    """What the parent runs for the service: the links, the engine side (the scraper and the
    engine span receiver, ``engine_wiring.ServiceEngines``), the admin listener."""

    def __init__(self, links, engines, admin_server) -> None:
        self.links, self.engines, self.admin_server = links, engines, admin_server

    async def stop(self) -> None:
        if self.engines is not None:
            await self.engines.stop()
        if self.admin_server is not None:
            await self.admin_server.stop()
        self.links.close()


async def _start_service_admin(settings: Settings, peers, started_ns: int, stopping,
                               spans: str) -> _ServiceAdminSide | None:
    from .engine_wiring import start_service
    from .workers import WorkerLinks

    links = WorkerLinks(peers, timeout=settings.timeouts.admin_worker_answer)
    # As with one process, /healthz answering means the proxy port is open: the
    # admin listener starts once every worker serves it.
    if not await links.start():
        return _ServiceAdminSide(links, None, None)
    try:
        engines = await start_service(settings, links, _relay_config(settings))
    except OSError as exc:
        log.error("traceproxy: %s; stopping the workers", exc)
        await _ServiceAdminSide(links, None, None).stop()
        return None
    scraper = engines.scraper if engines is not None else None
    admin_listener = None
    if settings.admin is not None:
        from .admin import ServiceAdmin

        admin = ServiceAdmin(links, settings, started_ns, scraper, stopping, spans=spans)
        try:
            admin_listener, port = await start_admin_listener(admin, settings.admin)
        except OSError as exc:
            log.error("traceproxy: %s; stopping the workers", exc)
            await _ServiceAdminSide(links, engines, None).stop()
            return None
        log.info("traceproxy service of %d workers: admin %s (pid %d)", len(peers),
                 admin_url(HostPort(settings.admin.host, port)), os.getpid())
    return _ServiceAdminSide(links, engines, admin_listener)


def _relay_config(settings: Settings):
    """The parent's exporter, for relaying the engines' spans: the workers' span
    destination, without the access log (the workers write it)."""
    import dataclasses

    config = tracing_export_config(settings)
    return None if config is None else dataclasses.replace(config, access_log_path="")


def _exit_status(code: int) -> str:
    if code >= 0:
        return f"exit status {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:  # a real-time signal has no name of its own
        return f"killed by signal {-code}"


def _service_status(code: int) -> int:
    """The status the service exits with for a worker's: killed by a signal, 128 plus its number."""
    return code if code >= 0 else 128 - code


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _stop_when_orphaned(parent: int) -> None:
    """A worker whose parent was killed outright (SIGKILL, the OOM killer) would go on
    serving the port alone, and a restarted service could not bind it. Linux sends
    the worker SIGTERM when its parent dies, and it stops as on any stop signal (held
    back until its handlers are in place, see run). Elsewhere, there is no such
    notice."""
    try:
        import ctypes

        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the notice was asked for
        os.kill(os.getpid(), signal.SIGTERM)


def _worker_main(settings: Settings, link) -> int:
    """A forked worker's whole life; its exit status, never an exception (the child
    must not unwind into the parent's code)."""
    try:
        _run_one(settings, link)
        return 0
    # One write per message: workers failing together must not interleave their lines.
    except ConfigError as exc:
        sys.stderr.write(f"traceproxy: configuration error (worker {os.getpid()}): {exc}\n")
        return 2
    except OSError as exc:
        sys.stderr.write(f"traceproxy: worker {os.getpid()} stopped: {exc}\n")
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def _check_port_bindable(settings: Settings) -> None:
    """Fail in the parent, with one clear message, if a port the workers share is taken.

    The probes do not set SO_REUSEPORT: with it, the bind succeeds beside any
    listener of the same user that set it too (another multi-worker instance), and
    the two would silently share the traffic, proxy and admin ports alike. Each
    probe listens while the next is bound, so the listen and admin addresses may not
    overlap either (a name that resolves to the other's address, a wildcard): the
    kernel judges, as it will for the workers. SO_REUSEADDR, as the workers' own
    listeners set it, lets a restart bind over connections still in TIME_WAIT.

    Each address is probed as the workers' listeners will bind it: every address its
    name resolves to, IPv6 ones IPv6-only (a probe of :: that also took IPv4 would
    clash with a listener on 0.0.0.0 that the workers could bind beside)."""
    probes: list[socket.socket] = []
    try:
        for key, address in (("listen", settings.listen), ("admin", settings.admin)):
            if address is None:
                continue
            with _binding(key, address):
                _probe(_passive_addresses(address), probes)
    finally:
        for probe in probes:
            probe.close()


def _probe(addresses: list[tuple], probes: list[socket.socket]) -> None:
    """Bind and listen on each address; one of a family this host lacks (IPv6 turned
    off) is skipped, as the workers' listeners skip it, unless none could be probed."""
    unsupported: OSError | None = None
    bound = 0
    for family, kind, proto, sockaddr in addresses:
        try:
            probe = socket.socket(family, kind, proto)
        except OSError as exc:
            unsupported = exc
            continue
        probes.append(probe)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        probe.bind(sockaddr)
        probe.listen(1)
        bound += 1
    if not bound and unsupported is not None:
        raise unsupported


def _passive_addresses(address: HostPort) -> list[tuple]:
    """What a listener on ``address`` binds, as asyncio's create_server resolves it."""
    infos = socket.getaddrinfo(address.host or None, address.port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    return list(dict.fromkeys((family, kind, proto, sockaddr) for family, kind, proto, _, sockaddr in infos))


def fit_to_open_file_limit(settings: Settings, soft_limit: int | None = None) -> Settings:
    """Caps client connections to what the open-file limit can hold.

    Every client connection is a descriptor, and so is every upstream connection.
    Past the limit, accept() fails: new clients are reset and nothing says why. At
    a cap below it, the longest-idle connection is closed to make room instead (as at
    any cap), and the warning names the keys and the limit, as nginx warns when
    worker_connections exceed it. The upstream side keeps at least half the room."""
    soft_limit = _open_file_limit() if soft_limit is None else soft_limit
    clients, upstream_cap = settings.limits.max_client_connections, settings.pool.max_connections
    needed = descriptors_needed(clients, upstream_cap)
    if soft_limit is None or needed <= soft_limit:
        return settings
    room = soft_limit - DESCRIPTORS_RESERVED
    fitted = max(1, min(clients, room - min(upstream_cap or clients, room // 2)))
    if fitted >= clients:
        return settings
    log.warning("limits.max_client_connections = %d (from %s) and pool.max_connections = %d (from %s) need about "
                "%d open files, over this process's limit of %d: client connections are capped at %d; raise the "
                "limit (ulimit -n, systemd LimitNOFILE=, docker --ulimit nofile=) or lower the keys",
                clients, settings.source("limits.max_client_connections"), upstream_cap,
                settings.source("pool.max_connections"), needed, soft_limit, fitted)
    return settings.replace(**{"limits.max_client_connections": fitted})


def _open_file_limit(raised: bool = False) -> int | None:
    """This process's soft RLIMIT_NOFILE, or with ``raised`` what _raise_fd_limit
    makes it (the hard limit); None when unlimited or not known."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, ValueError, OSError):
        return None
    limit = hard if raised else soft
    return None if limit == resource.RLIM_INFINITY else limit


def _raise_fd_limit() -> None:
    """Thousands of keep-alive clients need thousands of descriptors."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        print("traceproxy: could not raise the open-file limit", file=sys.stderr)
