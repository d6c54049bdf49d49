"""``traceproxy bench --engine-span-load RATE`` and the receiver targets: two emulated SGLang
workers export their spans during every run, to the target's receiver or to a discard sink, so
that both sides of the comparison pay the emulated engines' CPU alike. No timing thresholds."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import sys

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from traceproxy.bench import report
from traceproxy.bench.discard_proc import BAD, OK, Counts, Discard
from traceproxy.bench.proxy_proc import build_settings, minimal_overrides, receiver_overrides
from traceproxy.bench.span_load import BATCH, Load, template

from .fake_transport import RecordingTransport
from .support import checkout_environment, refused_port, run_bench



def test_every_target_pays_the_same_engine_span_load_and_the_receivers_take_theirs(tmp_path):
    report_path = tmp_path / "bench.json"
    result = run_bench("--quick", "--scale", "0.05", "--scenarios", "S1", "--targets",
                    "bare,proxy-receiver,proxy-receiver-grpc", "--engine-span-load", "40", "--json", str(report_path))
    assert result.returncode == 0, result.stderr[-2000:]
    doc = json.loads(report_path.read_text())
    assert doc["meta"]["engine_span_load"] == 40
    for target, destination in (("bare", "discard"), ("proxy-receiver", "http"), ("proxy-receiver-grpc", "grpc")):
        [run] = doc["runs"]["S1"][target]
        assert run["engine_destination"] == destination, target
        loads = {load["role"]: load for load in run["engine_loads"]}
        assert set(loads) == {"prefill", "decode"}, target
        for load in loads.values():
            # every export answered with success, and the load stopped with its run, not at its bound
            assert load["spans_sent"] > 0 and load["spans_not_sent"] == 0 and load["spans_dropped"] == 0, load
            assert load["protocol"] == ("grpc" if destination == "grpc" else "http")
            assert load["elapsed"] < 30, load
        assert run["cpu"]["engines"] is not None, target
        if destination == "discard":
            assert "discard" in run["cpu"] and "receiver" not in run["cpu"]
        else:  # the receivers' process, read apart from the proxy's tree it is part of
            assert run["cpu"]["receiver"] is not None and "discard" not in run["cpu"], target
    lines = result.stdout.splitlines()
    for target in ("proxy-receiver", "proxy-receiver-grpc"):
        title = f"Engine span receiver cost ({report.SHORT[target]}), {target} against bare:"
        assert title in lines, result.stdout
        section = lines[lines.index(title) + 1:]
        assert section[0].startswith("- S1 throughput:")
        assert any("the receivers' process" in line and "per 1,000 spans taken" in line for line in section[:8])
    assert any(line.startswith("- S1: spans taken a second") and "none refused or lost" in line for line in lines)
    # the discard sink took the bare runs' export requests, and refused none
    assert doc["engine_discard"]["requests"] > 0 and doc["engine_discard"]["refused"] == 0
    assert doc["memory"]["proxy-receiver"]["processes"][1]["vm_hwm_bytes"] > 0  # the receivers' process


@pytest.mark.parametrize("args, said", [
    (["--engine-span-load", "-1"], "--engine-span-load must be requests a second from 0 (off) to 5000"),
    (["--engine-span-load", "nan"], "--engine-span-load must be requests a second"),
    (["--proxy-set", "engines.otlp_receiver=127.0.0.1:4318"], "add one of those targets instead"),
    (["--proxy-set", "engines.otlp_receiver_grpc=127.0.0.1:4317"], "the engine span receivers are on in the "
                                                                    "proxy-receiver"),
])
def test_bench_refuses_an_engine_span_load_or_receiver_setting_it_cannot_use(args, said):
    result = run_bench("--scenarios", "S1", *args)
    assert result.returncode == 2 and said in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "\nbench: " not in result.stderr  # nothing started


def test_the_loads_export_sglangs_spans_in_batches_of_64():
    prefill, decode = template("prefill")[1], template("decode")[1]
    assert len(prefill) == 9 and len(decode) == 25  # for S5's 16 tokens
    names = {span.name for span in decode}
    assert {"decode_waiting", "decode_forward", "decode_loop"} <= names
    assert any(name.startswith("decode Req ") for name in names)
    ends = [span.end_time_unix_nano for span in decode]
    assert ends == sorted(ends)  # in the order they end, so the order they are exported

    class Kept:
        def __init__(self) -> None:
            self.bodies: list[bytes] = []

        def send(self, body: bytes) -> bool:
            self.bodies.append(body)
            return True

    load = Load("decode", 100.0, "http://127.0.0.1:1/v1/traces")
    load.sender = Kept()
    for _ in range(3):
        load.add_request()
    load.export_batch()
    request = ExportTraceServiceRequest.FromString(load.sender.bodies[0])
    [resource_spans] = request.resource_spans
    [scope] = resource_spans.scope_spans
    assert len(scope.spans) == BATCH and scope.scope.name == "sglang server"
    assert len({span.trace_id for span in scope.spans}) == 3  # a trace of its own per request
    assert load.counts["spans_sent"] == BATCH and len(load.queue) == 3 * 25 - BATCH


def _discard(*chunks: bytes) -> tuple[Counts, RecordingTransport]:
    counts, transport = Counts(), RecordingTransport()
    protocol = Discard(counts)
    protocol.connection_made(transport)
    for chunk in chunks:
        protocol.data_received(chunk)
    return counts, transport


def test_the_discard_sink_answers_each_request_once_its_body_is_in_whatever_the_reads():
    body = b"x" * 1000
    one = b"POST /v1/traces HTTP/1.1\r\nHost: a\r\nContent-Length: 1000\r\n\r\n" + body
    stream = one * 3
    for cut in (1, 7, 60, 500, len(one), len(one) + 3):
        counts, transport = _discard(*(stream[i:i + cut] for i in range(0, len(stream), cut)))
        assert transport.written == OK * 3 and not transport.closed, cut
        assert counts.snapshot() == {"requests": 3, "bytes": 3000, "refused": 0}
    counts, transport = _discard(one[:-1])
    assert transport.written == b""  # not until the body's last byte


@pytest.mark.parametrize("head", [b"POST /v1/traces HTTP/1.1\r\nHost: a\r\n\r\n",
                                  b"POST /v1/traces HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
                                  b"POST /v1/traces HTTP/1.1\r\nContent-Length: ten\r\n\r\n",
                                  b"POST /v1/traces HTTP/1.1\r\nX: " + b"y" * 70_000])
def test_the_discard_sink_refuses_a_body_it_cannot_delimit_and_closes(head):
    counts, transport = _discard(head)
    assert transport.written == BAD and transport.closed
    assert counts.refused == 1 and counts.requests == 0


def test_the_receivers_cpu_is_priced_per_1000_spans_and_against_the_same_load():
    assert report.ms_per_1000_spans(11.0, 14_700) == pytest.approx(7.48, abs=0.01)
    assert report.ms_per_1000_spans(None, 14_700) is None and report.ms_per_1000_spans(5.0, 0) is None

    def figures(req_s, ttfb, cpu_us, receiver=None, discard=None):
        return {"req_s": req_s, "latency_p50": ttfb, "ttfb_p50": ttfb, "cpu_us": cpu_us, "cpu_receiver": receiver,
                "cpu_engines": 20.0, "cpu_discard": discard, "engine_spans_s": 14_700.0 if receiver else None,
                "receiver_ms_per_1000_spans": report.ms_per_1000_spans(receiver, 14_700.0)}

    summary = {"S1": {"bare": figures(1000, 1.0, 100, discard=1.0),
                      "proxy-receiver": figures(950, 1.02, 120, receiver=11.0)},
               "S5": {"bare": figures(None, 0.50, 300, discard=1.0),
                      "proxy-receiver": figures(None, 0.53, 330, receiver=11.0)}}
    lines = report.receiver_cost(summary, {}, "proxy-receiver", "bare")
    assert lines[0] == "S1 throughput: 1,000 -> 950.0 req/s, a 5.0 % drop"
    assert any(line.startswith("S5 (paced) TTFB p50: 0.50 -> 0.53 ms, +0.03 ms added, +6.0 %") for line in lines)
    [s1] = [line for line in lines if line.startswith("S1: ")]
    assert "100 -> 120 µs/request (1.20×" in s1 and "11.0 % of a core, 7.5 ms per 1,000 spans" in s1
    assert "the discard sink 1.0 % on bare's side" in s1


def test_a_receiver_target_is_bare_with_one_receiver_on():
    upstream = "http://127.0.0.1:1"
    bare = build_settings(upstream, minimal_overrides())
    http = build_settings(upstream, receiver_overrides(http_port=4318))
    grpc = build_settings(upstream, receiver_overrides(grpc_port=4317))
    assert bare.engines.otlp_receiver is None and bare.engines.otlp_receiver_grpc is None
    assert (http.engines.otlp_receiver.host, http.engines.otlp_receiver.port) == ("127.0.0.1", 4318)
    assert http.engines.otlp_receiver_grpc is None and grpc.engines.otlp_receiver is None
    assert grpc.engines.otlp_receiver_grpc.port == 4317
    for section in ("tracing", "access_log", "timeouts", "pool", "limits", "stall", "forwarding", "request_id"):
        assert getattr(bare, section) == getattr(http, section) == getattr(grpc, section), section
    assert bare.admin is None and http.admin is None


def test_a_span_load_stops_with_its_counts_on_sigterm_or_when_its_stdin_closes(tmp_path):
    """The bench stops each load by SIGTERM to its process group and waits 3 s before SIGKILL;
    a load that missed it would leave no counts and stop the whole bench."""
    closed = refused_port()  # held to the end: every export fails at once, and is counted
    url = f"http://127.0.0.1:{closed.getsockname()[1]}/v1/traces"
    env = checkout_environment()
    loads = []
    for k in range(4):
        out = tmp_path / f"load{k}.json"
        proc = subprocess.Popen([sys.executable, "-m", "traceproxy.bench.span_load", "--role", "decode", "--rate",
                                 "400", "--url", url, "--out", str(out), "--max-seconds", "60"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=tmp_path, env=env)
        loads.append((proc, out))
    try:
        for proc, _ in loads:
            assert proc.stdout.readline() == b"ready\n"
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
        for k, (proc, _) in enumerate(loads):
            time.sleep(0.2 + 0.07 * k)  # each at another point of its loop
            if k == 0:
                proc.stdin.close()  # the bench gone
            else:
                proc.send_signal(signal.SIGTERM)
            assert proc.wait(3) == 0, k
        for proc, out in loads:
            counts = json.loads(out.read_text())
            assert counts["requests"] > 0 and counts["spans_not_sent"] > 0 and counts["spans_sent"] == 0
            assert counts["elapsed"] < 30
    finally:
        for proc, _ in loads:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
        closed.close()
