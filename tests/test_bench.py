"""``traceproxy bench``: tiny end-to-end runs in a subprocess, plus its measuring parts.

No timing or throughput thresholds: the bench reports figures, these tests check it
ran, that every target did work, that the traced proxy really exported spans to the
sink, and that keep-alive rounds through both proxies are clean.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from traceproxy.bench import report
from traceproxy.bench.client import Conn, Recorder
from traceproxy.bench.procs import Child, Children, python_module, wait_port_file
from traceproxy.bench.proxy_proc import (build_settings, defaults_overrides, logged_overrides, minimal_overrides,
                                         traced_overrides)
from traceproxy.bench.runner import default_targets, parse_targets, run_order
from traceproxy.bench.scenarios import BY_NAME, RequestSpec, scaled, select
from traceproxy.bench.session import split
from traceproxy.bench.stats import Samples, percentile

from .fake_transport import RecordingTransport
from .support import run_bench



def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def test_bench_smoke_run_end_to_end(tmp_path):
    report_path = tmp_path / "bench.json"
    result = run_bench("--quick", "--scale", "0.05", "--scenarios", "S1,S5", "--targets", "direct,proxy",
                         "--json", str(report_path))
    assert result.returncode == 0, result.stderr[-2000:]

    rows = [line for line in result.stdout.splitlines() if line.startswith("| S")]
    assert {row.split("|")[1].strip() for row in rows} == {"S1", "S5"}
    assert any("req/s" in row for row in rows if row.startswith("| S1"))
    assert any("ok / errors / hangs" in row for row in rows if row.startswith("| S5"))
    assert "proxy-traced" not in result.stdout and "Tracing cost" not in result.stdout
    assert "proxy-logged" not in result.stdout and "Access log cost" not in result.stdout

    summary = json.loads(report_path.read_text())["summary"]
    for name in ("S1", "S5"):
        assert set(summary[name]) == {"direct", "proxy", "error_kinds", "never_started"}
        for target in ("direct", "proxy"):
            assert summary[name][target]["ok"] > 0, (name, target)
    assert summary["S5"]["proxy"]["errors"] == 0
    assert summary["S5"]["proxy"]["hangs"] == 0


def test_bench_every_target_with_spans_to_the_sink_and_lines_to_the_log(tmp_path):
    """direct, bare, proxy-traced, proxy-logged and defaults side by side; spans reach the OTLP sink, lines
    the access log; every proxy target has its CPU µs per request (exporter included), and each observed
    target is priced against bare; stdout is only the report (no access-log line from a child, although
    defaults logs to stdout), and nothing is written to the bench's working directory."""
    report_path = tmp_path / "bench.json"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    result = run_bench("--quick", "--scale", "0.05", "--scenarios", "S1,S5", "--json", str(report_path), cwd=cwd)
    assert result.returncode == 0, result.stderr[-2000:]

    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("| scenario"))
    assert _cells(header)[2:] == ["direct", "bare", "proxy-traced", "proxy-logged", "defaults", "bare vs direct",
                                  "traced vs direct", "logged vs direct", "defaults vs direct"]
    for name, label in (("S1", "req/s"), ("S5", "ok / errors / hangs"), ("S1", "proxy CPU µs/request"),
                        ("S5", "proxy CPU µs/request")):  # a figure for every proxy target
        row = next(_cells(line) for line in lines if line.startswith(f"| {name}") and f"| {label} " in line)
        assert all(cell not in ("", "–") for cell in row[3:7]), row
    assert sum(line.startswith("- S1 throughput:") for line in lines) == 2  # tracing's cost, the log's cost
    prices = [line for line in lines if line.startswith("- S1: bare ")]
    assert len(prices) == 1 and all(f"{t} " in prices[0] for t in ("traced", "logged", "defaults")), prices
    assert not [line for line in lines if line.lstrip().startswith("{")], "a child wrote to the bench's stdout"
    assert list(cwd.iterdir()) == []

    doc = json.loads(report_path.read_text())
    summary = doc["summary"]
    for name in ("S1", "S5"):
        for target in report.DEFAULT_TARGETS:
            assert summary[name][target]["ok"] > 0, (name, target)
        for target in ("bare", "proxy-traced", "proxy-logged", "defaults"):
            [run] = doc["runs"][name][target]
            # the tree's CPU until it was quiet after the load, over the requests answered: at least
            # what the run's CPU % saw while the load ran (the kernel counts in 10 ms ticks, so a
            # run of four requests, S5 here, may read 0)
            assert run["proxy_cpu_s"] >= 0 and (run["proxy_cpu_s"] > 0 or name != "S1"), (name, target)
            assert summary[name][target]["cpu_us"] == pytest.approx(run["proxy_cpu_s"] * 1e6 / run["ok"])
            assert run["proxy_cpu_s"] >= run["cpu"]["proxy"] / 100 * run["elapsed"] * 0.5, (name, target, run)
        assert summary[name]["direct"]["cpu_us"] is None
    for target in ("bare", "proxy-traced", "proxy-logged", "defaults"):
        assert summary["S5"][target]["errors"] == 0, target
        assert summary["S5"][target]["hangs"] == 0, target
    tracing = doc["tracing"]
    assert tracing["sink"]["spans"] > 0 and tracing["sink"]["undecodable"] == 0
    assert tracing["proxy_metrics_before_stop"]["requests_total"] > 0
    access_log = doc["access_log"]
    assert access_log["file"]["lines"] >= access_log["proxy_metrics_before_stop"]["requests_total"] > 0
    for target in ("proxy-traced", "defaults"):  # the proxy and its exporter process
        processes = doc["memory"][target]["processes"]
        assert len(processes) == 2 and all(p["vm_hwm_bytes"] > 0 for p in processes), target
    assert len(doc["memory"]["bare"]["processes"]) == 1 and doc["memory"]["bare"]["peak_bytes"] > 0


def test_bench_rejects_unknown_scenario_and_target():
    result = run_bench("--scenarios", "S9")
    assert result.returncode == 2
    assert "unknown scenario S9" in result.stderr
    result = run_bench("--targets", "direct,nginx")
    assert result.returncode == 2
    assert "unknown target nginx" in result.stderr


@pytest.mark.parametrize("argv, message", [
    (["--proxy-set", "pool.bogus=1"], "unknown key pool.bogus in --proxy-set"),
    (["--proxy-set", "timeouts.connect=-1"], "timeouts.connect = '-1' (from --proxy-set)"),
    (["--proxy-set", "nokey"], "expected KEY=VALUE"),
    (["--proxy-set", "listen=127.0.0.1:8000"], "listen is chosen by the bench for each target"),
    (["--proxy-set", "admin=0.0.0.0:0"], "admin is chosen by the bench for each target"),
    (["--scale", "inf"], "--scale must be a number > 0"),
    (["--scale", "nan"], "--scale must be a number > 0"),
    (["--scenarios", ","], "no scenario named"),
    (["--json", "/nonexistent-dir/results.json"], "is not a writable directory"),
    (["--json", "/proc/results.json"], "--json /proc/results.json: cannot write it"),
    (["--scale", "1e308"], "--scale must be a number > 0 and at most 100"),
    (["--proxy-cmd", "{foo}"], "only {port} and {upstream_port} are filled in"),
    (["--proxy-cmd", "nginx -g {port"], "only {port} and {upstream_port} are filled in"),
    (["--scenarios", ""], "no scenario named in ''"),  # not every scenario
    (["--targets", ""], "no target named in ''"),  # not the default targets
    (["--reps", "0"], "--reps must be from 1 to 100, got 0"),
    (["--reps", "99999999999"], "--reps must be from 1 to 100, got 99999999999"),
    (["--load-procs", "0"], "--load-procs must be from 1 to 64, got 0"),
], ids=["unknown-key", "bad-value", "no-equals", "listen", "admin", "scale-inf", "scale-nan", "no-scenario", "json-dir",
        "json-unwritable", "scale-huge", "cmd-unknown-field", "cmd-open-brace", "empty-scenarios", "empty-targets",
        "no-reps", "endless-reps", "no-load-procs"])
def test_bench_refuses_bad_arguments_before_starting_anything(argv, message):
    result = run_bench(*argv)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert "\nbench: " not in result.stderr  # nothing was started: no progress lines


# --- targets, the report, the proxy settings -------------------------------------------------


def test_targets_are_parsed_in_table_order_and_rotated_per_rep():
    assert parse_targets("proxy-traced, DIRECT") == ("direct", "proxy-traced")
    assert parse_targets("defaults,bare") == ("bare", "defaults")
    with pytest.raises(ValueError):
        parse_targets("proxy,traced")
    # without --proxy-cmd, proxy would be bare again; with one, it is its column
    assert parse_targets(default_targets(None)) == ("direct", "bare", "proxy-traced", "proxy-logged", "defaults")
    assert parse_targets(default_targets("nginx -c x")) == ("direct", "bare", "proxy", "proxy-traced", "proxy-logged",
                                                           "defaults")  # the receiver targets only when named
    assert parse_targets("proxy-receiver-grpc,bare,proxy-receiver") == ("bare", "proxy-receiver",
                                                                        "proxy-receiver-grpc")
    targets = ("direct", "proxy", "proxy-traced", "proxy-logged")
    assert [run_order(targets, rep) for rep in range(5)] == [
        ("direct", "proxy", "proxy-traced", "proxy-logged"), ("proxy", "proxy-traced", "proxy-logged", "direct"),
        ("proxy-traced", "proxy-logged", "direct", "proxy"), ("proxy-logged", "direct", "proxy", "proxy-traced"),
        ("direct", "proxy", "proxy-traced", "proxy-logged")]


def test_proxy_targets_differ_only_in_observability():
    upstream = "http://127.0.0.1:1"
    plain = build_settings(upstream, minimal_overrides())
    traced = build_settings(upstream, traced_overrides("http://127.0.0.1:2"))
    logged = build_settings(upstream, logged_overrides("/tmp/access.jsonl"))
    assert (plain.tracing.exporter, plain.access_log.path, plain.admin) == ("off", "", None)
    assert (traced.tracing.exporter, traced.tracing.otlp_endpoint, traced.tracing.otlp_protocol) == (
        "otlp", "http://127.0.0.1:2", "http/protobuf")
    assert traced.access_log.path == "" and traced.admin.port == 0
    assert (logged.tracing.exporter, logged.access_log.path, logged.admin.port) == ("off", "/tmp/access.jsonl", 0)
    shipped = build_settings(upstream, defaults_overrides())
    assert (shipped.tracing.exporter, shipped.access_log.path, shipped.admin.port) == ("auto", "-", 0)
    for section in ("timeouts", "pool", "limits", "stall", "forwarding", "request_id"):
        assert getattr(plain, section) == getattr(traced, section) == getattr(logged, section) == \
            getattr(shipped, section), section
    # --proxy-set comes after the target's keys, so it wins
    assert build_settings(upstream, [*minimal_overrides(), "access_log.path=-"]).access_log.path == "-"


def _figures(req_s, latency, ttft=None, errors=0, hangs=0):
    return {"req_s": req_s, "latency_p50": latency, "ttft_p50": ttft, "ok": 10, "errors": errors, "hangs": hangs,
            "reconnects": 0, "ttfb_p50": latency}


def test_report_compares_every_proxy_target_with_direct_and_prices_tracing():
    summary = {
        "S1": {"direct": _figures(1000, 0.1), "proxy": _figures(500, 0.4), "proxy-traced": _figures(400, 0.5)},
        "S2": {"direct": _figures(None, 1.0, 20.0), "proxy": _figures(None, 1.0, 21.0),
               "proxy-traced": _figures(None, 1.0, 21.5, errors=2)},
    }
    rows = report.scenario_rows("S1", ("req_s", "latency_p50"), summary["S1"],
                                ("direct", "proxy", "proxy-traced", "proxy-logged"))
    assert rows[0] == ["S1", "req/s", "1,000", "500.0", "400.0", "–", "0.50×", "0.40×", "–"]  # proxy-logged: not run
    rows = report.scenario_rows("S1", ("req_s", "latency_p50"), summary["S1"], ("direct", "proxy", "proxy-traced"))
    assert rows[0] == ["S1", "req/s", "1,000", "500.0", "400.0", "0.50×", "0.40×"]
    assert rows[1][-2:] == ["+0.30 ms", "+0.40 ms"]
    assert report.header(("proxy", "proxy-traced")) == ["scenario", "metric", "proxy", "proxy-traced"]
    memory = {"proxy": {"peak_bytes": 50 << 20, "processes": [{"vm_hwm_bytes": 50 << 20}]},
              "proxy-traced": {"peak_bytes": 90 << 20,
                               "processes": [{"vm_hwm_bytes": 60 << 20}, {"vm_hwm_bytes": 30 << 20}]}}
    assert report.memory_row(memory, ("direct", "proxy", "proxy-traced"))[2:5] == ["–", "50.0", "90.0 (60.0 + 30.0)"]
    cost = report.added_cost(summary, memory, "proxy-traced", "proxy")
    assert cost[0].endswith("a 20.0 % drop")
    assert "+0.10 ms added" in cost[1] and cost[1].startswith("S1 request latency p50")
    assert "+0.50 ms added" in cost[2] and cost[2].startswith("S2 TTFT p50")
    assert "+40.0 MiB" in cost[3]
    assert report.regressed(summary["S2"]["direct"], summary["S2"]["proxy-traced"])
    assert not report.regressed(summary["S2"]["direct"], summary["S2"]["proxy"])
    assert report.added_cost({"S1": {"direct": _figures(1, 1)}}, {}, "proxy-traced") == []
    assert report.added_cost(summary, memory, "proxy-logged", "proxy") == []  # not run
    assert report.added_cost(summary, memory, "proxy-traced") == []  # bare did not run


def test_cpu_per_request_is_the_trees_cpu_over_the_requests_answered_and_priced_against_bare():
    run = {"ok": 400, "proxy_cpu_s": 0.05}
    assert report.cpu_us_per_request(run) == pytest.approx(125.0)
    assert report.cpu_us_per_request({"ok": 0, "proxy_cpu_s": 0.05}) is None  # nothing answered: no figure
    assert report.cpu_us_per_request({"ok": 10, "proxy_cpu_s": None}) is None  # direct, or the proxy died
    summary = {"S1": {"bare": {"cpu_us": 100.0}, "proxy-logged": {"cpu_us": 130.0}, "defaults": {"cpu_us": 250.0}},
               "S3": {"bare": {"cpu_us": None}, "defaults": {"cpu_us": 9.0}}}
    targets = ("direct", "bare", "proxy-logged", "defaults")
    assert report.observer_prices(summary, targets) == [
        "S1: bare 100 µs; logged 130 (+30, 1.30×); defaults 250 (+150, 2.50×)"]  # S3: no bare figure
    assert report.observer_prices(summary, ("direct", "defaults")) == []  # nothing to price against
    assert report.bare_of(("direct", "proxy", "proxy-traced")) == "proxy"
    assert report.bare_of(("direct", "bare", "proxy")) == "bare"


# --- the OTLP sink ---------------------------------------------------------------------------


def _export_request(spans: int) -> bytes:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    for i in range(spans):
        span = scope.spans.add()
        span.name, span.trace_id, span.span_id = f"s{i}", bytes(16), i.to_bytes(8, "big")
    return request.SerializeToString()


def _post(port: int, body: bytes, **headers) -> tuple[int, str, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/traces", data=body, method="POST",
                                     headers={"Content-Type": "application/x-protobuf", **headers})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=5) as response:
        return response.status, response.headers["Content-Type"], response.read()


def test_sink_counts_requests_bytes_and_spans_and_reports_them_on_stop(tmp_path):
    port_file, stats_file = tmp_path / "sink.port", tmp_path / "sink.stats.json"
    with Children(tmp_path) as children:
        sink = children.start("sink", python_module("traceproxy.bench.sink_proc", "--port-file", str(port_file),
                                                    "--stats-file", str(stats_file)))
        port = wait_port_file(sink, port_file)
        plain, packed = _export_request(3), gzip.compress(_export_request(2))
        assert _post(port, plain) == (200, "application/x-protobuf", b"")
        assert _post(port, packed, **{"Content-Encoding": "gzip"})[0] == 200
        assert _post(port, b"\xff\xff not protobuf")[0] == 200  # answered, counted as undecodable
        children.stop(sink)
    stats = json.loads(stats_file.read_text())
    assert stats == {"requests": 3, "bytes": len(plain) + len(packed) + 15, "spans": 5, "undecodable": 1,
                     "other": 0}


# --- the measuring parts -------------------------------------------------------------------


def _sse_response(tokens: int) -> bytes:
    events = [b'data: {"choices": [], "ts": %d}\n\n' % (1_000_000 + i) for i in range(tokens)]
    events += [b'data: {"usage": {}}\n\n', b"data: [DONE]\n\n"]
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" + body


@pytest.mark.parametrize("detail", [True, False])
@pytest.mark.parametrize("piece", [1, 7, 1 << 20])
def test_sse_events_are_counted_across_any_read_boundaries(detail, piece):
    async def scenario():
        rec = Recorder()
        conn = Conn(rec, detail)
        conn.connection_made(RecordingTransport())
        waiter = conn.request(b"GET / HTTP/1.1\r\n\r\n", True, 5 + 2, timeout=5)
        wire = _sse_response(5)
        for i in range(0, len(wire), piece):
            conn.data_received(wire[i:i + piece])
        return await waiter, rec

    error, rec = asyncio.run(scenario())
    assert error is None
    assert (rec.ok, rec.streams, rec.events, dict(rec.errors)) == (1, 1, 7, {})
    if detail:
        assert len(rec.ttft.values) == 1 and len(rec.gaps.values) == 4 and len(rec.delivery.values) == 5


def test_a_stream_cut_before_done_is_an_error():
    async def scenario():
        rec = Recorder()
        conn = Conn(rec, True)
        conn.connection_made(RecordingTransport())
        waiter = conn.request(b"GET / HTTP/1.1\r\n\r\n", True, 4, timeout=5)
        wire = _sse_response(2)
        conn.data_received(wire[: wire.index(b"data: [DONE]")])
        conn.connection_lost(None)
        return await waiter, rec

    error, rec = asyncio.run(scenario())
    assert error == "closed" and rec.ok == 0 and rec.errors["closed"] == 1


def test_upload_body_is_exactly_the_requested_size_and_valid_json():
    spec = RequestSpec(tokens=4, body_bytes=1 << 20)
    body = spec.body()
    assert len(body) == 1 << 20
    assert json.loads(body)["max_tokens"] == 4
    wire = spec.encode("127.0.0.1:1")
    assert b"Content-Length: 1048576\r\n" in wire and wire.endswith(body)


def test_scaling_keeps_scenarios_meaningful():
    tiny = scaled(BY_NAME["S5"], 0.001)
    assert tiny.connections >= 2 and tiny.rounds >= 2
    assert scaled(BY_NAME["S1"], 0.001).duration > 0
    assert [s.name for s in select("s5,S1", 1)] == ["S5", "S1"]
    with pytest.raises(ValueError):
        select("S1,S7", 1)


def test_split_and_percentiles():
    assert split(5, 2) == [(0, 3), (3, 2)]
    assert split(1, 4) == [(0, 1)]
    assert percentile([], 50) is None
    assert percentile(list(range(1, 101)), 99) == 99
    samples = Samples(cap=10)
    for i in range(1000):
        samples.add(i)
    assert len(samples.values) == 10 and samples.seen == 1000


def test_children_never_share_the_bench_stdout_and_run_in_the_workdir(tmp_path):
    """A child that writes a lot to stdout (an access log to "-") must never block on a pipe."""
    script = ("import os, sys; sys.stdout.write('x' * (4 << 20)); sys.stdout.flush(); "
              "open('here', 'w').write(os.readlink('/proc/self/fd/1'))")
    with Children(tmp_path) as children:
        child = children.start("chatty", [sys.executable, "-c", script])
        deadline = time.monotonic() + 30
        while child.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.proc.returncode == 0
    # The child's stdout was /dev/null: not the bench's own (the table), not a pipe.
    assert (tmp_path / "here").read_text() == os.devnull


def test_children_are_stopped_by_process_group_even_on_error(tmp_path):
    # The child starts a process of its own (as a proxy starts its exporter): the whole
    # group is stopped, not only the process the bench started.
    script = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              "time.sleep(60)']); open('grandchild', 'w').write(str(p.pid)); time.sleep(60)")
    with pytest.raises(RuntimeError):
        with Children(tmp_path) as children:
            child = children.start("sleeper", [sys.executable, "-c", script])
            pid = child.pid
            deadline = time.monotonic() + 30
            while not (tmp_path / "grandchild").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            grandchild = int((tmp_path / "grandchild").read_text())
            raise RuntimeError("boom")

    def gone(p: int) -> bool:
        return not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE

    assert gone(pid)
    deadline = time.monotonic() + 10
    while not gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(grandchild)


def test_top_level_help_names_every_command():
    from traceproxy.cli import _parser

    parser = _parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(commands) <= set(parser.description.replace("|", " ").replace("`", " ").split())


def test_a_child_interrupted_while_stopping_is_still_killed_on_the_way_out(tmp_path):
    # SIGTERM ignored: the stop waits its grace; Ctrl-C then must not orphan the child.
    script = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
             "print('ready', file=sys.stderr, flush=True); time.sleep(60)"
    with pytest.raises(KeyboardInterrupt):
        with Children(tmp_path) as children:
            child = children.start("stubborn", [sys.executable, "-c", script])
            pid = child.pid
            deadline = time.monotonic() + 10
            while "ready" not in child.log_tail() and time.monotonic() < deadline:
                time.sleep(0.05)
            original = Child.stop

            def interrupted(self, *args, **kwargs):
                os.kill(self.pid, signal.SIGTERM)  # ignored by the child
                raise KeyboardInterrupt  # as if Ctrl-C landed during the grace period

            Child.stop = interrupted
            try:
                children.stop(child)
            finally:
                Child.stop = original
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_child_stopped_twice_is_signalled_once(tmp_path, monkeypatch):
    # A run stops its engine loads before the drain and every child again on the way out:
    # the second stop must not signal a process group id that may be another's by now.
    from traceproxy.bench import procs

    with Children(tmp_path) as children:
        child = children.start("short", [sys.executable, "-c", "import time; time.sleep(60)"])
        code = children.stop(child, grace=5)
        signalled = []
        monkeypatch.setattr(procs, "_signal_group", lambda pgid, sig: signalled.append((pgid, sig)))
        assert children.stop(child, grace=5) == code and signalled == []


def test_requests_never_started_are_hangs_in_the_log_and_noted_apart_from_errors():
    from traceproxy.bench.runner import _error_kinds, _hangs, _never_started

    result = {"hangs": 2, "skipped": 12, "errors": {"status 502": 3}}
    assert _hangs(result) == "14 (12 never started)"
    assert _error_kinds([result]) == {"status 502": 3}
    assert _never_started([result, result]) == 24
    lines = report.notes({"S5": {"proxy": {}, "error_kinds": {"proxy": {"status 502": 3}},
                                 "never_started": {"proxy": 12}}})
    assert lines == ["S5 proxy errors: status 502×3",
                     "S5 proxy: 12 requests never started within the scenario's time budget; "
                     "they are counted as hangs."]


@pytest.mark.parametrize("argv, reason", [
    (["--proxy-cmd", "no-such-proxy-program --listen {port}"], "could not run: proxy: cannot run 'no-such-proxy-program'"),
    # only starting finds it: the proxy process says so, and the bench stops
    (["--proxy-set", "access_log.path=/proc/version"],
     "configuration error: access_log.path = '/proc/version' (from --proxy-set)"),
], ids=["missing-program", "unwritable-log"])
def test_a_proxy_that_cannot_start_stops_the_bench_with_its_reason(tmp_path, argv, reason):
    result = run_bench("--quick", "--targets", "direct,proxy", "--scenarios", "S5", *argv, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert reason in result.stderr and "Traceback" not in result.stderr


def test_cpu_of_a_tree_keeps_what_exited_children_used_and_a_gone_process_is_unknown(tmp_path):
    from traceproxy.bench.monitor import CpuWindow

    # A parent that starts a child burning CPU and reaps it inside the window.
    script = ("import subprocess, sys, time; open('started', 'w').close(); sys.stdin.readline(); "
              "subprocess.run([sys.executable, '-c', 'import time\\nend = time.process_time() + 0.4\\n"
              "while time.process_time() < end: pass']); sys.stdin.readline()")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, stdin=subprocess.PIPE, text=True)
    short = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        window = CpuWindow({"tree": parent.pid, "short": short.pid})
        t0 = time.monotonic()
        window.start()
        parent.stdin.write("go\n")
        parent.stdin.flush()
        short.communicate("bye\n", timeout=30)  # exits inside the window
        deadline = time.monotonic() + 30
        while not psutil.Process(parent.pid).children() and time.monotonic() < deadline:
            time.sleep(0.01)
        while psutil.Process(parent.pid).children() and time.monotonic() < deadline:
            time.sleep(0.02)  # the child ran and was reaped
        usage = window.stop()
        wall = time.monotonic() - t0  # at least the window's own
    finally:
        parent.communicate("bye\n", timeout=30)
    assert usage["tree"] is not None and usage["tree"] / 100 * wall >= 0.35, (usage, wall)  # the child's 0.4 s
    assert usage["short"] is None  # gone before the window ended: unknown, never negative


def test_the_proxy_process_says_why_it_could_not_bind_rather_than_a_traceback(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "traceproxy.bench.proxy_proc", "--upstream", "http://127.0.0.1:9",
             "--port-file", str(tmp_path / "port"), "--set", f"listen=127.0.0.1:{taken.getsockname()[1]}",
             "--set", "tracing.exporter=off", "--set", "access_log.path="],
            capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert result.returncode == 1
    assert "could not start:" in result.stderr and "address already in use" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_proxy_process_sets_the_allocator_as_serve_does(tmp_path, monkeypatch):
    # A target is priced as serve runs it: serve sets glibc's thresholds before it serves
    # (allocator.py), which changes what a request costs; the bench's process must too.
    from traceproxy.bench import proxy_proc

    order = []
    monkeypatch.setattr(proxy_proc, "tune_allocator", lambda: order.append("allocator"))
    monkeypatch.setattr(proxy_proc.uvloop, "run", lambda coroutine: (coroutine.close(), order.append("serve")))
    assert proxy_proc.main(["--upstream", "http://127.0.0.1:9", "--port-file", str(tmp_path / "port"),
                            "--set", "tracing.exporter=off", "--set", "access_log.path="]) == 0
    assert order == ["allocator", "serve"]
