"""``traceproxy top``: frames rendered from /debug/inflight entries as plain strings, and the
command end to end against a real proxy with a request stuck waiting for the engine."""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from traceproxy import top

from .support import RawClient, never_answers, refused_port, wait_until

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
RED = "\x1b[1;31m"


def _entry(**overrides) -> dict:
    entry = {
        "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736", "request_id": "req-healthy", "method": "POST",
        "path": "/v1/chat/completions", "phase": "streaming_response", "age_s": 4.2,
        "since_last_byte_s": {"from_client": 4.1, "from_upstream": 0.02, "to_client": 0.02},
        "client_paused_s": None, "bytes": {"request_in": 312, "response_in": 20480, "response_out": 20480},
        "chunks": 97, "client_connection": 3, "client_request_sequence": 2, "upstream_connection": 7,
        "upstream_reused": True, "attempts": 1,
        "verdict": {"outcome": "MSS", "name": "mid_stream_stall", "blame": "engine", "waiting_for_s": 0.02,
                    "stall_after_s": 30.0, "stalled": False},
        "stalls": [],
    }
    entry.update(overrides)
    return entry


STALLED_FBS = _entry(
    request_id="req-stuck-fbs", phase="awaiting_upstream_headers", age_s=131.5, chunks=0, upstream_reused=False,
    bytes={"request_in": 2, "response_in": 0, "response_out": 0},
    path="/v1/chat/completions?" + "x" * 150,  # long enough to need cutting
    verdict={"outcome": "FBS", "name": "first_byte_stall", "blame": "engine", "waiting_for_s": 131.4,
             "stall_after_s": 120.0, "stalled": True},
    stalls=[{"outcome": "FBS", "phase": "awaiting_upstream_headers", "resolved": False}],
)
SLOW_CLIENT = _entry(
    request_id="req-slow-reader", phase="draining_to_client", age_s=40.0,
    verdict={"outcome": "DNR", "name": "downstream_not_reading", "blame": "client", "waiting_for_s": 20.0,
             "stall_after_s": 30.0, "stalled": False},
)
HEALTHY = _entry()
NO_VERDICT = _entry(request_id=None, method=None, path=None, phase="done", age_s=0.1, verdict=None,
                    upstream_connection=None, upstream_reused=None, chunks=0)
ENTRIES = [STALLED_FBS, SLOW_CLIENT, HEALTHY, NO_VERDICT]


def _line_with(lines: list[str], needle: str) -> str:
    return next(line for line in lines if needle in line)


# --- pure formatting ---


@pytest.mark.parametrize("width", [80, 200])
def test_rows_name_the_outcome_and_whose_turn_it_is(width):
    lines = top.render_table(ENTRIES, width, use_color=False)
    assert len(lines) == 1 + len(ENTRIES)
    assert "FBS" in lines[1] and "engine" in lines[1] and "req-stuck-fbs" in lines[1]
    assert "DNR" in lines[2] and "client" in lines[2]
    assert "MSS" in lines[3] and "engine" in lines[3]
    assert "done" in lines[4]


@pytest.mark.parametrize("width", [80, 200])
def test_every_line_fits_the_width_with_or_without_color(width):
    snapshot = top.Snapshot({"pid": 1, "count": 4, "requests": ENTRIES}, None, "connection refused")
    for use_color in (True, False):
        frame = top.render_frame(snapshot, "http://127.0.0.1:9464", width, "12:00:00", use_color)
        assert all(len(ANSI.sub("", line)) <= width for line in frame)


def test_no_color_marks_the_stall_in_text_and_writes_no_escape_codes():
    lines = top.render_table(ENTRIES, 120, use_color=False)
    assert not any("\x1b" in line for line in lines)
    assert _line_with(lines, "FBS").startswith("STALL")
    assert _line_with(lines, "DNR").startswith("slow")
    assert "STALL" not in _line_with(lines, "MSS") and "slow" not in _line_with(lines, "MSS")


def test_color_paints_the_stalled_row_red_and_the_half_way_row_yellow():
    lines = top.render_table(ENTRIES, 120, use_color=True)
    assert _line_with(lines, "FBS").startswith(RED) and "STALL" in _line_with(lines, "FBS")
    assert _line_with(lines, "DNR").startswith(top.YELLOW)
    assert "\x1b" not in _line_with(lines, "MSS")


def test_the_path_is_cut_before_any_column_is_dropped():
    wide = top.render_table(ENTRIES, 200, use_color=False)
    assert "CHUNKS" in wide[0] and "UPSTREAM" in wide[0] and "#7 reused" in wide[3] and "20K" in wide[3]
    assert ".." in _line_with(wide, "FBS")  # the 170-char path did not fit even at 200
    middle = top.render_table(ENTRIES, 130, use_color=False)
    assert "CHUNKS" in middle[0] and "POST /v1/chat" in middle[1]
    narrow = top.render_table(ENTRIES, 80, use_color=False)
    assert "CHUNKS" not in narrow[0] and "REQUEST ID" in narrow[0] and "BLAME" in narrow[0]


def test_wait_column_shows_waited_over_threshold_and_off():
    assert top._wait_cell(STALLED_FBS) == "2m11s/2m00s"
    assert top._wait_cell(_entry(verdict={**HEALTHY["verdict"], "stall_after_s": None})) == "0.0s/off"
    assert top._wait_cell(NO_VERDICT) == "-"


def test_row_state_thresholds():
    assert top.row_state(STALLED_FBS) == top.STALLED
    assert top.row_state(SLOW_CLIENT) == top.SLOW  # 20 of 30 s
    assert top.row_state(HEALTHY) == top.WAITING and top.row_state(NO_VERDICT) == top.WAITING
    off = _entry(verdict={**SLOW_CLIENT["verdict"], "stall_after_s": None})
    assert top.row_state(off) == top.WAITING  # no threshold, never slow


def test_header_has_health_and_a_stall_summary_by_blame():
    health = {"status": "ok", "version": "0.1.0", "pid": 4242, "uptime_s": 75.0, "upstream": "127.0.0.1:30000",
              "client_connections": 5, "requests_in_flight": 4, "upstream_connections_open": 2,
              "upstream_connections_idle": 1}
    snapshot = top.Snapshot({"pid": 4242, "count": 4, "requests": ENTRIES}, health)
    frame = top.render_frame(snapshot, "http://127.0.0.1:9464", 200, "12:00:00", use_color=False)
    assert "pid 4242" in frame[0] and "upstream 127.0.0.1:30000" in frame[0] and "clients 5" in frame[0]
    assert "in flight 4" in frame[0]
    assert "4 in flight, 1 stalled, 1 slow (stalled: engine 1)" in frame[1]
    assert "http://127.0.0.1:9464" in frame[1]


def test_the_header_says_how_many_workers_answered():
    health = {"status": "ok", "pid": 1, "requests_in_flight": 4, "workers_answering": 2,
              "workers": [{"pid": 2, "answered": True}, {"pid": 3, "answered": True}, {"pid": 4, "answered": False}]}
    frame = top.render_frame(top.Snapshot({"requests": ENTRIES}, health), "http://a:1", 200, "12:00:00",
                             use_color=False)
    assert "workers 2 of 3 answering (the rest left out)" in frame[0]
    health.update(workers_answering=3, workers=[{"pid": 2}, {"pid": 3}, {"pid": 4}])
    assert "workers 3" in top.render_frame(top.Snapshot({"requests": ENTRIES}, health), "http://a:1", 200,
                                           "12:00:00", use_color=False)[0]


def test_one_frame_is_one_answer_when_the_in_flight_view_carries_its_health(monkeypatch):
    # The header's numbers and the table come from the same gathering of the workers:
    # no second request whose answer could describe another moment.
    health = {"status": "ok", "pid": 1, "requests_in_flight": 4}
    asked = []

    def fetch(url, timeout=top.FETCH_TIMEOUT_S):
        asked.append(url)
        return {"requests": ENTRIES, "health": health}

    monkeypatch.setattr(top, "fetch_json", fetch)
    snapshot = top.fetch_snapshot("http://a:1")
    assert asked == ["http://a:1/debug/inflight"] and snapshot.health is health


def test_a_short_terminal_says_how_many_rows_are_hidden():
    snapshot = top.Snapshot({"pid": 1, "count": 4, "requests": ENTRIES}, None)
    frame = top.render_frame(snapshot, "http://a:1", 100, "12:00:00", use_color=False, height=7)
    assert len(frame) == 7 and frame[-1].startswith("... 2 more")


def test_empty_and_units():
    assert top.render_table([], 80) == ["(no requests in flight)"]
    assert [top.byte_count(n) for n in (0, 1023, 1536, 20480, 5 * 2**20)] == ["0", "1023", "1.5K", "20K", "5.0M"]
    assert [top.duration(s) for s in (None, 0.25, 42, 131.5, 7322)] == ["-", "0.2s", "42s", "2m11s", "2h02m"]


def test_admin_address_accepts_host_port_and_urls_only():
    assert top.admin_address("127.0.0.1:9464") == "http://127.0.0.1:9464"
    assert top.admin_address("http://localhost:1/") == "http://localhost:1"
    assert top.admin_address("::1:9464") == "http://[::1]:9464"
    assert top.default_admin() == "127.0.0.1:9464"
    for bad in ("localhost", "127.0.0.1:", "http://h:1/debug", "::1", "[:80", "[zz]:80", "127.0.0.1:0",
                "127.0.0.1:70000", "a b:1"):
        with pytest.raises(argparse.ArgumentTypeError):
            top.admin_address(bad)


# --- the command, end to end ---




def _inflight(proxy) -> list[dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.admin_port}/debug/inflight", timeout=5) as resp:
        return json.loads(resp.read())["requests"]


def _top(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "traceproxy", "top", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "160", "LINES": "40"})


def test_once_shows_the_stuck_request_as_an_engine_first_byte_stall(scripted_upstream, start_proxy):
    proxy = start_proxy(scripted_upstream(never_answers).url, **{"stall.first_byte": 0.3})
    client = RawClient(proxy.port)
    client.request("POST", "/v1/chat/completions", headers=[("x-request-id", "top-stuck-1")], body=b"{}")
    assert wait_until(lambda: any((e["verdict"] or {}).get("stalled") for e in _inflight(proxy)), timeout=5)
    result = _top("--admin", f"127.0.0.1:{proxy.admin_port}", "--once")
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout  # written to a pipe: no colour, without --no-color
    row = _line_with(result.stdout.splitlines(), "top-stuck-1")
    assert row.startswith("STALL") and "FBS" in row and "engine" in row and "first-byte" in row
    assert "1 in flight, 1 stalled" in result.stdout and "in flight 1" in result.stdout
    client.close()


def test_once_with_the_admin_unreachable_exits_2_naming_the_url():
    with refused_port() as sock:
        port = sock.getsockname()[1]
        result = _top("--admin", f"127.0.0.1:{port}", "--once", timeout=15)
    assert result.returncode == 2 and result.stdout == ""
    assert f"http://127.0.0.1:{port}/debug/inflight" in result.stderr


def _read_until(proc: subprocess.Popen, needle: bytes, timeout: float, fd: int | None = None) -> bytes:
    """What the process wrote (to its stdout pipe, or to the terminal ``fd``) until ``needle``."""
    fd = proc.stdout.fileno() if fd is None else fd
    seen, deadline = b"", time.monotonic() + timeout
    while needle not in seen and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.1)[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # a terminal whose process ended and closed it
                break
            if not chunk:
                break
            seen += chunk
    return seen


def _started_with_sigint(disposition, *argv: str) -> list[str]:
    """A command line that runs argv with SIGINT set to disposition (SIG_DFL or SIG_IGN) on entry.

    What a child starts with is otherwise inherited from however this test run was
    launched: a shell's ``pytest &`` without job control ignores SIGINT, and so would
    every process the tests start. Setting it, then exec'ing, makes each case the same
    on every run."""
    launcher = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.%s); "
                "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])" % disposition.name)
    return [sys.executable, "-c", launcher, *argv]


@pytest.mark.parametrize("on_entry", [signal.SIG_DFL, signal.SIG_IGN], ids=["sigint-default", "sigint-ignored"])
def test_live_view_keeps_retrying_an_unreachable_admin_and_ctrl_c_exits_0(on_entry):
    with refused_port() as sock:
        port = sock.getsockname()[1]
        command = _started_with_sigint(on_entry, "-m", "traceproxy", "top", "--admin", f"127.0.0.1:{port}",
                                       "--interval", "0.1")
        screen, terminal = os.openpty()  # a terminal: the view draws on the alternate screen
        proc = subprocess.Popen(command, stdout=terminal, stderr=subprocess.PIPE)
        os.close(terminal)
        try:
            # A frame on screen is the readiness signal: Ctrl-C is taken before the first one.
            first = _read_until(proc, b"retrying", timeout=30, fd=screen)
            again = _read_until(proc, b"retrying", timeout=30, fd=screen)  # a second frame: it kept trying
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=10)
            rest = _read_until(proc, top.LEAVE_ALT_SCREEN.encode(), timeout=5, fd=screen)
            err = proc.stderr.read()
        finally:
            proc.kill()
            proc.wait(timeout=10)
            os.close(screen)
    assert f"http://127.0.0.1:{port}/debug/inflight".encode() in first and b"retrying" in again
    assert first.startswith(top.ENTER_ALT_SCREEN.encode()) and rest.endswith(top.LEAVE_ALT_SCREEN.encode())
    assert proc.returncode == 0 and b"Traceback" not in err


def test_live_view_into_a_pipe_prints_frame_after_frame_without_escape_codes():
    with refused_port() as sock:
        port = sock.getsockname()[1]
        command = _started_with_sigint(signal.SIG_DFL, "-m", "traceproxy", "top", "--admin", f"127.0.0.1:{port}",
                                       "--interval", "0.1")
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            seen = _read_until(proc, b"retrying", timeout=30)
            seen += _read_until(proc, b"retrying", timeout=30)
            proc.send_signal(signal.SIGINT)
            rest, err = proc.communicate(timeout=10)
        finally:
            proc.kill()
            proc.wait(timeout=10)
    frames = (seen + rest).decode().split("\n\n")
    assert b"\x1b" not in seen + rest
    assert len([frame for frame in frames if "retrying every 0.1s" in frame]) >= 2
    assert proc.returncode == 0 and b"Traceback" not in err


def test_engine_gauges_and_the_orphan_verdict_are_shown():
    from traceproxy.top import engine_fields

    inflight = {
        "engines": {
            "http://127.0.0.1:1/metrics": {"gauges": {"sglang:num_running_reqs": 0,
                                                      "sglang:num_prefill_inflight_queue_reqs": 1},
                                           "last_scrape_age_s": 0.4, "error": None, "errors": 0},
            "http://127.0.0.1:2/metrics": {"gauges": {}, "last_scrape_age_s": None, "error": "connection refused",
                                           "errors": 3},
        },
        "correlation": {"orphan": {"outcome": "EOR", "name": "engine_orphan", "blame": "engine",
                                   "unexplained": 1, "reported": True}},
    }
    fields = engine_fields(inflight)
    assert fields[0] == "engine http://127.0.0.1:1/metrics: prefill_inflight_queue 1, running 0 (0.4 s ago)"
    assert "scrape failing (connection refused)" in fields[1]
    assert fields[2].startswith("EOR engine_orphan: 1") and "blame engine" in fields[2]
    assert engine_fields({"requests": []}) == []


def test_a_routers_gauges_are_shown_as_debug_inflight_lists_them():
    from traceproxy.top import engine_fields

    router = {"engines": {"http://127.0.0.1:3/metrics": {
        "gauges": {"smg_worker_requests_active": 0.0, "smg_http_connections_active": 6.0},
        "last_scrape_age_s": 0.2, "error": None, "errors": 0}}}
    assert engine_fields(router) == [
        "engine http://127.0.0.1:3/metrics: http_connections_active 6, worker_requests_active 0 (0.2 s ago)"]


class _OddAdmin:
    """A loopback server answering every connection with ``answer(sock)``, in a thread, until closed."""

    def __init__(self, answer) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.answer, self.stopping = answer, False
        self.thread = __import__("threading").Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                try:
                    self.answer(conn, self)
                except OSError:
                    pass

    def close(self) -> None:
        self.stopping = True
        self.sock.close()


def _trickle(conn, server) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
    for _ in range(60):  # a byte every 0.2 s, for at most 12 s
        if server.stopping:
            return
        time.sleep(0.2)
        conn.sendall(b" ")


def _top_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """``traceproxy top *args`` run in this process -> (exit status, stdout, stderr)."""
    from traceproxy.cli import main

    code = main(["top", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_once_gives_up_on_an_admin_that_trickles_its_answer(capsys, monkeypatch):
    # Each read gets a byte well within the per-read timeout: only a deadline for the
    # whole answer ends the wait, as --once promises (exit 2 when unreachable). The
    # deadline is shortened so the test does not wait out the real one.
    monkeypatch.setattr(top, "FETCH_TIMEOUT_S", 0.6)
    server = _OddAdmin(_trickle)
    try:
        started = time.monotonic()
        code, out, err = _top_in_process(capsys, "--admin", f"127.0.0.1:{server.port}", "--once")
        took = time.monotonic() - started
    finally:
        server.close()
    assert code == 2 and out == "" and "no complete answer within 0.6 s" in err, err
    assert took < 10  # well before the trickle's 12 s end


@pytest.mark.parametrize("document", [{"requests": [1, 2]}, {"requests": [{"age_s": "abc"}]},
                                      {"requests": [], "engines": [1]}])
def test_once_reports_an_answer_of_the_wrong_shape_instead_of_a_traceback(document, capsys):
    body = json.dumps(document).encode()

    def answer(conn, server):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))

    server = _OddAdmin(answer)
    try:
        code, out, err = _top_in_process(capsys, "--admin", f"127.0.0.1:{server.port}", "--once", "--no-color")
    finally:
        server.close()
    assert code == 2 and out == "" and "is this the admin port?" in err, err


def test_once_against_another_http_server_says_it_answered_but_is_not_the_admin_listener(capsys):
    # Such as python's http.server on the port given: reached, so "cannot reach" would mislead.
    def answer(conn, server):
        conn.sendall(b"HTTP/1.1 404 File not found\r\nContent-Type: text/html\r\nContent-Length: 9\r\n\r\nnot found")

    server = _OddAdmin(answer)
    try:
        code, out, err = _top_in_process(capsys, "--admin", f"127.0.0.1:{server.port}", "--once", "--no-color")
    finally:
        server.close()
    assert code == 2 and out == "", err
    assert err.strip() == (f"traceproxy top: http://127.0.0.1:{server.port}/debug/inflight answered, but not as the "
                           "traceproxy admin listener does: HTTP 404 (is this the admin port?)"), err


def test_once_against_the_proxys_own_listen_port_says_where_the_admin_listener_is(start_proxy, fast_upstream,
                                                                                   capsys):
    proxy = start_proxy(fast_upstream().url)
    code, out, err = _top_in_process(capsys, "--admin", f"127.0.0.1:{proxy.port}", "--once", "--no-color")
    assert code == 2 and out == "", err
    assert "relayed by traceproxy's proxy listener (its traceresponse header): the admin listener is another " \
           f"address, {top.default_admin()} unless serve was configured with another" in err, err


def test_once_against_a_server_of_another_protocol_says_it_answered(capsys):
    # A gRPC port, say: bytes that are no HTTP/1.1 status line.
    server = _OddAdmin(lambda conn, server: conn.sendall(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00" + b"\x00" * 18))
    try:
        code, out, err = _top_in_process(capsys, "--admin", f"127.0.0.1:{server.port}", "--once", "--no-color")
    finally:
        server.close()
    assert code == 2 and "answered, but not as the traceproxy admin listener does: the answer is not HTTP/1.1 (" \
        in err, err


@pytest.mark.parametrize("interval", ["inf", "1e300", "nan", "0"])
def test_an_interval_that_cannot_be_slept_is_a_usage_error(interval, capsys):
    code, _, err = _top_in_process(capsys, "--admin", "127.0.0.1:1", "--interval", interval, "--once")
    assert code == 2 and "expected a number of seconds above 0" in err


# --- where the engines have each request (engine spans, or gauges by role) ---


KV_STUCK = _entry(request_id="req-kv", phase="awaiting_upstream_headers", verdict=STALLED_FBS["verdict"],
                  engine_stage={"component": "kv_transfer", "role": "prefill", "stage": "prefill_transfer_kv_cache",
                                "state": "in", "worker": {"service": "sglang", "host": "ab12", "pid": 7},
                                "since_s": 12.0, "source": "spans"})
DECODE_BY_GAUGES = _entry(request_id="req-dec", engine_stage={
    "component": "decode", "role": "decode", "stage": "decode_forward", "state": "in", "worker": None,
    "since_s": None, "source": "gauges", "detail": "prefill 0, decode 1 running"})


def test_the_engine_column_names_the_component_and_stage_and_marks_the_gauges_guess():
    lines = top.render_table([KV_STUCK, DECODE_BY_GAUGES, HEALTHY], 200, use_color=False)
    assert "ENGINE" in lines[0]
    assert "kv_transfer prefill_transfer_kv_cache" in _line_with(lines, "req-kv")
    assert "~decode decode_forward" in _line_with(lines, "req-dec")
    assert top.engine_cell(HEALTHY) == "-"
    # Narrow, the other optional columns go first.
    narrow = top.render_table([KV_STUCK], 120, use_color=False)
    assert "ENGINE" in narrow[0] and "CHUNKS" not in narrow[0]


def test_without_engine_stages_there_is_no_engine_column():
    assert "ENGINE" not in top.render_table(ENTRIES, 200, use_color=False)[0]


def test_the_header_names_engine_work_nobody_waits_for_and_the_receivers_counts():
    from traceproxy.top import engine_fields

    inflight = {"correlation": {"orphan": {
        "outcome": "EOR", "name": "engine_orphan", "blame": "engine", "unexplained": 1, "reported": True,
        "engine_work_total": 1, "engine_work": [{
            "trace_id": "3a92ea8bd6837bdabb1d39854ee1490b", "component": "kv_transfer", "role": "prefill",
            "stage": "prefill_transfer_kv_cache", "state": "in", "worker": {"service": "sglang", "host": "ab",
                                                                            "pid": 99},
            "since_s": 75.0, "source": "spans"}]}},
        "engine_spans": {"spans_received": 120, "traces": 3, "spans_dropped_no_room": 0,
                         "rejected": {"malformed": 1, "too_large": 0, "unsupported_media_type": 0}}}
    fields = engine_fields(inflight)
    assert fields[1] == ("held at the engines, in flight nowhere here: kv_transfer prefill_transfer_kv_cache on "
                         "sglang pid 99 for 75s (trace 3a92ea8bd6837bdabb1d39854ee1490b)")
    assert fields[2] == "engine spans: 120 received, 3 traces kept, 0 dropped, 1 bodies refused"


KV_BY_GAUGES = _entry(request_id="req-gauges", engine_stage={
    "component": "kv_transfer", "role": "prefill", "stage": "prefill_transfer_kv_cache", "state": "in",
    "worker": None, "since_s": None, "source": "gauges", "detail": "prefill holds 1 in its KV-transfer queue"})


def test_at_80_columns_the_path_goes_whole_before_the_engine_stage_is_cut():
    # Piped, top --once renders 80 columns. The path says nothing of why a request waits: it
    # goes before the engine's stage is cut, and the request id stays whole.
    lines = top.render_table([KV_STUCK, KV_BY_GAUGES, HEALTHY], 80, use_color=False)
    assert all(len(line) <= 80 for line in lines)
    assert "METH" not in lines[0] and "POST" not in "".join(lines), lines
    assert "ENGINE" in lines[0] and "REQUEST ID" in lines[0]
    assert " kv_transfer pre" in lines[1] and lines[1].endswith(" req-kv"), lines
    assert "~kv_transfer pre" in lines[2] and lines[2].endswith(" req-gauges"), lines
    # Where the stage must be cut, the gauges' guess still shows the start of it.
    assert top.engine_cell(KV_BY_GAUGES)[:16] == "~kv_transfer pre"
    assert top.clip(top.engine_cell(KV_BY_GAUGES), top.ENGINE_SQUEEZE_WIDTH) == "~kv_transfer p.."


@pytest.mark.parametrize("text, width, shown", [
    ("POST /v1/chat/completions", 6, "POST"),  # "POST.." is wider and says no more
    ("~kv_transfer prefill_transfer_kv_cache", 15, "~kv_transfer"),
    ("kv_transfer prefill_transfer_kv_cache", 15, "kv_transfer p.."),
    ("METHOD PATH", 6, "METH.."),
])
def test_a_cut_marks_itself_only_where_the_mark_saves_width(text, width, shown):
    assert top.clip(text, width) == shown
    assert len(shown) <= width


def test_the_engine_span_counts_start_a_header_line_of_their_own():
    gauges = {name: 0.0 for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs",
                                     "sglang:num_decode_transfer_queue_reqs")}
    inflight = {"requests": [], "engines": {
        "http://127.0.0.1:2/metrics": {"gauges": gauges, "last_scrape_age_s": 0.4, "error": None, "errors": 0}},
        "engine_spans": {"spans_received": 12, "traces": 1, "spans_dropped_no_room": 0, "rejected": {}}}
    frame = top.render_frame(top.Snapshot(inflight, None, None), "http://a:1", 250, "12:00:00", use_color=False)
    spans_line = next(line for line in frame if "engine spans:" in line)
    assert spans_line.startswith("engine spans: 12 received"), frame
    gauge_lines = [line for line in frame if "metrics:" in line]
    assert gauge_lines and not any("engine spans" in line for line in gauge_lines)


def test_request_ids_that_share_their_start_stay_apart_when_cut():
    # One repro run's ids share their start; top's rows must still say which is which,
    # whole where there is room and, cut, with their ends.
    ids = [f"repro-5db791-fresh-c1-t{turn}" for turn in (1, 2)]
    entries = [_entry(request_id=request_id, phase="streaming", age_s=2.9) for request_id in ids]
    wide = top.render_table(entries, 200, use_color=False)
    assert all(any(request_id in line for line in wide) for request_id in ids)
    cut = [top.clip_middle(request_id, 12) for request_id in ids]
    assert cut == ["repro..c1-t1", "repro..c1-t2"]
    narrow = top.render_table(entries, 60, use_color=False)
    assert all(len(line) <= 60 for line in narrow)
    rows = narrow[1:1 + len(ids)]
    assert rows[0] != rows[1] and rows[0].rstrip().endswith("t1") and rows[1].rstrip().endswith("t2")


def test_cut_request_ids_lose_the_start_they_share_first():
    # repro's reused and fresh connections' turns, on a terminal too narrow for them whole:
    # the run's "repro-5db791-" says nothing that tells the rows apart, the rest does.
    ids = ["repro-5db791-reused-c1-t1", "repro-5db791-fresh-c2-t1", "repro-5db791-reused-c1-t2"]
    entries = [_entry(request_id=request_id, phase="streaming", age_s=2.9) for request_id in ids]
    rows = top.render_table(entries, 62, use_color=False)[1:1 + len(ids)]
    assert all(len(row) <= 62 for row in rows) and "repro-5db791-reused-c1-t1" not in rows[0]
    for row, own in zip(rows, ("..reused-c1-t1", "..fresh-c2-t1", "..reused-c1-t2")):
        assert row.rstrip().endswith(own), rows
    # Too narrow for even the rows' own parts: their ends, where ids count, as before.
    assert [top.clip_shared_start(i, 10, 13) for i in ids] == ["..ed-c1-t1", "..sh-c2-t1", "..ed-c1-t2"]
    numbered = ["req-20260101-000117", "req-20260101-000217"]
    assert [top.clip_shared_start(i, 8, 13) for i in numbered] == ["..000117", "..000217"]
    # Ids that share nothing (32 hex digits each) are cut in their middle.
    assert top.clip_shared_start("4bf92f3577b34da6a3ce929d0e0e4736", 12, 0) == "4bf92..e4736"


def test_piped_frames_keep_every_row_and_screen_frames_fit_the_screen(monkeypatch):
    entries = [_entry(request_id=f"held-{n}") for n in range(40)]
    snapshot = top.Snapshot({"pid": 1, "count": 40, "requests": entries}, None)
    monkeypatch.setattr(top, "fetch_snapshot", lambda url, timeout: snapshot)
    monkeypatch.setattr(top.shutil, "get_terminal_size", lambda: os.terminal_size((200, 24)))
    piped = top._next_frame("http://a:1", 1.0, use_color=False, on_screen=False)
    assert all(any(f"held-{n}" in line for line in piped) for n in range(40))  # as --once prints them
    on_screen = top._next_frame("http://a:1", 1.0, use_color=False, on_screen=True)
    assert len(on_screen) <= 24
