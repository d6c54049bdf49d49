"""Child processes of the benchmark: started in their own session, stopped by process group.

Each child is a new session (``start_new_session``), so a Ctrl-C at the terminal
does not reach it and ``os.killpg`` stops it together with anything it forked.
``Children`` stops every child it started, in reverse order, on any exit path.
Servers report their ephemeral port through a small file written atomically.

A child never shares the bench's own stdout or stdin: unless the caller asks for a
pipe, both are ``/dev/null`` (a server writing to a pipe nobody drains would block),
stderr goes to ``<workdir>/<name>.log``, and the working directory is the run's temp
directory, so nothing a child writes relative to its CWD lands where the bench was
started.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

STOP_GRACE = 3.0  # seconds between SIGTERM and SIGKILL


class ChildError(RuntimeError):
    """A child process failed to start or to answer in time."""


class Child:
    def __init__(self, name: str, argv: list[str], log_path: Path, **popen) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "wb")
        popen.setdefault("stdin", subprocess.DEVNULL)
        popen.setdefault("stdout", subprocess.DEVNULL)
        popen.setdefault("cwd", log_path.parent)
        popen.setdefault("env", child_environment())
        try:
            self.proc = subprocess.Popen(argv, start_new_session=True, stderr=self._log, **popen)
        except OSError as exc:  # no such program, not executable
            self._log.close()
            raise ChildError(f"{name}: cannot run {argv[0]!r}: {exc.strerror or exc}") from None
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, limit: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-limit:].decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self, grace: float = STOP_GRACE, leader_grace: float = 0.0) -> int | None:
        """SIGTERM the process group, then SIGKILL it if the leader has not exited within ``grace``.

        With ``leader_grace``, first SIGTERM the leader alone and give it that long to
        stop its own children in order (a proxy flushing its span exporter), since a
        group signal would reach those children at the same moment."""
        if leader_grace > 0 and self.alive():
            try:
                os.kill(self.pid, signal.SIGTERM)
                self.proc.wait(leader_grace)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        if self.alive():
            _signal_group(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        # Also reaps anything the child forked and left behind in its group.
        _signal_group(self.pid, signal.SIGKILL)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._log.close()
        return self.proc.returncode


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Children:
    """A context manager owning every child started through it."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[Child] = []

    def start(self, name: str, argv: list[str], **popen) -> Child:
        child = Child(name, argv, self.workdir / f"{name}.log", **popen)
        self.started.append(child)
        return child

    def stop(self, child: Child, leader_grace: float = 0.0, grace: float = STOP_GRACE) -> int | None:
        """Stop ``child`` once; a child stopped already is left alone (its exit status): its
        process group's id may be another group's by now."""
        if child not in self.started:
            return child.proc.returncode
        # Registered until it is gone: an interrupt during its grace period must still
        # leave it to ``__exit__``, which escalates to SIGKILL.
        code = child.stop(grace=grace, leader_grace=leader_grace)
        self.started.remove(child)
        return code

    def __enter__(self) -> "Children":
        return self

    def __exit__(self, *exc) -> None:
        # A second Ctrl-C must not cut the cleanup short.
        previous = _ignore_sigint()
        try:
            while self.started:
                self.started.pop().stop()
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)


def _ignore_sigint():
    try:
        return signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        return None


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def child_environment() -> dict[str, str]:
    """This environment, with the directory holding this ``traceproxy`` first on
    PYTHONPATH: children run in the temp directory, and a checkout that is not
    installed must still be importable there (harmless when it is installed)."""
    import site

    import traceproxy

    env = dict(os.environ)
    root = Path(traceproxy.__file__).resolve().parent.parent
    installed = {Path(d).resolve() for d in [*site.getsitepackages(), site.getusersitepackages()]}
    if root not in installed:  # a site directory ahead of the stdlib could shadow it
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    return env


def wait_port_file(child: Child, path: Path, timeout: float = 15.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return int(path.read_text().strip())
        if not child.alive():
            raise ChildError(f"{child.name} exited with {child.proc.returncode}:\n{child.log_tail()}")
        time.sleep(0.02)
    raise ChildError(f"{child.name} did not report its port within {timeout:g} s:\n{child.log_tail()}")


def wait_listening(child: Child, port: int, timeout: float = 15.0) -> None:
    """For commands that cannot write a port file: poll until the port accepts a connection."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not child.alive():
            raise ChildError(f"{child.name} exited with {child.proc.returncode}:\n{child.log_tail()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise ChildError(f"{child.name} did not listen on 127.0.0.1:{port} within {timeout:g} s:\n{child.log_tail()}")


# --- helpers for the server entries (run inside the child) -------------------------------


def write_port_file(path: str, port: int) -> None:
    write_atomically(path, str(port))


def write_json_file(path: str, data) -> None:
    write_atomically(path, json.dumps(data))


def write_atomically(path: str, text: str) -> None:
    """Written whole or not at all: the parent polls for the file and reads it at once."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


async def wait_for_stop_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def raise_fd_limit() -> None:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass
