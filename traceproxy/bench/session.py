"""One benchmark session: the upstream, the proxies, the OTLP sink, and measured runs of the load generator.

Targets: ``direct`` (the upstream itself), ``bare`` (traceproxy with tracing, the
access log and the admin listener off), ``proxy`` (the same, or any ``--proxy-cmd``),
``proxy-traced`` (traceproxy exporting spans over OTLP http/protobuf to the sink),
``proxy-logged`` (traceproxy writing its access log to a file in the run's temp
directory), ``proxy-receiver`` and ``proxy-receiver-grpc`` (``proxy`` with the engine span
receiver on, over OTLP/HTTP or OTLP/gRPC) and ``defaults`` (``serve`` as shipped: spans to the local file, the access
log to stdout, the admin listener on). Each is its own process tree, all started up
front, so runs of different targets can be interleaved.

Each run's CPU of a proxy's tree (its exporter process included) is read once the
tree is quiet again after the load ends, not when the load ends: an exporter behind
by a queue's worth of spans does that work afterwards, and users pay for it too.
Divided by the requests answered, it is the run's CPU µs per request.

The session owns its children through ``procs.Children``; leaving the ``with``
block (normally, on an exception or on Ctrl-C) stops each by its process group.
With ``workers`` above 1 every in-tree target is a service of that many workers
(``traceproxy serve --workers N``). With ``scrape_every`` its admin listener is on and
``/metrics`` is read that often during each measured run, as Prometheus would, so the
run measures what being scraped costs; each run's result says how many scrapes there
were and how long they took.

With ``engine_span_rate`` two emulated SGLang workers (``span_load``, prefill and decode)
export the spans of that many requests a second each during every measured run, started
before the run's CPU window and stopped, by process group, once its load has ended (before
the proxy's drain, which they would otherwise keep busy). A receiver target's loads export to
its receiver; every other target's, the same loads doing the same work, to the discard sink
(``discard_proc``), so that each side of a comparison pays the emulated engines' own CPU and
the difference is what receiving costs. The receivers' process (a child of the proxy's) is
measured apart as well as in the proxy's tree.

``finish`` reads memory and the counters, and stops ``proxy-traced`` and
``proxy-logged`` in order (the leader first, so its exporter process drains into the
sink or the log file) before the sink reports.
"""

from __future__ import annotations

import json
import os
import select
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..observe.metrics import prometheus_totals
from ..ports import free_port
from . import report
from .monitor import CpuWindow, RssSampler, busy_percent, descendant_running, tree_hwm
from .procs import (Child, ChildError, Children, child_environment, python_module, wait_listening,
                    wait_port_file)
from .proxy_proc import defaults_overrides, logged_overrides, minimal_overrides, receiver_overrides, traced_overrides
from .scenarios import Scenario

READY_TIMEOUT = 30.0  # load processes opening their connections
EXIT_SLACK = 15.0  # beyond the scenario budget before a load process is killed
DRAIN_STOP_GRACE = 10.0  # traced/logged: 1 s request grace, then the exporter process drains (up to 5 s)
SETTLE_WINDOW, SETTLE_BUSY, SETTLE_MAX = 0.2, 10.0, 15.0  # quiet: < SETTLE_BUSY % CPU over a window
DRAIN_WINDOW, DRAIN_MAX = 0.1, 10.0  # a proxy's tree after the load: quiet over a window, or at most this long
HTTP_TIMEOUT = 5.0
ENGINE_LEAD_S = 1.0  # the span loads export this long before the run's window, so the receiver is at its pace
ENGINE_ROLES = ("prefill", "decode")
ENGINE_STOP_GRACE_S = 5.0  # past an export still waiting for its answer (span_load.SEND_TIMEOUT_S) and the exit
RECEIVER_MODULE = "traceproxy.observe.engine_receiver_main"


@dataclass
class ProxyProcess:
    target: str
    child: Child
    port: int
    rss: RssSampler
    admin_port: int | None = None
    command: str | None = None  # --proxy-cmd, when not in-tree traceproxy
    engine_url: str | None = None  # a receiver target's: where the engine span loads export
    receiver_pid: int | None = None  # the receivers' process, a child of the proxy's


class Session:
    def __init__(self, children: Children, workdir: Path, load_procs: int = 1, warmup: bool = True,
                 workers: int = 1, scrape_every: float = 0.0, engine_span_rate: float = 0.0) -> None:
        self.children = children
        self.engine_span_rate = engine_span_rate
        self.workers = workers
        self.scrape_every = scrape_every
        self.warmup = warmup
        self.workdir = workdir
        self.load_procs = max(1, load_procs)
        self.upstream: Child | None = None
        self.sink: Child | None = None
        self.discard: Child | None = None
        self.proxies: dict[str, ProxyProcess] = {}
        self.ports: dict[str, int] = {}
        self.settle_waits: list[float] = []
        self._runs = 0

    # -- servers ----------------------------------------------------------------------------
    def start_upstream(self) -> int:
        port_file = self.workdir / "upstream.port"
        self.upstream = self.children.start(
            "upstream", python_module("traceproxy.bench.upstream_proc", "--port-file", str(port_file)))
        self.ports["direct"] = wait_port_file(self.upstream, port_file)
        return self.ports["direct"]

    def start_sink(self) -> int:
        self.sink = self._start_counting_server("otlp-sink", "traceproxy.bench.sink_proc", "sink")
        return self.ports["sink"]

    def start_discard(self) -> int:
        """The engine span loads' destination for targets without a receiver."""
        self.discard = self._start_counting_server("span-discard", "traceproxy.bench.discard_proc", "discard")
        return self.ports["discard"]

    def _start_counting_server(self, name: str, module: str, key: str) -> Child:
        """A server of the bench's own (``python -m module``), its port in ``self.ports[key]``;
        it writes its counts to ``key``'s stats file when stopped (``_stop_counting_server``)."""
        port_file = self.workdir / f"{key}.port"
        argv = python_module(module, "--port-file", str(port_file), "--stats-file", str(self._stats_file(key)))
        child = self.children.start(name, argv)
        self.ports[key] = wait_port_file(child, port_file)
        return child

    def _stop_counting_server(self, child: Child, key: str) -> dict | None:
        """Stop it; the counts it wrote on the way out, None when it wrote none."""
        self.children.stop(child)
        try:
            return json.loads(self._stats_file(key).read_text())
        except (OSError, ValueError):
            return None

    def _stats_file(self, key: str) -> Path:
        return self.workdir / f"{key}.stats.json"

    def start_proxy(self, target: str = "proxy", command: str | None = None,
                    overrides: list[str] | None = None) -> int:
        """Start one proxy target. ``command`` (``--proxy-cmd``) replaces traceproxy for ``proxy`` only;
        ``overrides`` (``--proxy-set``) apply after the target's own keys."""
        upstream_port = self.ports["direct"]
        admin_port = engine_url = None
        if target == "proxy" and command:
            port = free_port()
            argv = shlex.split(command.format(port=port, upstream_port=upstream_port))
            child = self.children.start(target, argv, cwd=os.getcwd())  # relative paths as the user typed them
            wait_listening(child, port)
        else:
            if target in ("proxy", "bare"):
                keys = minimal_overrides()
            elif target == "defaults":
                keys = defaults_overrides()
            elif target == "proxy-traced":
                if "sink" not in self.ports:
                    self.start_sink()
                keys = traced_overrides(f"http://127.0.0.1:{self.ports['sink']}")
            elif target == "proxy-logged":
                keys = logged_overrides(str(self.access_log_path))
            elif target in report.RECEIVERS:
                receiver_port = free_port()
                protocol = report.RECEIVERS[target]
                keys = receiver_overrides(**{f"{protocol}_port": receiver_port})
                engine_url = f"http://127.0.0.1:{receiver_port}/v1/traces" if protocol == "http" \
                    else f"grpc://127.0.0.1:{receiver_port}"
            else:
                raise ValueError(f"not a proxy target: {target}")
            if self.scrape_every:
                keys = [*keys, "admin=127.0.0.1:0"]
            if self.workers > 1:
                port, admin_port, child = self._start_workers(target, keys, overrides)
            else:
                port, admin_port, child = self._start_one(target, keys, overrides)
        receiver_pid = descendant_running(child.pid, RECEIVER_MODULE) if engine_url else None
        if engine_url and receiver_pid is None:
            raise ChildError(f"{target}: no engine span receiver process under the proxy's:\n{child.log_tail()}")
        self.proxies[target] = ProxyProcess(target, child, port, RssSampler(child.pid).start(), admin_port,
                                            command if target == "proxy" else None, engine_url, receiver_pid)
        self.ports[target] = port
        return port

    def _start_one(self, target: str, keys: list[str], overrides: list[str] | None) -> tuple[int, int | None, Child]:
        port_file, admin_file = self.workdir / f"{target}.port", self.workdir / f"{target}.admin-port"
        args = ["--upstream", f"http://127.0.0.1:{self.ports['direct']}", "--port-file", str(port_file),
                "--admin-port-file", str(admin_file)]
        for item in [*keys, *(overrides or [])]:
            args += ["--set", item]
        child = self.children.start(target, python_module("traceproxy.bench.proxy_proc", *args),
                                    env=_proxy_environment())
        port = wait_port_file(child, port_file)
        admin_port = int(admin_file.read_text().strip()) if admin_file.exists() else None
        return port, admin_port, child

    def _start_workers(self, target: str, keys: list[str], overrides: list[str] | None) -> tuple[int, int | None, Child]:
        """A service of ``workers`` workers: the bench picks its ports (they must be fixed) and
        waits for the admin listener, which the service opens once every worker serves."""
        port = free_port()
        wants_admin = any(key.startswith("admin=") and key != "admin=off" for key in keys)
        admin_port = free_port() if wants_admin else None
        args = ["--upstream", f"http://127.0.0.1:{self.ports['direct']}", "--workers", str(self.workers),
                "--listen-port", str(port)]
        if admin_port:
            args += ["--admin-port", str(admin_port)]
        for item in [*keys, *(overrides or [])]:
            if not item.startswith("admin="):
                args += ["--set", item]
        child = self.children.start(target, python_module("traceproxy.bench.proxy_proc", *args),
                                    env=_proxy_environment())
        wait_listening(child, admin_port or port, timeout=30.0)
        return port, admin_port, child

    @property
    def access_log_path(self) -> Path:
        return self.workdir / "proxy-logged.access.jsonl"

    def proxy_alive(self, target: str = "proxy") -> bool:
        proxy = self.proxies.get(target)
        return proxy is not None and proxy.child.alive()

    def server_pids(self) -> list[int]:
        children = [self.upstream, self.sink, self.discard, *(p.child for p in self.proxies.values())]
        return [c.pid for c in children if c is not None and c.alive()]

    def settle(self) -> float:
        """Wait until the servers are idle (a traced proxy's exporter may still be sending the
        last run's spans), so no run pays for the one before; the seconds waited."""
        started = time.monotonic()
        while busy_percent(self.server_pids(), SETTLE_WINDOW) >= SETTLE_BUSY:
            if time.monotonic() - started > SETTLE_MAX:
                print(f"bench: servers still busy after {SETTLE_MAX:g} s; measuring anyway",
                      file=sys.stderr, flush=True)
                break
        waited = time.monotonic() - started
        self.settle_waits.append(round(waited, 3))
        return waited

    # -- measured runs -------------------------------------------------------------------------
    def measure(self, scenario: Scenario, target: str) -> dict:
        """Run one scenario against ``target``; the merged result."""
        self._runs += 1
        settled = self.settle()
        proxy = self.proxies.get(target)
        receiving = proxy is not None and proxy.engine_url is not None  # the engine loads export to its receiver
        engines = self._start_engine_loads(scenario, target, proxy.engine_url if receiving else None) \
            if self.engine_span_rate else []
        loads = [self._start_load(scenario, target, k, offset, count)
                 for k, (offset, count) in enumerate(split(scenario.connections, self.load_procs))]
        engine_parts: list[dict] = []
        try:
            for child, _ in [*loads, *engines]:
                _expect_line(child, "ready", READY_TIMEOUT)
            if engines:
                _say_go(engines)
                time.sleep(ENGINE_LEAD_S)
            trees = {"upstream": self.upstream.pid}
            singles = {}
            if proxy is not None:
                trees["proxy"] = proxy.child.pid
                if proxy.command is None and self.workers == 1:  # its only child process is the span exporter
                    singles["proxy_main"] = proxy.child.pid
            if target == "proxy-traced" and self.sink is not None:
                trees["sink"] = self.sink.pid
            if proxy is not None and proxy.receiver_pid is not None:
                singles["receiver"] = proxy.receiver_pid
            for role, (child, _) in zip(ENGINE_ROLES, engines):
                trees[f"engine_{role}"] = child.pid
            if engines and not receiving:
                trees["discard"] = self.discard.pid
            cpu = CpuWindow(trees, singles)
            if proxy is not None:
                proxy.rss.take_window()
            scraper = _Scraper(proxy.admin_port, self.scrape_every) if proxy and proxy.admin_port and \
                self.scrape_every else None
            cpu.start()
            _say_go(loads)
            if scraper is not None:
                scraper.start()
            try:
                parts = [_wait_result(child, out, scenario.budget + EXIT_SLACK) for child, out in loads]
            finally:
                scrapes = scraper.stop() if scraper is not None else None
            usage = cpu.stop()
            engine_parts = self._stop_engine_loads(engines)  # before the drain, which they would keep busy
            proxy_cpu_s = self._cpu_after_drain(cpu, proxy) if proxy is not None else None
        finally:
            for child, _ in [*loads, *engines]:  # the engine loads are stopped already, unless this is an error
                self.children.stop(child)
        merged = report.merge(parts)
        if "proxy_main" in usage:
            main, tree = usage.pop("proxy_main"), usage["proxy"]
            # the tree less the proxy's own process: its children, the exporter and the receivers' process
            children = None if main is None or tree is None else tree - main - (usage.get("receiver") or 0.0)
            usage["exporter"] = None if children is None else round(max(0.0, children), 1)
        if engines:
            usage["engines"] = _sum_known(usage.pop(f"engine_{role}", None) for role in ENGINE_ROLES)
            merged["engine_loads"] = engine_parts
            merged["engine_destination"] = report.RECEIVERS[target] if receiving else "discard"
        merged["cpu"] = usage
        merged["proxy_cpu_s"] = proxy_cpu_s
        merged["settle_s"] = round(settled, 3)
        if scrapes is not None:
            merged["scrapes"] = scrapes
        if proxy is not None:
            merged["proxy_rss_peak"] = proxy.rss.take_window()
        return merged

    @staticmethod
    def _cpu_after_drain(cpu: CpuWindow, proxy: ProxyProcess) -> float | None:
        """CPU seconds of the proxy's tree from the run's start until it is quiet again."""
        started = time.monotonic()
        while busy_percent([proxy.child.pid], DRAIN_WINDOW) >= SETTLE_BUSY:
            if time.monotonic() - started > DRAIN_MAX:
                break
        return cpu.seconds("proxy")

    def _start_engine_loads(self, scenario: Scenario, target: str,
                            receiver_url: str | None) -> list[tuple[Child, Path]]:
        """The two emulated engines' span exports for one run: to the target's receiver, or the discard sink."""
        url = receiver_url or f"http://127.0.0.1:{self.ports['discard']}/v1/traces"
        longest = READY_TIMEOUT + ENGINE_LEAD_S + scenario.budget + EXIT_SLACK + DRAIN_MAX
        started = []
        for role in ENGINE_ROLES:
            out = self.workdir / f"run{self._runs}-{scenario.name}-{target}-engine-{role}.json"
            argv = python_module("traceproxy.bench.span_load", "--role", role, "--rate", f"{self.engine_span_rate:g}",
                                 "--url", url, "--out", str(out), "--max-seconds", f"{longest:g}")
            started.append((self.children.start(f"engine-{role}-run{self._runs}", argv, stdin=subprocess.PIPE,
                                                stdout=subprocess.PIPE), out))
        return started

    def _stop_engine_loads(self, engines: list[tuple[Child, Path]]) -> list[dict]:
        """Stop each by its process group (it writes its counts on SIGTERM); what each sent."""
        parts = []
        for child, out in engines:
            code = self.children.stop(child, grace=ENGINE_STOP_GRACE_S)
            try:
                parts.append(json.loads(out.read_text()))
            except (OSError, ValueError):
                raise ChildError(f"{child.name} left no counts (exit status {code}):\n{child.log_tail()}") from None
        return parts

    def _start_load(self, scenario: Scenario, target: str, k: int, offset: int, count: int) -> tuple[Child, Path]:
        stem = f"run{self._runs}-{scenario.name}-{target}-{k}"
        spec_path, out_path = self.workdir / f"{stem}.spec.json", self.workdir / f"{stem}.out.json"
        spec = {**scenario.to_spec(), "host": "127.0.0.1", "port": self.ports[target],
                "connections": count, "offset": offset, "warmup": self.warmup}
        spec_path.write_text(json.dumps(spec))
        argv = python_module("traceproxy.bench.loadgen", "--spec", str(spec_path), "--out", str(out_path))
        return self.children.start(f"load-{stem}", argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE), out_path

    # -- the end of the session ------------------------------------------------------------------
    def finish(self) -> dict:
        """Memory of each proxy; then for proxy-traced and proxy-logged their counters and an
        orderly stop, so the exporter process drains into the sink or the log file; then the
        sink's final counts and the log's lines. Call once, after the runs."""
        self.settle()  # an exporter process may still be sending the last run's spans or lines
        memory = {target: self._memory(proxy) for target, proxy in self.proxies.items()}
        tracing, access_log = self._drain("proxy-traced"), self._drain("proxy-logged")
        if self.sink is not None:
            tracing["sink"] = self._stop_sink()
        if "proxy-logged" in self.proxies:
            access_log["file"] = _file_lines(self.access_log_path)
        end = {"memory": memory, "tracing": tracing, "access_log": access_log}
        if self.discard is not None:
            end["engine_discard"] = self._stop_discard()
        return end

    def _stop_discard(self) -> dict:
        """The discard sink's counts: the export requests it took for the targets without a receiver."""
        return self._stop_counting_server(self.discard, "discard") or {}

    def _drain(self, target: str) -> dict:
        proxy = self.proxies.get(target)
        if proxy is None:
            return {}
        counters = {"proxy_metrics_before_stop": self._span_metrics(proxy)}
        self.children.stop(proxy.child, leader_grace=DRAIN_STOP_GRACE)
        counters["proxy_exit_code"] = proxy.child.proc.returncode
        return counters

    def _memory(self, proxy: ProxyProcess) -> dict:
        """Peak RSS of a proxy's process tree: sampled (tree sum) and each process's VmHWM."""
        sampled = proxy.rss.stop()
        processes = tree_hwm(proxy.child.pid) if proxy.child.alive() else []
        hwm_sum = sum(p["vm_hwm_bytes"] or 0 for p in processes)
        return {"sampled_peak_bytes": sampled, "processes": processes, "vm_hwm_sum_bytes": hwm_sum or None,
                "peak_bytes": max(sampled, hwm_sum)}

    def _span_metrics(self, proxy: ProxyProcess) -> dict:
        if proxy.admin_port is None:
            return {}
        try:
            text = _http_get(f"http://127.0.0.1:{proxy.admin_port}/metrics").decode()
        except OSError as exc:
            return {"error": str(exc)}
        totals = prometheus_totals(text)
        return {key: totals.get(f"traceproxy_{key}") for key in
                ("requests_total", "spans_dropped_total", "spans_shed_total", "spans_exported_total")}

    def sink_stats(self) -> dict | None:
        if "sink" not in self.ports:
            return None
        try:
            return json.loads(_http_get(f"http://127.0.0.1:{self.ports['sink']}/stats"))
        except (OSError, ValueError):
            return None

    def _stop_sink(self) -> dict:
        last = self.sink_stats()
        stats = self._stop_counting_server(self.sink, "sink")
        return stats if stats is not None else last or {}


class _Scraper:
    """GET /metrics every ``every`` seconds in a thread, as a Prometheus server would."""

    def __init__(self, admin_port: int, every: float) -> None:
        self.url, self.every = f"http://127.0.0.1:{admin_port}/metrics", every
        self.took: list[float] = []
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            started = time.monotonic()
            try:
                _http_get(self.url)
            except OSError:
                self.failed += 1
                continue
            self.took.append(time.monotonic() - started)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(HTTP_TIMEOUT + 1)
        took = sorted(self.took)
        return {"count": len(took), "failed": self.failed,
                "p50_ms": round(1000 * took[len(took) // 2], 2) if took else None,
                "max_ms": round(1000 * took[-1], 2) if took else None}


def _proxy_environment() -> dict[str, str]:
    """The in-tree proxies run with the bench's settings only: no OTEL_* variable from the
    caller's environment changes their endpoint, sampling, headers or compression."""
    return {k: v for k, v in child_environment().items() if not k.startswith("OTEL_")}


_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never an *_proxy variable


def _http_get(url: str) -> bytes:
    with _LOCAL.open(url, timeout=HTTP_TIMEOUT) as response:
        return response.read()


def _file_lines(path: Path) -> dict:
    try:
        size, lines = path.stat().st_size, 0
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                lines += chunk.count(b"\n")
    except OSError:
        return {"bytes": 0, "lines": 0}
    return {"bytes": size, "lines": lines}


def split(total: int, parts: int) -> list[tuple[int, int]]:
    """``total`` connections over ``parts`` processes as (offset, count), none empty."""
    parts = max(1, min(parts, total))
    base, extra = divmod(total, parts)
    shares, offset = [], 0
    for k in range(parts):
        count = base + (1 if k < extra else 0)
        shares.append((offset, count))
        offset += count
    return shares


def _say_go(children: list[tuple[Child, Path]]) -> None:
    for child, _ in children:
        child.proc.stdin.write(b"go\n")
        child.proc.stdin.flush()


def _sum_known(values) -> float | None:
    known = [v for v in values if v is not None]
    return round(sum(known), 1) if known else None


def _expect_line(child: Child, word: str, timeout: float) -> None:
    stream = child.proc.stdout
    ready, _, _ = select.select([stream], [], [], timeout)
    line = stream.readline().decode(errors="replace").strip() if ready else ""
    if line != word:
        raise ChildError(f"{child.name}: expected {word!r}, got {line!r} within {timeout:g} s:\n{child.log_tail()}")


def _wait_result(child: Child, out: Path, timeout: float) -> dict:
    try:
        child.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise ChildError(f"{child.name} still running after {timeout:g} s") from None
    if child.proc.returncode != 0 or not out.exists():
        raise ChildError(f"{child.name} exited with {child.proc.returncode}:\n{child.log_tail()}")
    return json.loads(out.read_text())
