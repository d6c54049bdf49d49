"""The engine span receivers on a running proxy: OTLP/HTTP and OTLP/gRPC in, bad bodies
refused and counted, every request relayed unchanged to the proxy's span destination,
memory bounded under a flood, loopback only unless allowed."""

from __future__ import annotations

import gzip
import json
import urllib.error
import urllib.request

import grpc
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from traceproxy.config import ConfigError, default_settings
from traceproxy.diagnose import file_spans
from traceproxy.engine_wiring import check_receiver_exposure
from traceproxy.observe.engine_receiver import MAX_BODY_BYTES

from .otlp_receiver import OtlpGrpcReceiver, OtlpHttpReceiver
from .sglang_spans import Request, export_request, payload, random_trace_id
from .support import RawClient, admin_get, wait_until

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
PROTOBUF = [("Content-Type", "application/x-protobuf")]
RECEIVERS = {"engines.otlp_receiver": "127.0.0.1:0", "engines.otlp_receiver_grpc": "127.0.0.1:0"}


@pytest.fixture
def proxy(start_proxy, fast_upstream):
    return start_proxy(fast_upstream().url, **RECEIVERS)


def receiver(proxy):
    return proxy.engine_side.receiver


def stage_of(proxy, trace_id: int):
    """The stage the proxy holds for a trace, once the receiver's process has sent it (a trace
    no request here has is kept a moment only: wait for it)."""
    facts = proxy.engine_side.readings.stage_facts
    wait_until(lambda: facts.stage_of(trace_id) is not None, timeout=5)
    return facts.stage_of(trace_id)


def counted(proxy, key: str, value) -> bool:
    """The receiver's process reports its counts every second: wait for one to say ``value``."""
    return wait_until(lambda: engine_spans(proxy).get(key) == value, timeout=5)


def post(proxy, body: bytes, headers=PROTOBUF) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{receiver(proxy).http_port}/v1/traces", data=body,
                                     method="POST", headers=dict(headers))
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=5) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def grpc_export(proxy, body: bytes) -> bytes:
    with grpc.insecure_channel(f"127.0.0.1:{receiver(proxy).grpc_port}",
                               options=[("grpc.max_send_message_length", 3 * MAX_BODY_BYTES)]) as channel:
        return channel.unary_unary(EXPORT)(body, timeout=5)


def engine_spans(proxy) -> dict:
    return json.loads(admin_get(proxy, "/debug/inflight"))["engine_spans"]


def test_both_receivers_take_sglangs_spans(proxy):
    http_trace, grpc_trace = random_trace_id(), random_trace_id()
    assert post(proxy, payload(Request(http_trace, "prefill").stages(2))) == (200, b"")
    assert grpc_export(proxy, payload(Request(grpc_trace, "decode").stages(3))) == b""
    assert stage_of(proxy, http_trace).stage == "prefill_waiting"
    assert stage_of(proxy, grpc_trace).stage == "decode_waiting"
    assert counted(proxy, "spans_received", 5)
    counts = engine_spans(proxy)
    assert (counts["requests"], counts["traces"]) == (2, 2)


def test_a_gzipped_body_is_taken(proxy):
    trace_id = random_trace_id()
    status, _ = post(proxy, gzip.compress(payload(Request(trace_id, "prefill").stages(1))),
                     [*PROTOBUF, ("Content-Encoding", "gzip")])
    assert status == 200 and stage_of(proxy, trace_id) is not None


@pytest.mark.parametrize("body, headers, status, reason, words", [
    (b"\x0a\xff\xff\xff\x0f", PROTOBUF, 400, "malformed", b"not an OTLP ExportTraceServiceRequest"),
    (b"{}", [("Content-Type", "application/json")], 415, "unsupported_media_type", b"application/x-protobuf only"),
    (b"x" * (MAX_BODY_BYTES + 1), PROTOBUF, 413, "too_large", b"over 4194304"),
    (gzip.compress(b"\x00" * (MAX_BODY_BYTES + 1)), [*PROTOBUF, ("Content-Encoding", "gzip")], 413, "too_large",
     b"after content decoding"),
    (b"not gzip", [*PROTOBUF, ("Content-Encoding", "gzip")], 400, "malformed", b"cannot be read"),
], ids=["malformed", "json", "oversized", "gzip-bomb", "bad-gzip"])
def test_bad_http_bodies_are_refused_with_a_reason_and_counted(proxy, fast_upstream, body, headers, status, reason,
                                                               words):
    answer = post(proxy, body, headers)
    assert answer[0] == status and words in answer[1]  # a google.rpc.Status: its message is readable bytes
    assert wait_until(lambda: engine_spans(proxy).get("rejected", {}).get(reason) == 1, timeout=5)
    assert engine_spans(proxy)["requests"] == 0
    assert post(proxy, payload(Request(random_trace_id(), "prefill").stages(1)))[0] == 200  # still serving


@pytest.mark.parametrize("body, code, reason", [
    (b"\x0a\xff\xff\xff\x0f", grpc.StatusCode.INVALID_ARGUMENT, "malformed"),
    (b"\x0a" * (MAX_BODY_BYTES + 10), grpc.StatusCode.RESOURCE_EXHAUSTED, "too_large"),
], ids=["malformed", "oversized"])
def test_bad_grpc_requests_are_refused_and_counted(proxy, body, code, reason):
    with pytest.raises(grpc.RpcError) as refused:
        grpc_export(proxy, body)
    assert refused.value.code() == code
    assert wait_until(lambda: engine_spans(proxy).get("rejected", {}).get(reason) == 1, timeout=5)
    assert grpc_export(proxy, payload(Request(random_trace_id(), "decode").stages(1))) == b""


def test_a_flood_of_spans_for_unknown_traces_keeps_the_receiver_bounded(start_proxy, fast_upstream):
    proxy = start_proxy(fast_upstream().url, **RECEIVERS, **{"engines.span_traces": 16})
    for _ in range(40):
        spans = [span for _ in range(25) for span in Request(random_trace_id(), "decode").stages(2)]
        assert grpc_export(proxy, payload(spans)) == b""
    assert counted(proxy, "spans_received", 2000)
    counts = engine_spans(proxy)
    assert counts["traces"] == 16 and counts["traces_evicted"] == 1000 - 16


# ----------------------------------------------------------------------------------
# the relay: to the collector as it came, or to the span file
# ----------------------------------------------------------------------------------
def span_with_unknown_field(trace_id: int) -> tuple[Span, bytes]:
    """A stage span carrying a field OTLP does not define (number 99): a relay that decoded
    and encoded again would lose it."""
    [span] = Request(trace_id, "prefill").stages(1)
    raw = span.SerializeToString() + b"\x9a\x06\x05extra"  # field 99, length-delimited, "extra"
    return Span.FromString(raw), raw


@pytest.mark.parametrize("receiver_kind, protocol", [(OtlpGrpcReceiver, "grpc"), (OtlpHttpReceiver, "http/protobuf")],
                         ids=["to-grpc-collector", "to-http-collector"])
@pytest.mark.parametrize("sent_over", ["http", "grpc"])
def test_every_request_is_relayed_to_the_collector_unchanged(start_proxy, fast_upstream, receiver_kind, protocol,
                                                             sent_over):
    with receiver_kind() as collector:
        proxy = start_proxy(fast_upstream().url, **RECEIVERS, **{
            "tracing.exporter": "otlp", "tracing.otlp_endpoint": collector.endpoint, "tracing.otlp_protocol": protocol})
        trace_id = random_trace_id()
        span, raw = span_with_unknown_field(trace_id)
        others = Request(trace_id, "decode").stages(2)
        request = export_request([span, *others], **{"service.instance.id": "decode-0"})
        sent = request.SerializeToString()
        assert raw in sent
        if sent_over == "http":
            assert post(proxy, sent)[0] == 200
        else:
            grpc_export(proxy, sent)
        received = collector.wait_for_spans(3)
        assert [s.span.SerializeToString() for s in received] == [raw] + [s.SerializeToString() for s in others]
        assert received[0].resource == {"service.name": "sglang", "telemetry.sdk.language": "python",
                                        "service.instance.id": "decode-0"}
        assert received[0].scope_name == "sglang server"
        assert wait_until(lambda: engine_spans(proxy)["spans_relayed"] == 3)


def test_relayed_spans_land_in_the_span_file_and_diagnose_reads_them(start_proxy, fast_upstream, tmp_path,
                                                                     loop_thread):
    path = tmp_path / "spans.jsonl"
    proxy = start_proxy(fast_upstream().url, **RECEIVERS, **{"tracing.exporter": "file",
                                                            "tracing.file_path": str(path)})
    trace_id = random_trace_id()
    finished = Request(trace_id, "decode")
    grpc_export(proxy, payload(finished.stages(5) + finished.finish()))
    assert wait_until(lambda: engine_spans(proxy)["spans_relayed"] == 8)  # relays reach the proxy within 50 ms
    loop_thread.run(proxy.span_export.stop(timeout=5))  # the exporter writes what it holds, then ends
    spans = file_spans(path, "%032x" % trace_id)
    assert [s.name for s in spans][:5] == ["decode_prepare", "decode_bootstrap", "decode_transferred",
                                           "decode_waiting", "decode_forward"]
    assert {s.service for s in spans} == {"sglang"} and len(spans) == 8


def test_a_collector_that_fans_out_to_traceproxy_is_not_sent_the_spans_back(start_proxy, fast_upstream):
    with OtlpHttpReceiver() as collector:
        proxy = start_proxy(fast_upstream().url, **RECEIVERS, **{
            "tracing.exporter": "otlp", "tracing.otlp_endpoint": collector.endpoint,
            "tracing.otlp_protocol": "http/protobuf", "engines.otlp_receiver_relay": False})
        trace_id = random_trace_id()
        assert post(proxy, payload(Request(trace_id, "prefill").stages(2)))[0] == 200
        assert stage_of(proxy, trace_id) is not None  # kept for the join
        # The proxy's own spans still go out; the engines' do not come back.
        assert RawClient(proxy.port).roundtrip("GET", "/v1/models").status == 200
        assert wait_until(lambda: collector.spans())
        assert not collector.find(trace_id=trace_id) and engine_spans(proxy)["spans_relayed"] == 0


def test_without_a_span_destination_spans_are_kept_and_not_relayed(proxy):
    trace_id = random_trace_id()
    assert post(proxy, payload(Request(trace_id, "prefill").stages(1)))[0] == 200
    assert stage_of(proxy, trace_id) is not None and engine_spans(proxy)["spans_relayed"] == 0


# ----------------------------------------------------------------------------------
# loopback only, unless allowed
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["engines.otlp_receiver", "engines.otlp_receiver_grpc"])
def test_a_receiver_on_a_public_address_needs_otlp_receiver_public(key):
    settings = default_settings().replace(**{key: "0.0.0.0:4317"})
    with pytest.raises(ConfigError, match=rf"{key} = '0.0.0.0:4317' \(from replace\(\)\): 0.0.0.0 is not a loopback"):
        check_receiver_exposure(settings)
    check_receiver_exposure(settings.replace(**{"engines.otlp_receiver_public": True}))
    check_receiver_exposure(default_settings().replace(**{key: "[::1]:4317"}))


def test_the_receivers_are_off_by_default(start_proxy, fast_upstream):
    proxy = start_proxy(fast_upstream().url)
    assert proxy.engine_side is None
    assert "engine_spans" not in json.loads(admin_get(proxy, "/debug/inflight"))


# ----------------------------------------------------------------------------------
# off the proxy's loop
# ----------------------------------------------------------------------------------
def test_in_one_process_the_receivers_run_in_a_process_of_their_own_at_a_lower_priority(proxy):
    import os

    pid = receiver(proxy)._process.pid
    assert pid != os.getpid()
    assert os.getpriority(os.PRIO_PROCESS, pid) - os.getpriority(os.PRIO_PROCESS, 0) == 10  # tracing.exporter_nice


def test_a_receiver_port_that_is_taken_is_an_error_naming_its_key(start_proxy, fast_upstream):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        with pytest.raises(OSError, match=rf"engines.otlp_receiver 127.0.0.1:{taken.getsockname()[1]}: "):
            start_proxy(fast_upstream().url, **{"engines.otlp_receiver": f"127.0.0.1:{taken.getsockname()[1]}"})
    finally:
        taken.close()


@pytest.mark.parametrize("key, port_of", [("engines.otlp_receiver", "http_port"),
                                           ("engines.otlp_receiver_grpc", "grpc_port")])
def test_a_receiver_port_another_proxy_listens_on_is_an_error_naming_its_key(start_proxy, fast_upstream, key,
                                                                               port_of):
    # gRPC would share the port (SO_REUSEPORT) unless told not to: the engines' spans
    # would then be split between the two proxies without a word.
    first = start_proxy(fast_upstream().url, **{key: "127.0.0.1:0"})
    port = getattr(receiver(first), port_of)
    with pytest.raises(OSError, match=rf"{key} 127.0.0.1:{port}: "):
        start_proxy(fast_upstream().url, **{key: f"127.0.0.1:{port}"})


def test_a_receiver_process_that_dies_before_it_listens_is_said_with_how_it_ended(start_proxy, fast_upstream,
                                                                                   monkeypatch):
    from traceproxy.observe import engine_receiver_proc

    monkeypatch.setattr(engine_receiver_proc, "CHILD_MODULE", "traceproxy.observe.no_such_module")
    with pytest.raises(OSError, match=r"ended before it listened \(exit code 1\)$"):
        start_proxy(fast_upstream().url, **{"engines.otlp_receiver": "127.0.0.1:0"})


def test_serve_check_names_the_receivers_and_nothing_when_they_are_off():
    from traceproxy.app import check_settings

    on = default_settings().replace(**{"engines.otlp_receiver": "127.0.0.1:4318",
                                       "engines.otlp_receiver_grpc": "[::1]:4317", "tracing.exporter": "off"})
    assert dict(check_settings(on))["engine spans"] == "OTLP/HTTP 127.0.0.1:4318/v1/traces, OTLP/gRPC [::1]:4317"
    kept = on.replace(**{"engines.otlp_receiver_relay": False})
    assert dict(check_settings(kept))["engine spans"].endswith("(kept for the join, relayed nowhere)")
    assert "engine spans" not in dict(check_settings(default_settings().replace(**{"tracing.exporter": "off"})))
