"""The engines' spans read back and kept per trace (``otlp_reader``, ``engine_spans``), what a
worker of several keeps of them (``engine_join.StageFacts``), and the span file's line of a
relayed request (``otlp_relay``). No network: bytes in, stages out."""

from __future__ import annotations

import json

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from traceproxy.diagnose import otlp_spans
from traceproxy.observe.engine_join import StageFacts, stage_message
from traceproxy.observe.engine_spans import GRACE_NS, EngineSpanStore, read_engine_request
from traceproxy.observe.otlp_reader import MalformedOtlp, read_export_request
from traceproxy.observe.otlp_relay import json_line

from .sglang_spans import HOST_ID, Request, export_request, payload, random_trace_id

PEER = "ipv4:127.0.0.1:5555"
S = 1_000_000_000


def store_with(*span_lists, max_traces: int = 100, peer: str = PEER, now: int = 0, **resource) -> EngineSpanStore:
    store = EngineSpanStore(max_traces)
    for spans in span_lists:
        store.add(read_engine_request(payload(spans, **resource)), peer, now)
    return store


# ----------------------------------------------------------------------------------
# reading the wire format
# ----------------------------------------------------------------------------------
def test_the_reader_keeps_ids_names_times_and_sglangs_attributes():
    trace_id = random_trace_id()
    request = Request(trace_id, "prefill", pid=77, parent=b"\x01" * 8)
    spans = request.stages(2) + request.finish()
    [batch] = read_export_request(payload(spans, **{"host.name": "node-3", "process.pid": 9}))
    assert batch.resource == {"service.name": "sglang", "host.name": "node-3", "process.pid": 9}
    assert [s.name for s in batch.spans] == [s.name for s in spans]
    for read, sent in zip(batch.spans, spans):
        assert (read.trace_id, read.span_id, read.parent_span_id) == (
            trace_id, int.from_bytes(sent.span_id, "big"), int.from_bytes(sent.parent_span_id, "big"))
        assert (read.start_ns, read.end_ns) == (sent.start_time_unix_nano, sent.end_time_unix_nano)
    thread, req, room = batch.spans[2:]
    assert thread.attributes == {"tp_rank": 0, "host_id": HOST_ID, "pid": 77, "thread_label": "Prefill Scheduler"}
    assert req.attributes == {"rid": "a1b2c3d4e5f6"} and room.attributes == {"bootstrap_room": "0x7"}
    assert room.parent_span_id == int.from_bytes(b"\x01" * 8, "big")


@pytest.mark.parametrize("body", [
    b"\x0a\xff\xff\xff\xff\x0f",  # a length far past the end
    b"\x0a\x05\x12\x03\x12",  # a nested field cut short
    b"\xff" * 11,  # a varint that never ends
    payload([Request(1, "prefill").stages(1)[0]])[:-3],  # a whole request cut short
], ids=["length-past-end", "cut-nested", "endless-varint", "truncated"])
def test_bytes_that_are_not_a_request_are_malformed(body):
    with pytest.raises(MalformedOtlp):
        read_export_request(body)


def test_a_span_with_ids_of_the_wrong_size_is_malformed():
    request = export_request(Request(1, "prefill").stages(1))
    request.resource_spans[0].scope_spans[0].spans[0].trace_id = b"\x01" * 8  # a 64-bit id, unpadded
    with pytest.raises(MalformedOtlp, match="trace_id of 8 bytes"):
        read_export_request(request.SerializeToString())


def test_an_empty_request_has_no_spans():
    assert read_export_request(b"") == [] and read_engine_request(b"") == []


def test_the_receivers_reader_leaves_the_store_as_reading_every_span_does():
    """It builds facts only for the spans the store reads (of the nested stages, the last
    of each trace): the stages, the counts and the learned workers come out the same."""
    done, hung, decoding = random_trace_id(), random_trace_id(), random_trace_id()
    finished, stuck, dec = Request(done, "prefill"), Request(hung, "prefill", pid=7), Request(decoding, "decode")
    other = Request(done, "prefill")._span("POST /v1/chat/completions", b"")
    batches = [finished.stages(5) + finished.finish() + [other], stuck.stages(2) + dec.stages(4)]
    batches.append([dec.nested("fake_output"), dec.nested("decode_loop", decode_ct=0), *stuck.stages(3, start=2),
                    *(dec.nested("decode_loop", decode_ct=step) for step in (1, 2))])
    by_every_span, by_receiver = EngineSpanStore(100), EngineSpanStore(100)
    for spans in batches:
        by_every_span.add(read_export_request(payload(spans)), PEER, 0)
        by_receiver.add(read_engine_request(payload(spans)), PEER, 0)
    for trace_id in (done, hung, decoding):
        assert by_receiver.stage_of(trace_id) == by_every_span.stage_of(trace_id) is not None
    assert by_receiver.stage_of(decoding).detail == "after decode_loop"
    assert by_receiver.numbers() == by_every_span.numbers()
    assert by_receiver.identities == by_every_span.identities


def test_a_nested_stage_span_with_ids_of_the_wrong_size_is_malformed_though_its_facts_are_not_read():
    dec = Request(1, "decode")
    request = export_request([dec.nested("decode_loop", decode_ct=0), dec.nested("decode_loop", decode_ct=1)])
    request.resource_spans[0].scope_spans[0].spans[0].span_id = b"\x01" * 4  # not its trace's last: no facts built
    with pytest.raises(MalformedOtlp, match="span_id of 4"):
        read_engine_request(request.SerializeToString())


# ----------------------------------------------------------------------------------
# the store: one trace's stages
# ----------------------------------------------------------------------------------
def test_stage_spans_name_the_stage_a_worker_is_in_before_its_thread_span_came():
    trace_id = random_trace_id()
    pre, dec = Request(trace_id, "prefill"), Request(trace_id, "decode")
    store = store_with(pre.stages(4), dec.stages(2))
    stage = store.stage_of(trace_id)
    assert (stage.component, stage.role, stage.stage, stage.state) == (
        "kv_transfer", "prefill", "prefill_transfer_kv_cache", "in")
    assert stage.worker.service == "sglang" and stage.worker.pid is None  # not known yet: no thread span
    assert stage.since_ns == pre.clock  # the end of its last stage


def test_a_thread_span_ends_a_worker_and_teaches_its_exporter_host_and_pid():
    first, second = random_trace_id(), random_trace_id()
    done = Request(first, "prefill", pid=31)
    store = store_with(done.stages(5) + done.finish())
    assert store.stage_of(first).state == "ended" and store.stage_of(first).worker.pid == 31
    hung = Request(second, "prefill")
    store.add(read_export_request(payload(hung.stages(3))), PEER, 0)
    assert store.stage_of(second).worker.pid == 31 and store.stage_of(second).worker.host == HOST_ID
    # Another exporter (a collector fanning in, another connection) is not taught by this one.
    third = random_trace_id()
    store.add(read_export_request(payload(Request(third, "prefill").stages(3))), "ipv4:127.0.0.1:6666", 0)
    assert store.stage_of(third).worker.pid is None


def test_two_workers_behind_one_exporter_teach_nothing():
    store = store_with(*(r.stages(5) + r.finish() for r in (Request(random_trace_id(), "decode", pid=1),
                                                             Request(random_trace_id(), "decode", pid=2))))
    hung = random_trace_id()
    store.add(read_export_request(payload(Request(hung, "decode").stages(2))), PEER, 0)
    assert store.stage_of(hung).worker.pid is None


def test_the_resource_names_a_worker_when_set():
    trace_id = random_trace_id()
    store = store_with(Request(trace_id, "decode").stages(2), **{"host.name": "gpu-7", "process.pid": 123})
    assert (store.stage_of(trace_id).worker.host, store.stage_of(trace_id).worker.pid) == ("gpu-7", 123)


def test_nested_stages_say_how_far_the_open_forward_got():
    trace_id = random_trace_id()
    dec = Request(trace_id, "decode")
    store = store_with(dec.stages(4), [dec.nested("fake_output"), dec.nested("decode_loop", decode_ct=0)])
    stage = store.stage_of(trace_id)
    assert (stage.stage, stage.detail) == ("decode_forward", "after decode_loop")
    assert len(store.traces[trace_id].workers) == 1  # put with the decode worker, not a worker of its own


def test_spans_of_other_shapes_are_not_kept():
    trace_id = random_trace_id()
    req = Request(trace_id, "prefill")
    store = store_with([req._span("POST /v1/chat/completions", b""), *req.finish()])  # no stage span first
    assert store.stage_of(trace_id) is None and not store.traces and not store.seen_engine_spans
    assert store.spans_received == 4


# ----------------------------------------------------------------------------------
# the store: bounds
# ----------------------------------------------------------------------------------
def test_a_flood_of_traces_keeps_the_store_bounded_and_work_stuck_at_the_engines_last():
    stuck = random_trace_id()
    store = store_with(Request(stuck, "prefill").stages(4), max_traces=50)
    for n in range(1000):  # healthy requests: their engines finish them
        done = Request(random_trace_id(), "decode")
        store.add(read_export_request(payload(done.stages(5) + done.finish())), PEER, n)
    assert len(store.traces) == 50 and store.stage_of(stuck) is not None
    assert store.traces_evicted == 1000 + 1 - 50 and store.spans_dropped == 0  # nothing lost: they were done
    # A flood of work that never finishes (spans for unknown traces): the oldest goes, and is counted.
    for n in range(1000):
        store.add(read_export_request(payload(Request(random_trace_id(), "decode").stages(2))), PEER, 2000 + n)
    assert len(store.traces) == 50 and store.stage_of(stuck) is None
    assert store.spans_dropped == 4 + 2 * (1000 - 50)  # the stuck trace's four, then each evicted one's two


def test_a_request_with_more_traces_than_room_leaves_the_store_bounded_and_sweepable():
    finished = [Request(random_trace_id(), "prefill") for _ in range(3)]
    store = store_with([span for request in finished for span in request.stages(5) + request.finish()],
                       max_traces=2)
    assert len(store.traces) == 2 and set(store._past) <= set(store.traces)
    store.sweep(GRACE_NS * 2)  # every trace it holds is past the engines and past the grace
    assert not store.traces


def test_a_trace_the_engines_finished_is_dropped_after_the_grace_an_open_one_is_not():
    done, hung = random_trace_id(), random_trace_id()
    finished = Request(done, "decode")
    store = store_with(finished.stages(5) + finished.finish(), Request(hung, "prefill").stages(4))
    store.sweep(GRACE_NS)
    assert done in store.traces
    store.sweep(GRACE_NS + 1)
    assert done not in store.traces and hung in store.traces
    assert [t for t, _ in store.open_traces()] == [hung]


def test_changes_are_taken_once_each():
    trace_id = random_trace_id()
    store = store_with(Request(trace_id, "prefill").stages(2))
    changes = store.take_changes()
    assert list(changes) == [trace_id] and store.take_changes() == {}


# ----------------------------------------------------------------------------------
# a worker of several: the stages of its own requests
# ----------------------------------------------------------------------------------
def test_a_worker_keeps_the_stages_of_its_requests_and_forgets_the_others():
    mine, other = random_trace_id(), random_trace_id()
    store = store_with(Request(mine, "prefill").stages(4), Request(other, "decode").stages(2))
    facts = StageFacts(max_traces=10)
    facts.claim([mine], 0)
    facts.update(stage_message(store.take_changes(), store.seen_engine_spans), 0)
    assert facts.stage_of(mine) == store.stage_of(mine) and facts.seen_engine_spans
    assert facts.stage_of(other) is not None  # not placed yet: kept a moment (its request may be this worker's)
    facts.claim([mine], 3 * S)
    assert facts.stage_of(other) is None and facts.stage_of(mine) is not None
    facts.update({"stages": [(mine, None)], "seen": True}, 3 * S)  # dropped by the parent
    assert facts.stage_of(mine) is None


# ----------------------------------------------------------------------------------
# the span file's line of a relayed request
# ----------------------------------------------------------------------------------
def test_a_relayed_request_is_one_otlp_json_line_with_hex_ids():
    trace_id = random_trace_id()
    req = Request(trace_id, "decode", parent=b"\x02" * 8)
    sent = export_request(req.stages(2) + req.finish())
    line = json_line(sent.SerializeToString())
    document = json.loads(line)
    spans = list(otlp_spans(document))
    assert [s.name for s in spans] == [s.name for s in sent.resource_spans[0].scope_spans[0].spans]
    assert {s.trace_id for s in spans} == {"%032x" % trace_id} and spans[-1].parent_id == "02" * 8
    assert spans[2].attributes["pid"] == 4242 and spans[0].service == "sglang"
    raw = document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert raw["kind"] == 1 and raw["startTimeUnixNano"] == str(sent.resource_spans[0].scope_spans[0].spans[0]
                                                                .start_time_unix_nano)
    assert "\n" not in line
    # What the line says is what was sent: read back through protobuf's JSON mapping, the same request.
    assert ExportTraceServiceRequest.FromString(sent.SerializeToString()) == sent


@pytest.mark.parametrize("role, nested", [("decode", ("fake_output", "decode_loop")), ("prefill", ("chunked_prefill",))])
def test_a_request_finished_in_one_batch_with_its_nested_stages_is_not_work_at_the_engines(role, nested):
    # An exporter's batch often holds a worker's last nested stages (decode_loop, ...)
    # and its thread span together: the worker finished the request, so nothing is
    # held there, and no worker of another role appears out of the nested spans.
    trace_id = random_trace_id()
    request = Request(trace_id, role)
    store = store_with(request.stages(5) + [request.nested(name) for name in nested] + request.finish())
    assert store.open_traces() == []
    assert store.stage_of(trace_id).state == "ended"
    assert len(store.traces[trace_id].workers) == 1
