"""One benchmark session: the upstream and proxy processes, and measured runs of the load generator.

The session owns its children through ``procs.Children``; leaving the ``with``
block (normally, on an exception or on Ctrl-C) stops each by its process group.
"""

from __future__ import annotations

import json
import select
import shlex
import subprocess
from pathlib import Path

from . import report
from .monitor import CpuWindow, RssSampler, vm_hwm_bytes
from .procs import Child, ChildError, Children, free_port, python_module, wait_listening, wait_port_file
from .scenarios import Scenario

READY_TIMEOUT = 30.0  # load processes opening their connections
EXIT_SLACK = 15.0  # beyond the scenario budget before a load process is killed


class Session:
    def __init__(self, children: Children, workdir: Path, load_procs: int = 1, warmup: bool = True) -> None:
        self.children = children
        self.warmup = warmup
        self.workdir = workdir
        self.load_procs = max(1, load_procs)
        self.upstream: Child | None = None
        self.proxy: Child | None = None
        self.ports: dict[str, int] = {}
        self.rss: RssSampler | None = None
        self._runs = 0

    # -- servers ----------------------------------------------------------------------------
    def start_upstream(self) -> int:
        port_file = self.workdir / "upstream.port"
        self.upstream = self.children.start(
            "upstream", python_module("traceproxy.bench.upstream_proc", "--port-file", str(port_file)))
        self.ports["direct"] = wait_port_file(self.upstream, port_file)
        return self.ports["direct"]

    def start_proxy(self, command: str | None = None, overrides: list[str] | None = None) -> int:
        upstream_port = self.ports["direct"]
        if command:
            port = free_port()
            argv = shlex.split(command.format(port=port, upstream_port=upstream_port))
            self.proxy = self.children.start("proxy", argv)
            wait_listening(self.proxy, port)
        else:
            port_file = self.workdir / "proxy.port"
            args = ["--upstream", f"http://127.0.0.1:{upstream_port}", "--port-file", str(port_file)]
            for item in overrides or []:
                args += ["--set", item]
            self.proxy = self.children.start("proxy", python_module("traceproxy.bench.proxy_proc", *args))
            port = wait_port_file(self.proxy, port_file)
        self.ports["proxy"] = port
        self.rss = RssSampler(self.proxy.pid).start()
        return port

    def proxy_alive(self) -> bool:
        return self.proxy is not None and self.proxy.alive()

    def proxy_memory(self) -> dict:
        """Peak RSS of the proxy: sampled (process tree) and the kernel's VmHWM (leader only)."""
        sampled = self.rss.stop() if self.rss else 0
        hwm = vm_hwm_bytes(self.proxy.pid) if self.proxy_alive() else None
        return {"sampled_peak_bytes": sampled, "vm_hwm_bytes": hwm, "peak_bytes": max(sampled, hwm or 0)}

    # -- measured runs -------------------------------------------------------------------------
    def measure(self, scenario: Scenario, target: str) -> dict:
        """Run one scenario against ``target`` ("direct" or "proxy"); the merged result."""
        self._runs += 1
        loads = [self._start_load(scenario, target, k, offset, count)
                 for k, (offset, count) in enumerate(split(scenario.connections, self.load_procs))]
        try:
            for child, _ in loads:
                _expect_line(child, "ready", READY_TIMEOUT)
            cpu = CpuWindow({"upstream": self.upstream.pid, "proxy": self.proxy.pid})
            if self.rss:
                self.rss.take_window()
            cpu.start()
            for child, _ in loads:
                child.proc.stdin.write(b"go\n")
                child.proc.stdin.flush()
            parts = [_wait_result(child, out, scenario.budget + EXIT_SLACK) for child, out in loads]
            usage = cpu.stop()
        finally:
            for child, _ in loads:
                self.children.stop(child)
        merged = report.merge(parts)
        merged["cpu"] = usage
        if target == "proxy" and self.rss:
            merged["proxy_rss_peak"] = self.rss.take_window()
        return merged

    def _start_load(self, scenario: Scenario, target: str, k: int, offset: int, count: int) -> tuple[Child, Path]:
        stem = f"run{self._runs}-{scenario.name}-{target}-{k}"
        spec_path, out_path = self.workdir / f"{stem}.spec.json", self.workdir / f"{stem}.out.json"
        spec = {**scenario.to_spec(), "host": "127.0.0.1", "port": self.ports[target],
                "connections": count, "offset": offset, "warmup": self.warmup}
        spec_path.write_text(json.dumps(spec))
        argv = python_module("traceproxy.bench.loadgen", "--spec", str(spec_path), "--out", str(out_path))
        return self.children.start(f"load-{stem}", argv, stdin=-1, stdout=-1), out_path


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
