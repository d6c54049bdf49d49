"""``traceproxy serve`` as operators run it: a real process, its admin endpoint,
graceful shutdown on SIGTERM, and several workers sharing one port."""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from traceproxy.sim.launch import free_port

from .support import RawClient, wait_until

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def upstream_process():
    proc = subprocess.Popen([sys.executable, "-m", "traceproxy", "upstream"], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "listening on" in line, line
    yield line.rsplit(" ", 1)[1].strip()
    proc.terminate()
    proc.wait(10)


def _serve(upstream: str, *extra: str, env: dict | None = None):
    port, admin = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "traceproxy", "serve", "--listen", f"127.0.0.1:{port}", "--upstream", upstream,
         "--admin", f"127.0.0.1:{admin}", *extra],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "TRACEPROXY_TRACING_EXPORTER": "off", "TRACEPROXY_ACCESS_LOG_PATH": "",
             **(env or {})},
    )
    ok = wait_until(lambda: _healthz(admin) is not None or proc.poll() is not None, timeout=15, interval=0.05)
    assert ok and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else "no /healthz"
    return proc, port, admin


def _healthz(admin: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/healthz", timeout=1) as resp:
            return json.loads(resp.read())
    except OSError:
        return None


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_bad_config_value_is_a_startup_error_naming_the_key():
    result = subprocess.run([sys.executable, "-m", "traceproxy", "serve", "--pool-idle-timeout", "soon"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "pool.idle_timeout" in result.stderr and "--pool-idle-timeout" in result.stderr


def test_bad_environment_value_is_a_startup_error_naming_the_variable():
    result = subprocess.run([sys.executable, "-m", "traceproxy", "serve"], capture_output=True, text=True,
                            timeout=30, env={**os.environ, "TRACEPROXY_WORKERS": "many"})
    assert result.returncode == 2 and "TRACEPROXY_WORKERS" in result.stderr


def test_version():
    result = subprocess.run([sys.executable, "-m", "traceproxy", "--version"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout.startswith("traceproxy ")


def test_serve_proxies_and_reports_health(upstream_process):
    proc, port, admin = _serve(upstream_process, "--log-level", "debug")
    try:
        health = _healthz(admin)
        assert health["status"] == "ok" and health["upstream"] == upstream_process
        resp = RawClient(port).roundtrip("POST", "/v1/chat/completions", body=b'{"stream": true}')
        assert resp.status == 200 and resp.body.rstrip().endswith(b"data: [DONE]")
    finally:
        _stop(proc)
    assert proc.returncode == 0
    if platform.libc_ver()[0] == "glibc":  # the worker tuned its allocator before serving
        assert "allocator: heap buffers up to" in proc.stderr.read()


def test_serve_logs_the_ports_it_bound_when_asked_for_any(upstream_process):
    proc = subprocess.Popen(
        [sys.executable, "-m", "traceproxy", "serve", "--listen", "127.0.0.1:0", "--upstream", upstream_process,
         "--admin", "127.0.0.1:0", "--tracing-exporter", "off", "--access-log-path", ""],
        stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        for _ in range(50):  # startup lines before it, if any, are few
            line = proc.stderr.readline()
            if "listening on" in line or not line:
                break
        found = re.search(r"listening on 127\.0\.0\.1:(\d+), .* admin http://127\.0\.0\.1:(\d+) ", line)
        assert found, line
        port, admin = (int(group) for group in found.groups())
        assert port != 0 and admin != 0
        assert _healthz(admin)["status"] == "ok"
        assert RawClient(port).roundtrip("GET", "/health").status == 200
    finally:
        _stop(proc)


def test_startup_lines_name_the_admin_url_and_the_absolute_paths_of_the_span_file_and_access_log(
        upstream_process, tmp_path):
    """Relative paths are relative to where serve was started: the lines say where that is."""
    admin = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "traceproxy", "serve", "--listen", "127.0.0.1:0", "--upstream", upstream_process,
         "--admin", f"127.0.0.1:{admin}", "--tracing-exporter", "file", "--tracing-file-path", "out/spans.jsonl",
         "--access-log-path", "out/access.jsonl"],
        stderr=subprocess.PIPE, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        lines = []
        for _ in range(50):  # the start-up lines before it are few
            lines.append(proc.stderr.readline())
            if "listening on" in lines[-1] or not lines[-1]:
                break
        assert f"admin http://127.0.0.1:{admin} " in lines[-1], lines
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)  # the few lines up to the stop fit the pipe
        # Read through the same file object: lines it already buffered would be lost to
        # communicate(), which reads the pipe itself.
        lines += proc.stderr.read().splitlines()
    finally:
        _stop(proc)
    spans, access_log = tmp_path / "out" / "spans.jsonl", tmp_path / "out" / "access.jsonl"
    assert any(line.endswith(f"spans: {spans}; access log: {access_log}") for line in lines), lines
    assert spans.exists() and access_log.exists()  # the files the line names are the ones written


def test_sigterm_lets_an_in_flight_stream_finish_then_exits(upstream_process):
    proc, port, admin = _serve(upstream_process, "--timeouts-shutdown-grace", "20")
    try:
        client = RawClient(port, timeout=20)
        # 100 tokens at 20 tok/s: a stream of about 5 s, in flight when SIGTERM lands.
        client.request("POST", "/v1/chat/completions", headers=[("x-fake-tps", "20")],
                       body=b'{"stream": true, "max_tokens": 100}')
        assert wait_until(lambda: _healthz(admin)["requests_in_flight"] == 1)
        proc.send_signal(signal.SIGTERM)
        # No longer accepting while the stream still runs (not merely once the proxy exits).
        assert wait_until(lambda: not _accepts(port), timeout=3)
        assert proc.poll() is None
        rest = client.response()
        assert rest.complete, "an in-flight stream within grace must not be cut"
        assert rest.body.count(b"data: ") == 102  # 100 tokens, usage, [DONE]
        assert proc.wait(15) == 0
    finally:
        _stop(proc)


def test_sigterm_to_the_whole_group_still_logs_the_stream_that_finishes_in_grace(upstream_process, tmp_path):
    """systemd's default stop signals every process of the service's cgroup, the
    exporter child included (which runs in its own session, out of the terminal's
    reach): it must outlive the proxy's grace."""
    access_log = tmp_path / "access.jsonl"
    port, admin = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "traceproxy", "serve", "--listen", f"127.0.0.1:{port}", "--upstream", upstream_process,
         "--admin", f"127.0.0.1:{admin}", "--timeouts-shutdown-grace", "20"],
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "TRACEPROXY_TRACING_EXPORTER": "off", "TRACEPROXY_ACCESS_LOG_PATH": str(access_log)})
    try:
        assert wait_until(lambda: _healthz(admin) is not None or proc.poll() is not None, timeout=15, interval=0.05)
        # The exporter child past its interpreter's start-up, where a SIGTERM still kills it.
        assert wait_until(lambda: len(_children(proc.pid)) == 1 and _ignores_sigterm(_children(proc.pid)[0]),
                          timeout=30, interval=0.05)
        client = RawClient(port, timeout=20)
        client.request("POST", "/v1/chat/completions", headers=[("x-fake-tps", "20"), ("x-request-id", "in-grace")],
                       body=b'{"stream": true, "max_tokens": 20}')
        assert wait_until(lambda: _healthz(admin)["requests_in_flight"] == 1)
        exporter = _children(proc.pid)
        assert len(exporter) == 1
        os.killpg(proc.pid, signal.SIGTERM)
        os.kill(exporter[0], signal.SIGTERM)  # as the cgroup-wide stop reaches it
        assert client.response().complete
        assert proc.wait(15) == 0
        assert "exited" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    logged = [json.loads(line) for line in access_log.read_text().splitlines()]
    assert [(entry["request_id"], entry["outcome"]) for entry in logged] == [("in-grace", "OK")]


def test_sigterm_grace_expired_cuts_the_stream_visibly(upstream_process):
    proc, port, admin = _serve(upstream_process, "--timeouts-shutdown-grace", "0.5")
    try:
        client = RawClient(port, timeout=20)
        client.request("POST", "/v1/chat/completions", headers=[("x-fake-tps", "5")],
                       body=b'{"stream": true, "max_tokens": 50}')
        assert wait_until(lambda: _healthz(admin)["requests_in_flight"] == 1)
        proc.send_signal(signal.SIGTERM)
        cut = client.response()
        assert cut.status == 200 and b"data: " in cut.body and not cut.complete
        assert proc.wait(15) == 0
    finally:
        _stop(proc)


def test_workers_share_the_listen_port(upstream_process):
    proc, port, admin = _serve(upstream_process, "--workers", "2")
    try:
        # 40 keep-alive clients held open: the kernel spreads them over both listeners
        # (all on one has odds of 2**-39), and /healthz says which worker holds how many.
        clients = [RawClient(port) for _ in range(40)]
        for client in clients:
            assert client.roundtrip("GET", "/health").status == 200
        workers = _healthz(admin)["workers"]
        pids = {worker["pid"] for worker in workers}
        assert len(pids) == 2 and all(worker["answered"] for worker in workers), workers
        assert all(worker["client_connections"] > 0 for worker in workers), "both workers should accept clients"
        assert sum(worker["client_connections"] for worker in workers) == len(clients), workers
        for client in clients:
            client.close()
        assert _listening_pids(port) == pids, "each worker holds its own listening socket on the port"
    finally:
        _stop(proc)
    assert proc.returncode == 0


def _listening_pids(port: int) -> set[int]:
    """The processes holding a listening TCP socket on ``port`` (Linux's /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    inodes.add(fields[9])
    holders = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue  # gone, or not ours to read
        if any(link in {f"socket:[{inode}]" for inode in inodes} for link in links):
            holders.add(int(pid))
    return holders


@pytest.mark.parametrize("key, workers", [("listen", "1"), ("listen", "2"), ("admin", "1"), ("admin", "2")])
def test_a_port_already_served_is_a_clear_startup_error(upstream_process, key, workers):
    # Held the way another multi-worker instance holds it (SO_REUSEPORT): a second
    # instance must refuse to start rather than share its traffic, proxy or admin.
    taken = socket.socket()
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = {"listen": f"127.0.0.1:{free_port()}", "admin": "off", key: f"127.0.0.1:{taken.getsockname()[1]}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "traceproxy", "serve", "--workers", workers,
         "--listen", ports["listen"], "--upstream", upstream_process, "--admin", ports["admin"]],
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "TRACEPROXY_TRACING_EXPORTER": "off", "TRACEPROXY_ACCESS_LOG_PATH": ""})
    try:
        _, stderr = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # it started: its workers too
        proc.communicate()
        pytest.fail(f"a second instance started on a {key} port another one serves")
    finally:
        taken.close()
    assert proc.returncode == 1
    assert "address already in use" in stderr.lower() and "Traceback" not in stderr, stderr
    assert f"{key} {ports[key]}" in stderr, stderr  # which address (with workers, before any started)


def _ignores_sigterm(pid: int) -> bool:
    """Whether the process has set SIGTERM to be ignored (its SigIgn mask, bit 15 - 1)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            mask = next(line.split()[1] for line in status if line.startswith("SigIgn:"))
    except (OSError, StopIteration):
        return False
    return bool(int(mask, 16) & (1 << (signal.SIGTERM - 1)))


def _children(pid: int) -> list[int]:
    return [int(child) for child in open(f"/proc/{pid}/task/{pid}/children").read().split()]


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return "zombie" not in status.read()
    except OSError:
        return False


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death notice is Linux's")
def test_workers_stop_when_their_parent_is_killed_outright(upstream_process):
    proc, port, admin = _serve(upstream_process, "--workers", "2")
    workers = _children(proc.pid)
    try:
        assert len(workers) == 2
        proc.kill()  # SIGKILL: the parent cannot relay anything
        proc.wait(5)
        assert wait_until(lambda: not any(map(_running, workers)), timeout=15), "orphaned workers kept serving"
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        _kill_all(workers)


@pytest.mark.parametrize("kill, said", [(signal.SIGKILL, "SIGKILL"), (signal.SIGRTMIN + 6, "signal")],
                         ids=["SIGKILL", "a real-time signal"])
def test_a_worker_that_dies_stops_the_service_with_its_status(upstream_process, kill, said):
    # Workers are not restarted (a supervisor restarts the service): one killed
    # outright (the OOM killer) stops the others, and the parent exits 128 + 9.
    proc, port, _ = _serve(upstream_process, "--workers", "2")
    workers = _children(proc.pid)
    try:
        assert len(workers) == 2
        os.kill(workers[0], kill)
        assert proc.wait(20) == 128 + kill
        assert not any(map(_running, workers))
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        stderr = proc.stderr.read()
        how = "SIGKILL" if said == "SIGKILL" else f"signal {int(kill)}"
        assert f"worker {workers[0]} ended before the service was asked to stop (killed by {how})" in stderr, stderr
    finally:
        _kill_all(workers)
        _stop(proc)


def test_a_worker_stopped_alone_stops_the_service_and_says_which(upstream_process):
    # A stop signal sent to one worker (by hand, by a script matching its command
    # line) must not leave the service on fewer workers with nothing said.
    proc, port, _ = _serve(upstream_process, "--workers", "2")
    workers = _children(proc.pid)
    try:
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGTERM)
        assert proc.wait(20) == 0  # that worker stopped cleanly; so do the others
        assert not any(map(_running, workers))
        stderr = proc.stderr.read()
        assert f"worker {workers[0]} ended before the service was asked to stop (exit status 0)" in stderr, stderr
        assert "Traceback" not in stderr
    finally:
        _kill_all(workers)
        _stop(proc)


@pytest.mark.parametrize("to_the_group", [False, True], ids=["SIGTERM to the parent", "Ctrl-C to the group"])
def test_a_stop_signal_while_workers_start_is_a_clean_stop(upstream_process, to_the_group):
    # Sent as soon as the workers are forked, before their event loops take signals:
    # held back until they can, then a graceful stop (not death by the signal, not a
    # KeyboardInterrupt traceback).
    proc = subprocess.Popen(
        [sys.executable, "-m", "traceproxy", "serve", "--workers", "2", "--listen", f"127.0.0.1:{free_port()}",
         "--upstream", upstream_process, "--admin", "off"],
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "TRACEPROXY_TRACING_EXPORTER": "off", "TRACEPROXY_ACCESS_LOG_PATH": ""})
    workers: list[int] = []
    try:
        assert wait_until(lambda: proc.poll() is not None or len(_children(proc.pid)) == 2, timeout=15,
                          interval=0.0005), "the workers were not forked"
        workers = _children(proc.pid)
        if to_the_group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 0, stderr
        assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    finally:
        _kill_all(workers)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def test_a_stop_asked_for_during_a_startup_that_fails_lets_the_failure_be_said():
    # The stop signal was held back while starting; the startup then failed. What the
    # operator must read is why it failed, not a process ended by the signal.
    script = (
        "import os, signal, sys\n"
        "from traceproxy import app\n"
        "from traceproxy.config import default_settings\n"
        "def starts_then_fails(settings):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    raise OSError(98, 'listen 127.0.0.1:1: Address already in use')\n"
        "app._run_one = starts_then_fails\n"
        "try:\n"
        "    app.run(default_settings())\n"
        "except OSError as exc:\n"
        "    print('said:', exc)\n"
        "    sys.exit(3)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 3 and "Address already in use" in result.stdout, (result.returncode, result.stderr)


@pytest.mark.skipif(sys.platform != "linux", reason="/proc lists a process's children")
def test_ctrl_c_while_the_span_exporter_starts_does_not_end_it(upstream_process, tmp_path):
    # Ctrl-C reaches the terminal's whole process group. The exporter, still starting,
    # has not yet set SIGINT aside: if the signal reached it, spans would be dropped
    # for the rest of the run. The proxy itself stops gracefully.
    proc = subprocess.Popen(
        [sys.executable, "-m", "traceproxy", "serve", "--listen", f"127.0.0.1:{free_port()}", "--upstream",
         upstream_process, "--admin", "off", "--tracing-exporter", "file", "--tracing-file-path",
         str(tmp_path / "spans.jsonl")],
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "TRACEPROXY_ACCESS_LOG_PATH": ""})
    exporter = []
    try:
        # Sent as soon as it runs the exporter's code (exec'd, still importing).
        assert wait_until(lambda: proc.poll() is not None or _runs_the_exporter(proc.pid), timeout=15,
                          interval=0.0005), "no exporter process was started"
        exporter = _children(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        _kill_all(exporter)
    assert proc.returncode == 0, stderr
    assert "span exporter process" not in stderr and "KeyboardInterrupt" not in stderr, stderr


def _runs_the_exporter(pid: int) -> bool:
    for child in _children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                if b"exporter_main" in cmdline.read():
                    return True
        except OSError:
            pass
    return False


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_NOFILE set for the child as Linux does")
def test_a_cap_beyond_the_open_file_limit_is_lowered_so_new_clients_are_served(upstream_process):
    # 128 descriptors cannot hold 10,000 clients: without a lower cap, accept() fails
    # and a new client is reset with nothing said; at it, the longest-idle goes.
    import resource

    def low_open_file_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "traceproxy", "serve", "--listen", f"127.0.0.1:{port}", "--upstream",
         upstream_process, "--admin", "off"],
        stderr=subprocess.PIPE, text=True, preexec_fn=low_open_file_limit,
        env={**os.environ, "TRACEPROXY_TRACING_EXPORTER": "off", "TRACEPROXY_ACCESS_LOG_PATH": ""})
    idle: list[RawClient] = []
    try:
        assert wait_until(lambda: proc.poll() is not None or _accepts(port), timeout=15), "not listening"
        for _ in range(150):  # each sends a request, then stays open and idle
            client = RawClient(port)
            assert client.roundtrip("GET", "/health").status == 200
            idle.append(client)
        assert RawClient(port).roundtrip("GET", "/health").status == 200
    finally:
        for client in idle:
            client.close()
        _stop(proc)
    stderr = proc.stderr.read()
    assert "limits.max_client_connections = 10000 (from default)" in stderr and "limit of 128" in stderr, stderr
    assert "client connections are capped at 32" in stderr


def test_the_client_cap_is_lowered_only_when_the_open_file_limit_cannot_hold_it(caplog):
    from traceproxy.app import fit_to_open_file_limit
    from traceproxy.config import default_settings

    settings = default_settings()  # 10,000 clients, 1,024 upstream connections
    assert fit_to_open_file_limit(settings, 20_000) is settings
    fits = settings.replace(**{"limits.max_client_connections": 200})
    assert fit_to_open_file_limit(fits, 1024) is fits  # 200 fit beside the upstream's room
    assert not caplog.records
    # 1,024 descriptors: 64 kept aside, at least half the rest for the upstream side.
    assert fit_to_open_file_limit(settings, 1024).limits.max_client_connections == 480
    assert [r.levelname for r in caplog.records] == ["WARNING"]


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_a_request_id_header_the_proxy_manages_is_a_startup_error(upstream_process):
    # Under content-length, the id would go out beside the proxy's own framing.
    result = subprocess.run(
        [sys.executable, "-m", "traceproxy", "serve", "--listen", f"127.0.0.1:{free_port()}", "--upstream",
         upstream_process, "--admin", "off", "--request-id-headers", "x-request-id,content-length"],
        capture_output=True, text=True, timeout=30,
        env={**os.environ, "TRACEPROXY_TRACING_EXPORTER": "off", "TRACEPROXY_ACCESS_LOG_PATH": ""})
    assert result.returncode == 2, result.stderr
    assert "request_id.headers = 'x-request-id,content-length' (from flag --request-id-headers)" in result.stderr
    assert "content-length is a header the proxy manages itself" in result.stderr


def test_a_configuration_error_with_workers_is_said_once_before_any_starts(upstream_process):
    result = subprocess.run(
        [sys.executable, "-m", "traceproxy", "serve", "--workers", "2", "--listen", f"127.0.0.1:{free_port()}",
         "--upstream", upstream_process, "--admin", "off", "--tracing-exporter", "file",
         "--tracing-file-path", "/proc/no-such-dir/spans.jsonl"],
        capture_output=True, text=True, timeout=30, env={**os.environ, "TRACEPROXY_ACCESS_LOG_PATH": ""})
    assert result.returncode == 2
    assert result.stderr.count("tracing.file_path") == 1 and "worker" not in result.stderr, result.stderr


def test_default_tracing_writes_otlp_json_lines_to_the_local_file(upstream_process, tmp_path):
    spans_file = tmp_path / "spans.jsonl"
    proc, port, _ = _serve(upstream_process, env={"TRACEPROXY_TRACING_EXPORTER": "auto",
                                                  "TRACEPROXY_TRACING_FILE_PATH": str(spans_file)})
    try:
        resp = RawClient(port).roundtrip("POST", "/v1/chat/completions", body=b'{"stream": true}')
        trace_id = resp.headers["traceresponse"].split("-")[1]
    finally:
        _stop(proc)  # stopping flushes the exporter
    spans = [span for line in spans_file.read_text().splitlines()
             for rs in json.loads(line)["resourceSpans"] for ss in rs["scopeSpans"] for span in ss["spans"]]
    mine = [s for s in spans if s["traceId"] == trace_id]
    assert {s["kind"] for s in mine} == {2, 3}  # SERVER and CLIENT
    assert all(int(s["endTimeUnixNano"]) >= int(s["startTimeUnixNano"]) for s in mine)


def test_unsupported_otlp_protocol_is_a_startup_error(upstream_process):
    result = subprocess.run(
        [sys.executable, "-m", "traceproxy", "serve", "--listen", "127.0.0.1:0", "--admin", "off",
         "--upstream", upstream_process],
        capture_output=True, text=True, timeout=30,
        env={**os.environ, "TRACEPROXY_TRACING_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    assert result.returncode == 2 and "http/json" in result.stderr and "OTEL_EXPORTER_OTLP" in result.stderr


def test_the_port_probe_finds_listen_and_admin_addresses_that_overlap():
    # A name the config cannot compare without a lookup (here localhost, passed
    # around the config's own check) is judged by the kernel when the ports are probed.
    import dataclasses

    from traceproxy.app import _check_port_bindable
    from traceproxy.config import HostPort, default_settings

    port = free_port()
    settings = default_settings().replace(**{"listen": f"127.0.0.1:{port}", "upstream": "http://127.0.0.1:9",
                                             "admin": f"127.0.0.1:{free_port()}"})
    _check_port_bindable(settings)  # distinct: fine
    overlapping = dataclasses.replace(settings, admin=HostPort("localhost", port))
    with pytest.raises(OSError, match=f"admin localhost:{port}: .*[Aa]ddress already in use"):
        _check_port_bindable(overlapping)


def test_the_port_probe_binds_what_a_name_resolves_to_as_the_workers_will(monkeypatch):
    # A name that resolves to IPv6 only: probed as IPv4, it could not be resolved and
    # a startup the workers could make was refused; a taken port must still show.
    import dataclasses

    from traceproxy.app import _check_port_bindable
    from traceproxy.config import HostPort, default_settings

    resolve = socket.getaddrinfo

    def only_ipv6_loopback(host, port, *args, **kwargs):
        if host == "engine-v6.test":
            return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0))]
        return resolve(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", only_ipv6_loopback)
    taken = socket.socket(socket.AF_INET6)
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    taken.bind(("::1", 0))
    taken.listen()
    try:
        settings = dataclasses.replace(default_settings(), admin=None)
        _check_port_bindable(dataclasses.replace(settings, listen=HostPort("engine-v6.test", free_port())))
        held = HostPort("engine-v6.test", taken.getsockname()[1])
        with pytest.raises(OSError, match=f"listen {held}: .*[Aa]ddress already in use"):
            _check_port_bindable(dataclasses.replace(settings, listen=held))
    finally:
        taken.close()


def test_the_port_probe_skips_an_address_family_the_host_lacks_as_the_workers_do(monkeypatch):
    # IPv6 turned off (ipv6.disable=1) while /etc/hosts still maps ::1 to localhost:
    # the workers' listeners skip the IPv6 address and serve on the other.
    import dataclasses
    import errno

    from traceproxy.app import _check_port_bindable
    from traceproxy.config import HostPort, default_settings

    resolve, make_socket = socket.getaddrinfo, socket.socket

    def both_loopbacks(host, port, *args, **kwargs):
        if host == "dual.test":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
                    (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0))]
        return resolve(host, port, *args, **kwargs)

    def no_ipv6(family=socket.AF_INET, *args, **kwargs):
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return make_socket(family, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", both_loopbacks)
    monkeypatch.setattr(socket, "socket", no_ipv6)
    settings = dataclasses.replace(default_settings(), admin=None)
    _check_port_bindable(dataclasses.replace(settings, listen=HostPort("dual.test", free_port())))
    only_ipv6 = HostPort("::1", free_port())
    with pytest.raises(OSError, match=re.escape(f"listen {only_ipv6}: Address family not supported")):
        _check_port_bindable(dataclasses.replace(settings, listen=only_ipv6))
