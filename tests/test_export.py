"""Span export through the exporter process: delivery over real OTLP receivers, the
OTLP/JSON file, and isolation (a down, black-holing, slow or failing collector, or
a dead exporter process, costs the proxy's event loop nothing but dropped spans)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

import traceproxy
from traceproxy.observe.export import ExportConfig, SpanExportPipe
from traceproxy.observe.export_wire import AccessLines, FRAME_HEADER, decode_frame, encode_frame, parse_stats_line
from traceproxy.observe.otlp_settings import http_traces_url
from traceproxy.observe.semconv import SCHEMA_URL
from traceproxy.observe.spans import AttemptSummary, RequestSummary
from traceproxy.observe.spandata import (
    KIND_CLIENT,
    KIND_SERVER,
    STATUS_ERROR,
    STATUS_OK,
    SpanData,
    SpanEvent,
)
from traceproxy.observe.tracing import TracingObserver

from .otlp_receiver import OtlpGrpcReceiver, OtlpHttpReceiver, ReceivedSpan, flatten
from .support import RawClient, refused_port, start_pipe, wait_until  # noqa: F401  (start_pipe: a fixture)

BASE_NS = 1_700_000_000_123_456_789
TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
REMOTE_PARENT_ID = 0xB7AD6B7169203331
SERVER_ID, CLIENT_ID = 0x00F067AA0BA902B7, 0x53995C3F42CD8AD8
HEX_ID = re.compile(r"^[0-9a-f]+$")


@pytest.fixture(autouse=True)
def no_otel_environment(monkeypatch):
    """The child inherits the environment; only what a test sets may reach it."""
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)


def make_config(exporter: str = "otlp", **overrides) -> ExportConfig:
    defaults = dict(
        exporter=exporter, otlp_endpoint="", otlp_protocol="http/protobuf", file_path="",
        service_name="proxy-under-test", resource_attributes={"deployment.environment": "test"},
    )
    return ExportConfig(**{**defaults, **overrides})


def sample_trace(trace_id: int = TRACE_ID) -> list[SpanData]:
    server = SpanData(
        trace_id=trace_id, span_id=SERVER_ID, parent_span_id=REMOTE_PARENT_ID,
        name="POST /v1/chat/completions", kind=KIND_SERVER,
        start_unix_ns=BASE_NS, end_unix_ns=BASE_NS + 2_500_000,
        attributes={"http.request.method": "POST", "http.response.status_code": 502,
                    "traceproxy.ttfb_s": 0.125, "traceproxy.reused": True},
        events=(SpanEvent("first_downstream_rx", BASE_NS + 1_000),
                SpanEvent("stall", BASE_NS + 2_000_000, {"phase": "upstream_ttfb", "waited_ms": 1500})),
        status_code=STATUS_ERROR, status_message="upstream reset", trace_state="vendor=abc",
    )
    client = SpanData(
        trace_id=trace_id, span_id=CLIENT_ID, parent_span_id=SERVER_ID, name="upstream", kind=KIND_CLIENT,
        start_unix_ns=BASE_NS + 10_000, end_unix_ns=BASE_NS + 2_400_000,
        attributes={"server.port": 8000}, status_code=STATUS_OK,
    )
    return [server, client]


def assert_sample_trace(received: list[ReceivedSpan], trace_id: int = TRACE_ID) -> None:
    by_name = {span.name: span for span in received if span.trace_id == f"{trace_id:032x}"}
    server, client = by_name["POST /v1/chat/completions"], by_name["upstream"]

    assert (server.span_id, server.parent_span_id) == (f"{SERVER_ID:016x}", f"{REMOTE_PARENT_ID:016x}")
    assert (client.span_id, client.parent_span_id) == (f"{CLIENT_ID:016x}", f"{SERVER_ID:016x}")
    assert (server.span.kind, client.span.kind) == (2, 3)  # OTLP SERVER, CLIENT
    assert (server.span.start_time_unix_nano, server.span.end_time_unix_nano) == (BASE_NS, BASE_NS + 2_500_000)
    assert server.attributes == {"http.request.method": "POST", "http.response.status_code": 502,
                                 "traceproxy.ttfb_s": 0.125, "traceproxy.reused": True}
    assert client.attributes == {"server.port": 8000}
    events = [(e.name, e.time_unix_nano, {kv.key: kv.value for kv in e.attributes}) for e in server.span.events]
    assert [(name, at) for name, at, _ in events] == [("first_downstream_rx", BASE_NS + 1_000),
                                                      ("stall", BASE_NS + 2_000_000)]
    assert events[1][2]["phase"].string_value == "upstream_ttfb" and events[1][2]["waited_ms"].int_value == 1500
    assert (server.span.status.code, server.span.status.message) == (2, "upstream reset")
    assert client.span.status.code == 1
    assert server.span.trace_state == "vendor=abc"
    for span in (server, client):
        assert span.resource["service.name"] == "proxy-under-test"
        assert span.resource["deployment.environment"] == "test"
        assert (span.scope_name, span.scope_version) == ("traceproxy", traceproxy.__version__)
        # The semantic conventions the resource and the spans follow, as tracing.md says.
        assert span.schema_urls == (SCHEMA_URL, SCHEMA_URL)


def stats_of(loop_thread, pipe: SpanExportPipe) -> dict:
    return loop_thread.call(lambda: pipe.stats)


def niceness(pid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, pid)


# ------------------------------------------------------------------------- delivery
RECEIVERS = {"http/protobuf": OtlpHttpReceiver, "grpc": OtlpGrpcReceiver}


@pytest.mark.parametrize("protocol", sorted(RECEIVERS))
@pytest.mark.parametrize("endpoint_from", ["config", "OTEL_EXPORTER_OTLP_ENDPOINT"])
def test_otlp_delivers_every_field(protocol, endpoint_from, start_pipe, loop_thread, monkeypatch):
    with RECEIVERS[protocol]() as receiver:
        endpoint = receiver.endpoint
        if endpoint_from != "config":
            monkeypatch.setenv(endpoint_from, receiver.endpoint)
            endpoint = ""
        pipe = start_pipe(make_config(otlp_protocol=protocol, otlp_endpoint=endpoint))
        loop_thread.call(pipe.submit, sample_trace())  # a partial batch: goes out on the flush timer

        assert_sample_trace(receiver.wait_for_spans(2))
        assert wait_until(lambda: stats_of(loop_thread, pipe)["spans_exported"] == 2)
        assert not loop_thread.call(pipe.backlogged)
        assert niceness(pipe.pid) == min(19, niceness(os.getpid()) + pipe.config.nice)
        assert stats_of(loop_thread, pipe) == {
            "spans_submitted": 2, "spans_dropped": 0, "spans_queued": 0,
            "spans_exported": 2, "spans_failed": 0, "access_log_lines_lost": 0, "exporter_alive": True,
        }


def test_http_traces_endpoint_variable_and_sdk_resource_variables(start_pipe, loop_thread, monkeypatch):
    with OtlpHttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.traces_url)
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "host.name=box-1,deployment.environment=from-env")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
        pipe = start_pipe(make_config())
        loop_thread.call(pipe.submit_now, sample_trace())

        received = receiver.wait_for_spans(2)
        assert_sample_trace(received)  # the caller's service.name and attributes win over the SDK's
        assert received[0].resource["host.name"] == "box-1"
        assert receiver.headers_seen[0]["content-encoding"] == "gzip"


def test_batches_become_export_requests(start_pipe, loop_thread):
    with OtlpHttpReceiver() as receiver:
        pipe = start_pipe(make_config(otlp_endpoint=receiver.endpoint, batch_spans=4, flush_interval=5.0))
        for trace in range(5):
            loop_thread.call(pipe.submit, sample_trace(TRACE_ID + trace))  # 10 spans: 4 + 4 + 2
        loop_thread.run(pipe.stop(timeout=5.0))  # flushes the partial batch, waits for the child

        assert len(receiver.spans()) == 10 and receiver.requests == 3
        assert stats_of(loop_thread, pipe)["spans_exported"] == 10


def test_http_traces_url_appends_the_signal_path_to_a_base_endpoint():
    assert http_traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert http_traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert http_traces_url("https://c/otlp/") == "https://c/otlp/v1/traces"
    assert http_traces_url("http://c:4318/v1/traces") == "http://c:4318/v1/traces"


def test_request_summaries_become_spans_in_the_exporter(start_pipe, loop_thread, start_proxy, fast_upstream):
    """The proxy's real path: TracingObserver submits a summary per request; the child builds the spans."""
    with OtlpHttpReceiver() as receiver:
        pipe = start_pipe(make_config(otlp_endpoint=receiver.endpoint))
        observer = TracingObserver(pipe, ("127.0.0.1", 8000), ("127.0.0.1", 1), healthy_sample_ratio=1.0)
        proxy = start_proxy(fast_upstream().url, observers=[observer])
        client = RawClient(proxy.port)
        response = client.roundtrip("POST", "/v1/chat/completions", body=b'{"model": "m", "max_tokens": 3}')
        client.close()

        received = receiver.wait_for_spans(2)
    server, upstream = sorted(received, key=lambda span: span.span.kind)  # SERVER=2, CLIENT=3
    assert response.status == 200
    assert server.name == "POST /v1/chat/completions" and upstream.parent_span_id == server.span_id
    assert server.trace_id == upstream.trace_id == response.headers["traceresponse"].split("-")[1]
    assert wait_until(lambda: stats_of(loop_thread, pipe)["spans_exported"] == 2)
    assert stats_of(loop_thread, pipe)["spans_submitted"] == 1  # one summary


# ----------------------------------------------------------------------------- file
def otlp_json_to_request(line: str) -> ExportTraceServiceRequest:
    """The otlpjson reading rule: hex ids back to bytes, then protobuf's JSON mapping."""
    document = json.loads(line)
    for resource_spans in document["resourceSpans"]:
        for scope_spans in resource_spans["scopeSpans"]:
            for span in scope_spans["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    return json_format.ParseDict(document, ExportTraceServiceRequest())


def test_file_lines_are_otlp_json(start_pipe, loop_thread, tmp_path):
    path = tmp_path / "not" / "yet" / "spans.jsonl"
    pipe = start_pipe(make_config("file", file_path=str(path)))
    loop_thread.call(pipe.submit_now, sample_trace())
    assert wait_until(lambda: path.exists() and path.read_text().endswith("\n"))
    loop_thread.call(pipe.submit, sample_trace(TRACE_ID + 1))
    loop_thread.run(pipe.stop(timeout=5.0))

    lines = path.read_text().splitlines()
    assert len(lines) == 2
    document = json.loads(lines[0])
    span = document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert document["resourceSpans"][0]["schemaUrl"] == "https://opentelemetry.io/schemas/1.41.0"
    assert document["resourceSpans"][0]["scopeSpans"][0]["schemaUrl"] == "https://opentelemetry.io/schemas/1.41.0"
    assert document["resourceSpans"][0]["scopeSpans"][0]["scope"] == {
        "name": "traceproxy", "version": traceproxy.__version__}
    assert (span["traceId"], span["spanId"], span["parentSpanId"]) == (
        f"{TRACE_ID:032x}", f"{SERVER_ID:016x}", f"{REMOTE_PARENT_ID:016x}")
    assert span["startTimeUnixNano"] == str(BASE_NS) and span["endTimeUnixNano"] == str(BASE_NS + 2_500_000)
    assert span["kind"] == 2 and span["status"] == {"code": 2, "message": "upstream reset"}
    attributes = {kv["key"]: kv["value"] for kv in span["attributes"]}
    assert attributes["http.response.status_code"] == {"intValue": "502"}
    assert attributes["traceproxy.ttfb_s"] == {"doubleValue": 0.125}
    assert attributes["traceproxy.reused"] == {"boolValue": True}
    assert attributes["http.request.method"] == {"stringValue": "POST"}
    assert span["events"][1]["timeUnixNano"] == str(BASE_NS + 2_000_000)

    for line in lines:
        for span in json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]:
            assert (len(span["traceId"]), len(span["spanId"]), len(span["parentSpanId"])) == (32, 16, 16)
            assert all(HEX_ID.match(span[key]) for key in ("traceId", "spanId", "parentSpanId"))

    assert_sample_trace(flatten(otlp_json_to_request(lines[0])))
    assert_sample_trace(flatten(otlp_json_to_request(lines[1])), TRACE_ID + 1)


def test_file_is_appended_to(start_pipe, loop_thread, tmp_path):
    path = tmp_path / "spans.jsonl"
    path.write_text('{"resourceSpans":[]}\n')
    pipe = start_pipe(make_config("file", file_path=str(path)))
    loop_thread.call(pipe.submit, sample_trace())
    loop_thread.run(pipe.stop())
    assert path.read_text().splitlines()[0] == '{"resourceSpans":[]}'
    assert len(path.read_text().splitlines()) == 2


def test_console_prints_one_line_per_span(start_pipe, loop_thread, capfd):
    pipe = start_pipe(make_config("console"))
    loop_thread.call(pipe.submit, sample_trace())
    loop_thread.run(pipe.stop())

    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("span trace=")]
    assert len(lines) == 2
    assert f"trace={TRACE_ID:032x} id={SERVER_ID:016x} parent={REMOTE_PARENT_ID:016x} kind=SERVER" in lines[0]
    assert "duration_ms=2.500" in lines[0] and "status=ERROR(upstream reset)" in lines[0]
    assert "http.response.status_code=502" in lines[0]


def test_off_starts_nothing(start_pipe, loop_thread):
    pipe = start_pipe(make_config("off"))
    loop_thread.call(pipe.submit, sample_trace())
    assert pipe.pid is None
    assert stats_of(loop_thread, pipe)["spans_dropped"] == 0


# ------------------------------------------------------------------------ isolation
EXPORT_TIMEOUT = 5.0
# A correctness bound far below EXPORT_TIMEOUT, not a performance number: an export on
# the loop would lag it by seconds; a slow moment of a loaded machine, by less than this.
LAG_BOUND = 1.5
FLOOD_CONFIG = dict(queue_spans=512, batch_spans=64, export_timeout=EXPORT_TIMEOUT)
MAX_ENCODED_SPAN = 4096  # generous: the sample spans encode to a few hundred bytes


async def flood(pipe: SpanExportPipe, seconds: float) -> dict:
    """Submit as fast as a busy proxy would while a ticker measures the loop's lag."""
    loop = asyncio.get_running_loop()
    worst = {"lag": 0.0, "submit": 0.0, "queued": 0, "buffered_bytes": 0, "backlogged": False}

    async def tick() -> None:
        while True:
            before = loop.time()
            await asyncio.sleep(0.01)
            worst["lag"] = max(worst["lag"], loop.time() - before - 0.01)

    ticker = loop.create_task(tick())
    until = loop.time() + seconds
    while loop.time() < until:
        for _ in range(20):
            started = time.perf_counter()
            pipe.submit(sample_trace())
            worst["submit"] = max(worst["submit"], time.perf_counter() - started)
        worst["queued"] = max(worst["queued"], pipe.stats["spans_queued"])
        worst["backlogged"] = worst["backlogged"] or pipe.backlogged()
        worst["buffered_bytes"] = max(worst["buffered_bytes"], pipe._writer.get_write_buffer_size())
        await asyncio.sleep(0.002)
    ticker.cancel()
    return worst


COLLECTOR_TROUBLE = [
    ("http/protobuf", "down"), ("grpc", "down"),
    ("http/protobuf", "black_hole"), ("grpc", "black_hole"),
    ("http/protobuf", "slow"), ("grpc", "slow"), ("http/protobuf", "error"),
]


def test_an_exporter_stuck_in_an_export_stops_on_the_parents_stop_now_not_sigkill(loop_thread, caplog):
    receiver = OtlpHttpReceiver(mode="black_hole").start()
    pipe = SpanExportPipe(make_config(otlp_protocol="http/protobuf", otlp_endpoint=receiver.endpoint,
                                      export_timeout=60.0))
    try:
        loop_thread.run(pipe.start())
        loop_thread.call(pipe.submit_now, sample_trace())
        assert wait_until(lambda: receiver.requests >= 1)  # the child now waits on the collector
        with caplog.at_level("WARNING", logger="traceproxy.export"):
            loop_thread.run(pipe.stop(timeout=2.0))
    finally:
        receiver.stop()
    escalations = [r.getMessage() for r in caplog.records if "did not finish in time" in r.getMessage()]
    assert len(escalations) == 1 and escalations[0].endswith("SIGUSR1"), escalations  # no SIGKILL after it
    assert loop_thread.call(lambda: pipe._process.returncode) == 128 + signal.SIGUSR1


STOP_WITHIN = 1.0  # the stop's deadline: a collector in trouble must not hold it longer


@pytest.mark.parametrize("protocol,trouble", COLLECTOR_TROUBLE)
def test_collector_trouble_costs_only_dropped_spans(protocol, trouble, loop_thread):
    # A slow collector answers after twice the lag bound: an export on the loop would break it.
    receiver = RECEIVERS[protocol](mode="ok" if trouble == "down" else trouble, delay=2 * LAG_BOUND).start()
    down = refused_port()  # held to the end: no test file beside this one can answer there
    endpoint = f"http://127.0.0.1:{down.getsockname()[1]}" if trouble == "down" else receiver.endpoint
    pipe = SpanExportPipe(make_config(otlp_protocol=protocol, otlp_endpoint=endpoint, **FLOOD_CONFIG))
    try:
        loop_thread.run(pipe.start())
        # The queue fills within milliseconds of a flood: a short one sheds as a long one does.
        worst = loop_thread.run(flood(pipe, seconds=0.6))
        stats = stats_of(loop_thread, pipe)

        started = time.monotonic()
        loop_thread.run(pipe.stop(timeout=STOP_WITHIN))
        stop_took = time.monotonic() - started
    finally:
        receiver.stop()
        down.close()

    assert worst["lag"] < LAG_BOUND and worst["submit"] < LAG_BOUND, worst
    assert stats["spans_dropped"] > 0 and stats["exporter_alive"], stats
    assert worst["backlogged"], "a collector in trouble must make healthy spans shed"
    assert worst["queued"] <= FLOOD_CONFIG["queue_spans"] + FLOOD_CONFIG["batch_spans"] + 2, worst
    assert worst["buffered_bytes"] <= FLOOD_CONFIG["queue_spans"] * MAX_ENCODED_SPAN, worst
    assert stop_took < STOP_WITHIN + 0.5, stop_took
    assert not stats_of(loop_thread, pipe)["exporter_alive"]


def test_export_failures_are_counted_by_the_child(start_pipe, loop_thread):
    with OtlpHttpReceiver(mode="error") as receiver:
        pipe = start_pipe(make_config(otlp_endpoint=receiver.endpoint, export_timeout=0.5))
        loop_thread.call(pipe.submit_now, sample_trace())
        assert wait_until(lambda: stats_of(loop_thread, pipe)["spans_failed"] == 2)
        # ... and shown: spans the collector refused are in no other counter.
        from types import SimpleNamespace

        from traceproxy.observe.metrics import Exposition, ProxyMetrics

        out = Exposition()
        fake = SimpleNamespace(span_export=pipe, tracing=None, watchdog=None,
                               ctx=SimpleNamespace(fanout=SimpleNamespace(observer_errors=0)))
        loop_thread.call(ProxyMetrics._render_internals, fake, out)
        assert "traceproxy_spans_failed_total 2" in out.text()
        receiver.mode = "ok"
        loop_thread.call(pipe.submit_now, sample_trace(TRACE_ID + 1))
        assert_sample_trace(receiver.wait_for_spans(2), TRACE_ID + 1)


def test_a_dead_exporter_only_costs_dropped_spans():
    """On the stock asyncio loop (the other tests use uvloop)."""

    async def scenario(receiver: OtlpHttpReceiver) -> dict:
        pipe = SpanExportPipe(make_config(otlp_endpoint=receiver.endpoint))
        await pipe.start()
        pipe.submit_now(sample_trace())
        await asyncio.to_thread(receiver.wait_for_spans, 2)
        os.kill(pipe.pid, signal.SIGKILL)
        for _ in range(100):
            if not pipe.stats["exporter_alive"]:
                break
            await asyncio.sleep(0.05)
        assert not pipe.stats["exporter_alive"]
        for _ in range(100):
            pipe.submit(sample_trace())
            pipe.submit_now(sample_trace())
        stats = pipe.stats
        started = time.monotonic()
        await pipe.stop(timeout=2.0)
        return stats | {"stop_took": time.monotonic() - started}

    with OtlpHttpReceiver() as receiver:
        stats = asyncio.run(scenario(receiver))
    assert stats["spans_dropped"] == 400 and stats["spans_submitted"] == 402
    assert stats["stop_took"] < 0.5


def test_killing_a_backed_up_exporter_loses_nothing_but_spans(loop_thread):
    with OtlpHttpReceiver(mode="black_hole") as receiver:
        pipe = SpanExportPipe(make_config(otlp_endpoint=receiver.endpoint, **FLOOD_CONFIG))
        loop_thread.run(pipe.start())
        loop_thread.run(flood(pipe, seconds=0.5))
        os.kill(pipe.pid, signal.SIGKILL)
        assert wait_until(lambda: not stats_of(loop_thread, pipe)["exporter_alive"])
        before = stats_of(loop_thread, pipe)
        worst = loop_thread.run(flood(pipe, seconds=0.5))
        after = stats_of(loop_thread, pipe)
        loop_thread.run(pipe.stop(timeout=2.0))

    assert worst["lag"] < LAG_BOUND, worst
    # Whatever was queued when it died, and everything submitted since, is dropped.
    dropped, submitted = (after[key] - before[key] for key in ("spans_dropped", "spans_submitted"))
    assert dropped == submitted + before["spans_queued"] - after["spans_queued"]
    assert after["spans_queued"] <= before["spans_queued"]


def test_a_span_that_cannot_be_encoded_is_dropped_not_raised(start_pipe, loop_thread, tmp_path):
    pipe = start_pipe(make_config("file", file_path=str(tmp_path / "spans.jsonl")))
    poisoned = sample_trace()[0]._replace(attributes={"callback": lambda: None})
    loop_thread.call(pipe.submit_now, [poisoned])
    loop_thread.call(pipe.submit_now, sample_trace())
    loop_thread.run(pipe.stop())
    stats = stats_of(loop_thread, pipe)
    assert (stats["spans_dropped"], stats["spans_exported"]) == (1, 2)


def _summary(**fields) -> RequestSummary:
    return _BARE_SUMMARY._replace(**fields)


_BARE_SUMMARY = RequestSummary(
    trace_id=TRACE_ID, span_id=7, parent_span_id=0, sampled=True, tracestate="", rejected_traceparent="",
    request_id="rid", method="POST", target="/v1/chat/completions", http_version="1.1", status=200,
    outcome="OK", error="", start_ns=1, end_ns=9, clock_offset_ns=10**18, marks=(1, 2, 3, 0, 5, 9),
    client_peer="127.0.0.1:5", client_connection_id=3, sequence=1, idle_gap_ns=-1, user_agent="ua",
    server=("127.0.0.1", 80), upstream=("127.0.0.1", 81), request_body_bytes=0, response_body_bytes=0,
    chunks=0, max_chunk_gap_ns=0, request_body_head=b"", response_tail=b"", request_body_tail=b"", attempts=())


def test_kept_requests_bodies_send_their_batch_before_it_is_full(start_pipe, loop_thread, tmp_path):
    """The exporter holds a whole frame while it works through it: requests kept with
    their bodies' evidence (up to 24 KiB each) leave in frames of about 256 KiB, not
    in batches of batch_spans; small ones still wait for the batch or its timer."""
    from traceproxy.observe.export import BATCH_EVIDENCE_BYTES

    pipe = start_pipe(make_config("file", file_path=str(tmp_path / "spans.jsonl"), batch_spans=512,
                                  flush_interval=60.0))
    loop_thread.call(pipe.submit, [_summary()] * 6)
    assert stats_of(loop_thread, pipe)["spans_queued"] == 6  # small requests: batched on
    big = _summary(request_body_head=b"h" * 8192, response_tail=b"t" * 12288, request_body_tail=b"r" * 4096)
    needed = -(-BATCH_EVIDENCE_BYTES // (8192 + 12288 + 4096))
    loop_thread.call(pipe.submit, [big] * (needed - 1))
    assert stats_of(loop_thread, pipe)["spans_queued"] == 6 + needed - 1
    loop_thread.call(pipe.submit, [big])  # this one reaches the bound: the batch goes, long before its timer
    assert wait_until(lambda: stats_of(loop_thread, pipe)["spans_queued"] == 0, timeout=10)
    assert stats_of(loop_thread, pipe)["spans_dropped"] == 0


def test_access_log_lines_leave_with_the_batch_and_count_toward_it(start_pipe, loop_thread, tmp_path):
    """Lines the proxy made reach the access log as they were, beside the spans of the
    same batch; a batch of lines is sent when full, long before its timer."""
    log_path, spans_path = tmp_path / "access.log", tmp_path / "spans.jsonl"
    pipe = start_pipe(make_config("file", file_path=str(spans_path), access_log_path=str(log_path),
                                  batch_spans=4, flush_interval=60.0))
    loop_thread.call(pipe.submit, sample_trace())
    loop_thread.call(pipe.submit_line, b'{"n":1}')
    assert stats_of(loop_thread, pipe)["spans_queued"] == 3  # two spans and a line: the batch waits
    loop_thread.call(pipe.submit_line, '{"n":"\u00e9"}'.encode())  # the fourth item fills it
    assert wait_until(lambda: log_path.exists() and log_path.read_bytes().count(b"\n") == 2, timeout=10)
    assert log_path.read_bytes() == b'{"n":1}\n{"n":"\xc3\xa9"}\n'
    assert wait_until(lambda: spans_path.exists() and spans_path.read_text().endswith("\n"), timeout=10)
    assert_sample_trace(flatten(otlp_json_to_request(spans_path.read_text())))  # the same frame's spans
    stats = stats_of(loop_thread, pipe)
    assert stats["spans_dropped"] == 0 and stats["access_log_lines_lost"] == 0


def test_lines_for_a_dead_exporter_are_counted_as_lost_lines_not_spans(start_pipe, loop_thread, tmp_path):
    pipe = start_pipe(make_config("off", access_log_path=str(tmp_path / "access.log")))
    os.kill(pipe.pid, signal.SIGKILL)
    assert wait_until(lambda: not stats_of(loop_thread, pipe)["exporter_alive"], timeout=10)
    for n in range(10):
        loop_thread.call(pipe.submit_line, b'{"n":%d}' % n)
    loop_thread.call(pipe._flush)
    stats = stats_of(loop_thread, pipe)
    assert stats["access_log_lines_lost"] == 10 and stats["spans_dropped"] == 0


def test_frames_carry_spans_and_request_summaries_unchanged():
    summary = RequestSummary(
        trace_id=TRACE_ID, span_id=7, parent_span_id=0, sampled=True, tracestate="a=1", rejected_traceparent="",
        request_id="rid", method="POST", target="/generate", http_version="1.1", status=200, outcome="OK",
        error="", start_ns=1, end_ns=9, clock_offset_ns=10**18, marks=(1, 2, 3, 0, 5, 9), client_peer="127.0.0.1:5",
        client_connection_id=3, sequence=2, idle_gap_ns=-1, user_agent="ua", server=("127.0.0.1", 80),
        upstream=("127.0.0.1", 81), request_body_bytes=4, response_body_bytes=5, chunks=1, max_chunk_gap_ns=0,
        request_body_head=b'{"x":1}', response_tail=b"\x00\xff", request_body_tail=b"", stalls=(("FBS", "first_byte", 1, 2, 0),),
        attempts=(AttemptSummary(11, 0, 4, True, 100, 3, (0, 2, 2, 2, 3, 4, 5, 6), "", ""),),
    )
    items = [summary, *sample_trace(), AccessLines(b'{"a":1}\n{"b":2}\n', 2)]
    payload = encode_frame(items)[FRAME_HEADER.size:]
    decoded = decode_frame(payload)
    assert decoded == items
    assert [type(item) for item in decoded] == [RequestSummary, SpanData, SpanData, AccessLines]
    assert type(decoded[0].attempts[0]) is AttemptSummary


# ---------------------------------------------------------------- the child alone
def test_child_drains_on_eof_and_ignores_sigint(tmp_path):
    path = tmp_path / "spans.jsonl"
    stats_read, stats_write = os.pipe()
    config = make_config("file", file_path=str(path)).to_json()
    child = subprocess.Popen(
        [sys.executable, "-m", "traceproxy.observe.exporter_main", config, str(stats_write)],
        stdin=subprocess.PIPE, pass_fds=(stats_write,),
    )
    os.close(stats_write)
    try:
        child.stdin.write(encode_frame(sample_trace()))
        child.stdin.flush()
        assert wait_until(lambda: path.exists() and path.read_text().endswith("\n"))
        child.send_signal(signal.SIGINT)  # Ctrl-C reaches the whole process group
        child.stdin.write(encode_frame(sample_trace(TRACE_ID + 1)))
        child.stdin.close()
        assert child.wait(timeout=10) == 0
    finally:
        child.kill()
    with os.fdopen(stats_read, "rb") as stats:
        last = stats.read().splitlines()[-1]
    assert parse_stats_line(last) == {"exported": 4, "failed": 0, "access_log_lost": 0}
    assert len(path.read_text().splitlines()) == 2


def test_config_rejects_what_the_child_could_not_run():
    with pytest.raises(ValueError):
        make_config(otlp_protocol="http/json")
    with pytest.raises(ValueError):
        make_config("file")
    with pytest.raises(ValueError):
        replace(make_config(), queue_spans=0)


def test_a_queue_smaller_than_a_batch_still_sends(start_pipe, loop_thread, tmp_path):
    path = tmp_path / "spans.jsonl"
    pipe = start_pipe(make_config("file", file_path=str(path), queue_spans=2, batch_spans=512, flush_interval=60.0))
    loop_thread.call(pipe.submit, sample_trace())  # a full batch of 2: sent without waiting for the timer
    # Well before the flush timer: only a batch cut at the queue's size gets there.
    assert wait_until(lambda: path.exists() and path.read_text().endswith("\n"), timeout=10)


def test_a_failed_file_write_leaves_whole_lines_and_the_next_batch_its_own(tmp_path):
    # A full disk takes half a line: it must be cut off, not left for the next batch
    # to be glued onto (a line that no OTLP/JSON reader can parse).
    import errno

    from traceproxy.observe.export_sinks import FileSink
    from traceproxy.observe.otlp_json import OtlpJsonEncoder

    path = tmp_path / "spans.jsonl"
    sink = FileSink(path, OtlpJsonEncoder({"service.name": "t"}, "traceproxy", "0"))
    real = sink._lines._file

    class FullOnce:
        calls = 0

        def fileno(self):
            return real.fileno()

        def write(self, data):
            FullOnce.calls += 1
            if FullOnce.calls == 1:
                real.write(bytes(data[: len(data) // 2]))
                raise OSError(errno.ENOSPC, "No space left on device")
            return real.write(data)

        def close(self):
            real.close()

    sink._lines._file = FullOnce()
    assert sink.export(sample_trace()) is False
    assert sink.export(sample_trace()) is True
    sink.shutdown()
    lines = path.read_text().splitlines()
    assert len(lines) == 1 and len(json.loads(lines[0])["resourceSpans"][0]["scopeSpans"][0]["spans"]) == 2


def test_export_errors_are_logged_once_per_episode():
    import logging

    from traceproxy.observe.exporter_main import EXPORT_LOGGER, FailureEpisode

    episode = FailureEpisode()

    def record(name, level=logging.ERROR):
        return logging.LogRecord(name, level, __file__, 1, "failed", None, None)

    assert episode.filter(record(EXPORT_LOGGER)) is True  # the first failure is logged
    assert episode.filter(record(EXPORT_LOGGER)) is False  # the repeats are not
    assert episode.filter(record(EXPORT_LOGGER, logging.WARNING)) is False
    assert episode.filter(record("traceproxy.exporter")) is True  # other trouble is not this episode's
    assert episode.filter(record(EXPORT_LOGGER, logging.INFO)) is True
    episode.delivered()  # a batch got through: the next failure is news again
    assert episode.filter(record(EXPORT_LOGGER)) is True


@pytest.mark.parametrize("overrides, key", [
    ({"tracing.exporter": "file", "tracing.file_path": "/proc/no-such-dir/spans.jsonl", "access_log.path": ""},
     "tracing.file_path"),
    ({"tracing.exporter": "off", "access_log.path": "/proc/no-such-dir/access.log"}, "access_log.path"),
])
def test_a_span_file_or_access_log_that_cannot_be_written_is_a_startup_error(overrides, key):
    # Not an exporter process that dies after startup, taking the access log with it.
    from traceproxy.app import tracing_export_config
    from traceproxy.config import ConfigError, default_settings

    settings = default_settings().replace(**{"upstream": "http://127.0.0.1:9", **overrides})
    with pytest.raises(ConfigError, match=f"{re.escape(key)} = .*cannot be made .*expected the path of a file"):
        tracing_export_config(settings, environ={})


def test_a_log_path_under_a_file_says_so(tmp_path):
    from traceproxy.app import tracing_export_config
    from traceproxy.config import ConfigError, default_settings

    (tmp_path / "afile").write_text("")
    settings = default_settings().replace(**{"upstream": "http://127.0.0.1:9", "tracing.exporter": "off",
                                             "access_log.path": str(tmp_path / "afile" / "access.log")})
    with pytest.raises(ConfigError, match="access_log.path = .*a part of it is a file, not a folder"):
        tracing_export_config(settings, environ={})
    settings = settings.replace(**{"access_log.path": str(tmp_path)})  # a folder, not a file
    with pytest.raises(ConfigError, match="access_log.path = .*cannot append to it .*expected the path of a file"):
        tracing_export_config(settings, environ={})


def test_serve_names_the_span_file_key_and_exits_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "traceproxy", "serve", "--listen", "127.0.0.1:0", "--upstream",
                           "http://127.0.0.1:9", "--admin", "off", "--tracing-exporter", "file",
                           "--tracing-file-path", "/proc/no-such-dir/spans.jsonl"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2 and "tracing.file_path" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("endpoint", ["127.0.0.1:4318", "collector:4318", "unix:///run/otel.sock"])
def test_http_protobuf_to_an_endpoint_that_is_not_a_url_is_a_startup_error(endpoint):
    # Valid for gRPC; over http/protobuf every export would fail later.
    from traceproxy.app import tracing_export_config
    from traceproxy.config import ConfigError, default_settings

    settings = default_settings().replace(**{"upstream": "http://127.0.0.1:9", "tracing.exporter": "otlp",
                                             "tracing.otlp_endpoint": endpoint})
    with pytest.raises(ConfigError, match=f"tracing.otlp_endpoint = '{re.escape(endpoint)}' \\(from replace\\(\\)\\): "
                                          ".*http:// or https://"):
        tracing_export_config(settings, environ={})
    grpc = tracing_export_config(settings.replace(**{"tracing.otlp_protocol": "grpc"}), environ={})
    assert grpc.otlp_endpoint == endpoint and grpc.otlp_protocol == "grpc"
    from_env = default_settings().replace(**{"upstream": "http://127.0.0.1:9", "tracing.exporter": "otlp"})
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_ENDPOINT = .*http:// or https://"):
        tracing_export_config(from_env, environ={"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint})
    url = tracing_export_config(settings.replace(**{"tracing.otlp_endpoint": "http://127.0.0.1:4318"}), environ={})
    assert url.otlp_protocol == "http/protobuf"


def test_shutdown_gives_a_stuck_exporter_only_the_stop_deadline_it_is_passed(loop_thread, fast_upstream, tmp_path):
    """The caller chooses how long the exporter may take to stop (5 s unless told): a
    test or an embedding application with a short shutdown is not held by an exporter
    that cannot read (stopped here), which is told to stop, then killed, within it."""
    from traceproxy.app import EXPORTER_STOP_TIMEOUT, ProxyServer
    from traceproxy.config import default_settings

    upstream = fast_upstream()
    settings = default_settings().replace(**{
        "listen": "127.0.0.1:0", "admin": "off", "upstream": upstream.url, "tracing.exporter": "file",
        "tracing.file_path": str(tmp_path / "spans.jsonl"), "access_log.path": ""})
    server = ProxyServer(settings)
    loop_thread.run(server.start())
    pid = server.span_export.pid
    os.kill(pid, signal.SIGSTOP)  # it can neither read its pipe nor see EOF
    try:
        # Well below the default, which would hold shutdown 5 s.
        loop_thread.run(asyncio.wait_for(server.shutdown(grace=0, exporter_stop=0.3), EXPORTER_STOP_TIMEOUT - 1))
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert server.span_export.stats["exporter_alive"] is False
    assert server.span_export._process.returncode == -signal.SIGKILL


def test_the_exporter_trims_its_heap_only_between_frames(tmp_path):
    # A frame whose export takes seconds (a slow collector) is work under way: the stats
    # thread's tick, once a second, must not trim then, only once the frame is done.
    import io
    import threading

    from traceproxy.allocator import IdleHeapTrim
    from traceproxy.observe.exporter_main import Counters, StatsReporter, pump
    from traceproxy.observe.export_wire import encode_frame

    release, exporting, trims = threading.Event(), threading.Event(), []

    class SlowSink:
        def export(self, spans):
            exporting.set()
            return release.wait(10)

    read_fd, write_fd = os.pipe()
    counters = Counters()
    reporter = StatsReporter(write_fd, counters)
    reporter._heap_trim = IdleHeapTrim(lambda: trims.append(1), lambda: 64 << 20)
    stream = io.BytesIO(encode_frame(sample_trace()))
    pumping = threading.Thread(target=pump, args=(stream, SlowSink(), counters))
    try:
        reporter.tick()  # the process starts
        pumping.start()
        assert exporting.wait(10)
        for _ in range(3):  # three quiet seconds of the stats thread, the export still going
            reporter.tick()
        assert trims == []
        release.set()
        pumping.join(10)
        reporter.tick()  # the frame was done since the last tick: not quiet yet
        reporter.tick()
        assert trims == [1]
    finally:
        release.set()
        pumping.join(10)
        os.close(read_fd)
        os.close(write_fd)
