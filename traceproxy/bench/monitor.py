"""CPU and memory of the benchmark's server processes, read with psutil.

A process is measured with its descendants (a proxy given by ``--proxy-cmd`` may
fork workers; a traced traceproxy has its span exporter process). CPU is read as a
before/after snapshot around each measured run; RSS of the whole tree is sampled by a
background thread for the peak, and each process's VmHWM is read at the end.
"""

from __future__ import annotations

import threading
import time

import psutil


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def cpu_seconds(pid: int, tree: bool = True) -> float | None:
    """User plus system CPU seconds of a process and (``tree``) its descendants; None
    once the process itself is gone.

    A descendant that exited is counted in the ``children_*`` times of the parent
    that reaped it, so the tree's total never drops when one exits (a worker, a
    restarted exporter) between two readings."""
    procs = _tree(pid) if tree else _tree(pid)[:1]
    if not procs:
        return None
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
        if tree:
            total += times.children_user + times.children_system
    return total


def descendant_running(pid: int, module: str, timeout: float = 5.0) -> int | None:
    """The pid of the first descendant of ``pid`` running ``python -m module``, waited for up to
    ``timeout`` seconds; None if there is none by then."""
    deadline = time.monotonic() + timeout
    while True:
        for proc in _tree(pid)[1:]:
            try:
                if module in proc.cmdline():
                    return proc.pid
            except psutil.Error:
                continue
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def rss_bytes(pid: int) -> int:
    total = 0
    for proc in _tree(pid):
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total


def vm_hwm_bytes(pid: int) -> int | None:
    """The kernel's peak RSS of one process (Linux), or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def tree_hwm(pid: int) -> list[dict]:
    """Each process of a tree with its kernel peak RSS (VmHWM), the root first."""
    out = []
    for proc in _tree(pid):
        try:
            name = (" ".join(proc.cmdline()[:4]) or proc.name())[:120]
        except psutil.Error:
            name = "?"
        out.append({"pid": proc.pid, "name": name, "vm_hwm_bytes": vm_hwm_bytes(proc.pid)})
    return out


class CpuWindow:
    """CPU % of some processes between ``start()`` and ``stop()`` (100 = one core).

    ``trees`` are measured with their descendants, ``singles`` alone (so that
    a tree minus its root tells what the root's children used)."""

    def __init__(self, trees: dict[str, int], singles: dict[str, int] | None = None) -> None:
        self.pids = {name: (pid, True) for name, pid in trees.items()}
        self.pids.update({name: (pid, False) for name, pid in (singles or {}).items()})
        self._t0 = 0.0
        self._cpu0: dict[str, float] = {}

    def _read(self) -> dict[str, float]:
        return {name: cpu_seconds(pid, tree) for name, (pid, tree) in self.pids.items()}

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._cpu0 = self._read()

    def seconds(self, name: str) -> float | None:
        """CPU seconds of one of them since ``start()``, read now (None: not there at both ends)."""
        pid, tree = self.pids[name]
        now, then = cpu_seconds(pid, tree), self._cpu0.get(name)
        return None if now is None or then is None else max(0.0, now - then)

    def stop(self) -> dict[str, float | None]:
        """None for a process that was not there at both ends: it exited (or never
        started) during the window, and what it used is unknown."""
        wall = max(time.monotonic() - self._t0, 1e-9)
        now = self._read()
        return {name: None if now[name] is None or self._cpu0[name] is None
                else round(100 * max(0.0, now[name] - self._cpu0[name]) / wall, 1) for name in self.pids}


def busy_percent(pids: list[int], window: float) -> float:
    """CPU % (100 = one core) of these process trees over the next ``window`` seconds."""
    before = sum(cpu_seconds(pid) or 0.0 for pid in pids)
    time.sleep(window)
    return 100 * max(0.0, sum(cpu_seconds(pid) or 0.0 for pid in pids) - before) / window


class RssSampler:
    """Samples the RSS of one process tree every ``interval`` seconds in a daemon thread."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid = pid
        self.interval = interval
        self.peak = 0
        self.window_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        rss = rss_bytes(self.pid)
        self.peak = max(self.peak, rss)
        self.window_peak = max(self.window_peak, rss)

    def take_window(self) -> int:
        """The peak since the last call, then start a new window."""
        self.sample()
        peak, self.window_peak = self.window_peak, 0
        return peak

    def start(self) -> "RssSampler":
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(2)
        self.sample()
        return self.peak
