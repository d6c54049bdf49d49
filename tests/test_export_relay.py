"""An engine's export request through the exporter process as it came (``SpanExportPipe.submit_raw``):
to a collector byte for byte, to the span file as its OTLP/JSON line, counted as its spans,
bounded by the same queue as the proxy's own spans."""

from __future__ import annotations

import json
import os

import pytest

from traceproxy.observe import export
from traceproxy.observe.export import ExportConfig
from traceproxy.observe.export_wire import FRAME_HEADER, RawSpans, decode_frame, flatten_raw, frame

from .otlp_receiver import OtlpGrpcReceiver, OtlpHttpReceiver
from .sglang_spans import Request, payload, random_trace_id
from .support import start_pipe, wait_until  # noqa: F401  (start_pipe: a fixture)


@pytest.fixture(autouse=True)
def no_otel_environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)


def config(exporter: str, **overrides) -> ExportConfig:
    return ExportConfig(**{"exporter": exporter, "otlp_endpoint": "", "otlp_protocol": "http/protobuf",
                           "file_path": "", "service_name": "traceproxy", **overrides})


def test_a_raw_item_crosses_the_pipe_as_it_is():
    raw = RawSpans(b"\x0a\x00\xff", 3)
    [back] = decode_frame(frame([flatten_raw(raw)])[0][FRAME_HEADER.size:])
    assert back == raw and isinstance(back, RawSpans)


@pytest.mark.parametrize("receiver_kind, protocol", [(OtlpHttpReceiver, "http/protobuf"), (OtlpGrpcReceiver, "grpc")])
def test_a_relayed_request_reaches_the_collector_byte_for_byte(start_pipe, loop_thread, receiver_kind, protocol):
    trace_id = random_trace_id()
    body = payload(Request(trace_id, "prefill").stages(3))
    with receiver_kind() as collector:
        pipe = start_pipe(config("otlp", otlp_endpoint=collector.endpoint, otlp_protocol=protocol))
        assert loop_thread.call(lambda: pipe.submit_raw(RawSpans(body, 3)))
        received = collector.wait_for_spans(3)
        assert {s.trace_id for s in received} == {"%032x" % trace_id}
        assert wait_until(lambda: loop_thread.call(lambda: pipe.stats)["spans_exported"] == 3)
        assert loop_thread.call(lambda: pipe.stats)["spans_submitted"] == 3


def test_a_relayed_request_is_a_line_of_the_span_file(start_pipe, loop_thread, tmp_path):
    path = tmp_path / "spans.jsonl"
    trace_id = random_trace_id()
    pipe = start_pipe(config("file", file_path=str(path)))
    assert loop_thread.call(lambda: pipe.submit_raw(RawSpans(payload(Request(trace_id, "decode").stages(2)), 2)))
    loop_thread.run(pipe.stop(timeout=2.0))
    [line] = path.read_text().splitlines()
    spans = json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert [s["name"] for s in spans] == ["decode_prepare", "decode_bootstrap"]
    assert spans[0]["traceId"] == "%032x" % trace_id


def test_relayed_spans_count_against_the_queue(start_pipe, loop_thread):
    pipe = start_pipe(config("file", file_path=os.devnull, queue_spans=64))
    # A request of more spans than the queue holds is dropped whole, and counted as its spans.
    assert not loop_thread.call(lambda: pipe.submit_raw(RawSpans(b"", 65)))
    assert loop_thread.call(lambda: pipe.stats)["spans_dropped"] == 65


def test_with_spans_off_nothing_is_relayed(start_pipe, loop_thread, tmp_path):
    pipe = start_pipe(config("off", access_log_path=str(tmp_path / "access.log")))
    assert not loop_thread.call(lambda: pipe.submit_raw(RawSpans(b"\x0a\x00", 1)))
    assert loop_thread.call(lambda: pipe.stats)["spans_submitted"] == 0


def test_the_access_log_ignores_relayed_requests(start_pipe, loop_thread, tmp_path):
    log_path = tmp_path / "access.log"
    pipe = start_pipe(config("file", file_path=os.devnull, access_log_path=str(log_path)))
    assert loop_thread.call(lambda: pipe.submit_raw(RawSpans(payload(Request(1, "decode").stages(1)), 1)))
    loop_thread.run(pipe.stop(timeout=2.0))
    assert not log_path.exists() or log_path.read_text() == ""


# ---------------------------------------------------------------- several requests at once
def frames_written(monkeypatch) -> list[int]:
    """How many requests each frame of relays held, as the pipe writes them."""
    sizes = []

    def counting_frame(flat_items):
        sizes.append(len(flat_items))
        return frame(flat_items)

    monkeypatch.setattr(export, "frame", counting_frame)
    return sizes


def test_several_relayed_requests_are_lines_of_the_span_file_written_in_one_frame(
        start_pipe, loop_thread, tmp_path, monkeypatch):
    path = tmp_path / "spans.jsonl"
    pipe = start_pipe(config("file", file_path=str(path)))
    sizes = frames_written(monkeypatch)
    requests = [Request(random_trace_id(), "decode") for _ in range(3)]
    raws = [RawSpans(payload(request.stages(count)), count) for request, count in zip(requests, (1, 2, 3))]
    assert loop_thread.call(lambda: pipe.submit_raw_many(raws)) == [True, True, True]
    assert sizes == [3]
    loop_thread.run(pipe.stop(timeout=2.0))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [len(line["resourceSpans"][0]["scopeSpans"][0]["spans"]) for line in lines] == [1, 2, 3]
    assert [line["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"] for line in lines] == \
        [request.trace_id.hex() for request in requests]
    assert loop_thread.call(lambda: pipe.stats)["spans_submitted"] == 6


def test_each_of_several_relayed_requests_is_bounded_by_the_queue_on_its_own(start_pipe, loop_thread):
    pipe = start_pipe(config("file", file_path=os.devnull, queue_spans=64))
    raws = [RawSpans(payload(Request(1, "decode").stages(1)), count) for count in (30, 40, 34)]
    # 30 fits, 30 + 40 does not, 30 + 34 does.
    assert loop_thread.call(lambda: pipe.submit_raw_many(raws)) == [True, False, True]
    stats = loop_thread.call(lambda: pipe.stats)
    assert stats["spans_submitted"] == 104 and stats["spans_dropped"] == 40


def test_relayed_requests_past_the_frame_size_go_in_frames_of_their_own(
        start_pipe, loop_thread, tmp_path, monkeypatch):
    path = tmp_path / "spans.jsonl"
    pipe = start_pipe(config("file", file_path=str(path)))
    body = payload(Request(random_trace_id(), "prefill").stages(2))
    monkeypatch.setattr(export, "RAW_FRAME_BYTES", len(body) * 2)
    sizes = frames_written(monkeypatch)
    assert loop_thread.call(lambda: pipe.submit_raw_many([RawSpans(body, 2)] * 5)) == [True] * 5
    assert sizes == [2, 2, 1]
    loop_thread.run(pipe.stop(timeout=2.0))
    assert len(path.read_text().splitlines()) == 5


def test_with_spans_off_several_requests_are_not_relayed(start_pipe, loop_thread, tmp_path):
    pipe = start_pipe(config("off", access_log_path=str(tmp_path / "access.log")))
    assert loop_thread.call(lambda: pipe.submit_raw_many([RawSpans(b"\x0a\x00", 1)] * 2)) == [False, False]
    assert loop_thread.call(lambda: pipe.stats)["spans_submitted"] == 0
