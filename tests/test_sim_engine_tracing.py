"""The simulated workers speak SGLang's request tracing (``traceproxy.sim.otel``, ``stages``).

Part 1, the workers without a router: the rule for the stage a request is in, SGLang's
per-stage latency histogram on ``/metrics``, the spans of a worker used alone (SGLang's
unified mode), a prompt prefilled in chunks, a request without a ``traceparent``, and
export settings SGLang would refuse.

Part 2, behind the real routers in PD mode with traceproxy in front (sglang-router
0.3.2 over OTLP/gRPC and over OTLP/HTTP; smg and vllm-router over gRPC): each fault
that hangs a request at one PD stage. While the request hangs, the receiver already
holds the stage spans that ended, named and linked as SGLang's, under the trace
traceproxy has in flight; the stage the request is in is the one after the last that
ended, and the workers' gauges agree. Once let go, the rest arrives, and each worker's
spans hang under traceproxy's CLIENT span. Behind vllm-router (prefill first, then
decode) the same faults hang where its protocol puts them: the handshake and the
transfer after prefill answered, and decode is never called while prefill hangs.
"""

from __future__ import annotations

import json
import time
from typing import NamedTuple

import pytest
from prometheus_client.parser import text_string_to_metric_families

from traceproxy.cli import main as cli_main
from traceproxy.sim import gauges as g
from traceproxy.sim.otel import traces_url
from traceproxy.sim.routers import router_kind
from traceproxy.sim.stages import CHUNKED_PREFILL_SIZE, REQUEST_STAGES, STAGE_ORDER, stage_in

from .otlp_receiver import OtlpGrpcReceiver, OtlpHttpReceiver, ReceivedSpan
from .router_harness import RouterHarness
from .support import RawClient, admin_get, start_worker, wait_until  # noqa: F401  (start_worker: a fixture)

JSON = [("Content-Type", "application/json")]
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
QUIET = 0.3  # several export intervals (SPAN_DELAY_MS): what has not arrived by then was not exported
SPAN_TIMEOUT = 10.0
STATUS_ERROR = 2


def generate(**extra) -> bytes:
    return json.dumps({"text": "Say hi", "sampling_params": {"max_new_tokens": 3}, **extra}).encode()


def chat(max_tokens: int = 4) -> bytes:
    return json.dumps({"model": "sim-llama", "messages": [{"role": "user", "content": "Say hi"}],
                       "max_tokens": max_tokens, "stream": True}).encode()


def by_start(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
    return sorted(spans, key=lambda s: s.span.start_time_unix_nano)


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> list[ReceivedSpan]:
    return by_start([s for s in spans if s.parent_span_id == parent.span_id])


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


def linked_to(span: ReceivedSpan) -> list[str]:
    return [link.span_id.hex() for link in span.span.links]


@pytest.fixture
def grpc_receiver():
    with OtlpGrpcReceiver() as receiver:
        yield receiver


@pytest.fixture
def traced_worker(start_worker, grpc_receiver, monkeypatch):
    """``traced_worker(role, **options)``: a worker exporting SGLang's spans to ``grpc_receiver``."""
    monkeypatch.setenv("SGLANG_OTLP_EXPORTER_SCHEDULE_DELAY_MILLIS", "50")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)  # SGLang's default: gRPC

    def factory(role: str, **options):
        return start_worker(role, otlp_endpoint=f"127.0.0.1:{grpc_receiver.port}", **options)

    return factory


# ----------------------------------------------------------------------------------
# 1. the workers alone
# ----------------------------------------------------------------------------------
def test_the_stage_a_request_is_in_is_the_one_after_the_last_that_ended():
    assert stage_in("prefill", []) == "prefill_prepare"
    assert stage_in("prefill", ["prefill_prepare", "prefill_bootstrap", "prefill_waiting"]) == "prefill_forward"
    # SGLang's decode receives the KV cache (decode_transferred) before it waits for a slot.
    assert stage_in("decode", ["decode_prepare", "decode_bootstrap"]) == "decode_transferred"
    # Nested stages say how far the forward got; they do not move the request on.
    assert stage_in("decode", [*STAGE_ORDER["decode"][:4], "fake_output", "decode_loop"]) == "decode_forward"
    assert stage_in("prefill", STAGE_ORDER["prefill"]) is None


def test_traceproxy_reads_the_stages_in_the_order_the_simulator_makes_them():
    # The simulator stands apart from the proxy: each keeps SGLang's table, and they must agree.
    from traceproxy.lifecycle import pd_stages

    assert pd_stages.STAGE_ORDER == STAGE_ORDER
    assert pd_stages.NESTED_IN == {name: kind.nested_in for name, kind in REQUEST_STAGES.items() if kind.nested_in}
    assert set(pd_stages.STAGES) == set(REQUEST_STAGES)


def metric_samples(worker) -> dict:
    text = RawClient(worker.port).roundtrip("GET", "/metrics").body.decode()
    [family] = [f for f in text_string_to_metric_families(text) if f.name == g.STAGE_LATENCY]
    assert family.type == "histogram" and family.documentation == "The latency of each stage of requests."
    return {(s.name, s.labels["stage"], s.labels.get("le")): s.value for s in family.samples}


def test_each_worker_observes_sglangs_stages_in_its_per_stage_latency_histogram(start_worker, loop_thread):
    prefill, decode = start_worker("prefill"), start_worker("decode")
    assert metric_samples(prefill) == {}  # the family is there before anything was observed
    body = generate(bootstrap_room=9, bootstrap_host="127.0.0.1", bootstrap_port=prefill.bootstrap_port)
    decode_client = RawClient(decode.port)
    decode_client.request("POST", "/generate", JSON, body)
    assert RawClient(prefill.port).roundtrip("POST", "/generate", JSON, body).status == 200
    assert decode_client.response().status == 200
    # The stages SGLang observes (RequestStage's metrics_is_observed), once each.
    observed = {"prefill": {"prefill_bootstrap", "prefill_forward", "prefill_transfer_kv_cache"},
                "decode": {"decode_prepare", "decode_bootstrap", "decode_transferred", "decode_waiting",
                           "fake_output"}}
    bounds = [repr(0.001 * 1.62 ** i) for i in range(30)] + ["+Inf"]  # exponential_buckets(0.001, 1.62, 30)
    for worker in (prefill, decode):
        samples = metric_samples(worker)
        assert {stage for _, stage, _ in samples} == observed[worker.role]
        for stage in observed[worker.role]:
            buckets = [(le, n) for (name, s, le), n in samples.items() if name.endswith("_bucket") and s == stage]
            assert [le for le, _ in buckets] == bounds
            assert buckets[-1][1] == 1 and samples[(f"{g.STAGE_LATENCY}_count", stage, None)] == 1
            assert samples[(f"{g.STAGE_LATENCY}_sum", stage, None)] >= 0


def test_a_worker_used_alone_traces_sglangs_unified_stages(traced_worker, grpc_receiver):
    decode = traced_worker("decode", decode_tokens_per_s=1000)
    resp = RawClient(decode.port).roundtrip("POST", "/generate", [*JSON, ("traceparent", TRACEPARENT)],
                                            generate(rid="a1b2c3d4e5f6"))
    assert resp.status == 200
    trace_id, parent_id = TRACEPARENT.split("-")[1:3]
    assert wait_until(lambda: grpc_receiver.find("Bootstrap Room 0x0", trace_id), timeout=SPAN_TIMEOUT)
    spans = grpc_receiver.find(trace_id=trace_id)
    room = one(spans, "Bootstrap Room 0x0")  # no room: SGLang's room 0
    assert room.parent_span_id == parent_id and room.attributes == {"bootstrap_room": "0x0"}
    [req] = children(spans, room)
    assert req.name == " Req a1b2c3d4" and req.attributes == {"rid": "a1b2c3d4e5f6"}  # unified: no role
    [thread] = children(spans, req)
    assert thread.name == f"Scheduler [TP 0] (host:{thread.attributes['host_id'][:8]} | pid:{thread.attributes['pid']})"
    assert thread.attributes["thread_label"] == "Scheduler" and thread.attributes["tp_rank"] == 0
    stages = children(spans, thread)
    assert [s.name for s in stages] == list(STAGE_ORDER["unified"])
    # Each stage links to the one before it, as SGLang's slices do.
    assert linked_to(stages[0]) == []
    assert all(linked_to(stage) == [before.span_id] for before, stage in zip(stages, stages[1:]))
    loops = children(spans, stages[-1])
    assert [(s.name, s.attributes) for s in loops] == [("decode_loop", {"decode_ct": n}) for n in range(3)]
    assert all(s.resource["service.name"] == "sglang" and s.scope_name == "sglang server" for s in spans)
    assert thread.span.status.code != STATUS_ERROR


def test_a_long_prompt_prefills_in_chunks_nested_in_prefill_forward(traced_worker, grpc_receiver):
    prefill = traced_worker("prefill", prefill_tokens_per_s=1e6)
    tokens = 2 * CHUNKED_PREFILL_SIZE + 100
    body = json.dumps({"input_ids": [1] * tokens, "sampling_params": {"max_new_tokens": 1}}).encode()
    resp = RawClient(prefill.port).roundtrip("POST", "/generate", [*JSON, ("traceparent", TRACEPARENT)], body)
    assert resp.status == 200
    trace_id = TRACEPARENT.split("-")[1]
    assert wait_until(lambda: grpc_receiver.find("Bootstrap Room 0x0", trace_id), timeout=SPAN_TIMEOUT)
    spans = grpc_receiver.find(trace_id=trace_id)
    forward = one(spans, "prefill_forward")
    assert [s.name for s in children(spans, forward)] == ["chunked_prefill"] * 3
    # SGLang observes every chunk but the last, which the end of prefill_forward traces.
    assert metric_samples(prefill)[(f"{g.STAGE_LATENCY}_count", "chunked_prefill", None)] == 2


def test_a_request_without_a_traceparent_starts_a_trace_of_its_own(traced_worker, grpc_receiver):
    decode = traced_worker("decode", decode_tokens_per_s=1000)
    assert RawClient(decode.port).roundtrip("POST", "/generate", JSON, generate()).status == 200
    assert wait_until(lambda: grpc_receiver.find("Bootstrap Room 0x0"), timeout=SPAN_TIMEOUT)
    [room] = grpc_receiver.find("Bootstrap Room 0x0")
    # A root, with SGLang's 64-bit trace id.
    assert room.parent_span_id == "" and room.trace_id.startswith("0" * 16) and int(room.trace_id, 16)


def test_an_http_endpoint_is_a_base_url_or_sglangs_full_traces_url():
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/v1/traces") == "http://collector:4318/v1/traces"


@pytest.mark.parametrize("variable, value, message", [
    ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json' is not"),
    ("SGLANG_OTLP_EXPORTER_SCHEDULE_DELAY_MILLIS", "soon", "SGLANG_OTLP_EXPORTER_SCHEDULE_DELAY_MILLIS='soon' must"),
    ("SGLANG_OTLP_EXPORTER_MAX_EXPORT_BATCH_SIZE", "0", "SGLANG_OTLP_EXPORTER_MAX_EXPORT_BATCH_SIZE='0' must"),
])
def test_export_settings_sglang_would_refuse_are_one_line_errors(capsys, monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    assert cli_main(["sim", "worker", "--role", "decode", "--otlp-endpoint", "127.0.0.1:4317"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("protocol, endpoint, message", [
    ("grpc", "collector", "over gRPC, HOST:PORT such as 127.0.0.1:4317"),
    ("grpc", "127.0.0.1:70000", "over gRPC, HOST:PORT such as 127.0.0.1:4317"),
    ("http/protobuf", "127.0.0.1:4318", "over http/protobuf, an http(s):// URL"),
    # gRPC has no path: the exporter would drop it and send to the port anyway
    ("grpc", "http://127.0.0.1:4318/v1/traces", "over gRPC, HOST:PORT such as 127.0.0.1:4317"),
])
def test_an_endpoint_the_protocol_cannot_use_is_a_one_line_error(capsys, monkeypatch, protocol, endpoint, message):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    assert cli_main(["sim", "worker", "--role", "decode", "--otlp-endpoint", endpoint]) == 2
    err = capsys.readouterr().err
    assert message in err and "--otlp-endpoint" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_worker_whose_span_destination_is_gone_still_stops_promptly(monkeypatch, loop_thread):
    import socket

    from traceproxy.sim.otel import SHUTDOWN_TIMEOUT_S, make_tracing

    with socket.socket() as gone:  # a port nothing listens on once closed
        gone.bind(("127.0.0.1", 0))
        port = gone.getsockname()[1]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    monkeypatch.setenv("SGLANG_OTLP_EXPORTER_SCHEDULE_DELAY_MILLIS", "50")
    tracing = make_tracing("decode", f"127.0.0.1:{port}")
    trace = tracing.request("rid-1", 7, {}, "decode")
    trace.stage("decode_prepare", time.time_ns(), time.time_ns())
    time.sleep(0.3)  # an export is under way, retrying with backoff
    trace.finish(time.time_ns())
    began = time.monotonic()
    loop_thread.run(tracing.shutdown())
    # Bounded by SHUTDOWN_TIMEOUT_S, not the exporter's 10 s of retries (a generous margin for a busy machine).
    assert time.monotonic() - began < SHUTDOWN_TIMEOUT_S + 3


# ----------------------------------------------------------------------------------
# 2. behind the real routers in PD mode, traceproxy in front
# ----------------------------------------------------------------------------------
NOT_CALLED = "not called"  # vllm-router calls decode only once prefill answered


class Hang(NamedTuple):
    prefill_in: str | None  # the stage prefill hangs in; None: prefill finished
    decode_in: str  # the stage decode hangs in, or NOT_CALLED
    gauges: dict[str, str]  # worker -> the gauge it is counted in meanwhile


class Stall(NamedTuple):
    fault: str
    worker: str  # the worker it is set on
    sglang: Hang  # behind sglang-router and smg: prefill and decode at once
    vllm: Hang  # behind vllm-router: prefill, then decode


STALLS = [
    Stall("bootstrap_stall", "prefill",
          Hang("prefill_bootstrap", "decode_bootstrap", {"prefill": g.PREFILL_PREALLOC, "decode": g.DECODE_PREALLOC}),
          # vLLM's handshake comes when decode pulls: prefill answered and keeps its KV cache.
          Hang("prefill_transfer_kv_cache", "decode_bootstrap",
               {"prefill": g.PREFILL_INFLIGHT, "decode": g.DECODE_PREALLOC})),
    Stall("prefill_stall", "prefill",
          Hang("prefill_forward", "decode_transferred", {"prefill": g.RUNNING, "decode": g.DECODE_TRANSFER}),
          Hang("prefill_forward", NOT_CALLED, {"prefill": g.RUNNING})),
    Stall("kv_transfer_stall", "prefill",
          Hang("prefill_transfer_kv_cache", "decode_transferred",
               {"prefill": g.PREFILL_INFLIGHT, "decode": g.DECODE_TRANSFER}),
          Hang("prefill_transfer_kv_cache", "decode_transferred",
               {"prefill": g.PREFILL_INFLIGHT, "decode": g.DECODE_TRANSFER})),
    Stall("decode_waiting_stall", "decode",
          Hang(None, "decode_transferred", {"decode": g.DECODE_TRANSFER}),
          Hang(None, "decode_transferred", {"decode": g.DECODE_TRANSFER})),
    Stall("decode_stall:2", "decode",
          Hang(None, "decode_forward", {"decode": g.RUNNING}),
          Hang(None, "decode_forward", {"decode": g.RUNNING})),
]
# sglang-router 0.3.2 over both protocols; smg and vllm-router over gRPC.
DEPLOYMENTS = [("sglang-router", "grpc"), ("sglang-router", "http/protobuf"), ("smg", "grpc"),
               ("vllm-router", "grpc")]


def gauge(worker, name: str) -> float:
    for line in RawClient(worker.port).roundtrip("GET", "/metrics").body.decode().splitlines():
        if line.startswith(f'{name}{{model_name="'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in {worker.url}/metrics")


@pytest.fixture(scope="module", params=DEPLOYMENTS, ids=[f"{r}-{p}" for r, p in DEPLOYMENTS])
def deployment(request, loop_thread):
    """A router in PD mode in front of the workers, which export to a receiver of the protocol."""
    router, protocol = request.param
    if not router_kind(router).installed:
        pytest.skip(f"{router} is not installed (pip install {router}; the test extra installs it)")
    receiver_kind = OtlpGrpcReceiver if protocol == "grpc" else OtlpHttpReceiver
    with receiver_kind() as receiver:
        endpoint = f"127.0.0.1:{receiver.port}" if protocol == "grpc" else receiver.endpoint
        with RouterHarness(loop_thread, router, otlp_endpoint=endpoint, otlp_protocol=protocol) as harness:
            yield harness, receiver


class EngineSpans:
    """What the receiver holds of one trace, per PD role."""

    def __init__(self, receiver, trace_id: str) -> None:
        self.receiver, self.trace_id = receiver, trace_id

    def all(self) -> list[ReceivedSpan]:
        return self.receiver.find(trace_id=self.trace_id)

    def stages(self, role: str) -> list[ReceivedSpan]:
        return by_start([s for s in self.all() if s.name in STAGE_ORDER[role]])

    def ended(self, role: str) -> list[str]:
        return [s.name for s in self.stages(role)]

    def request_of(self, role: str, rid: str | None = None) -> ReceivedSpan | None:
        """The worker's Req span (of the request ``rid``): exported once the request ended there."""
        return next((s for s in self.all() if s.name.startswith(f"{role} Req ")
                     and rid in (None, s.attributes["rid"])), None)


def request_in(worker, trace_id: str):
    """The request of the trace ``trace_id`` that reached ``worker``."""
    assert wait_until(lambda: any(r.trace_id == trace_id for r in worker.requests), timeout=5), worker.role
    [request] = [r for r in worker.requests if r.trace_id == trace_id]
    return request


def idle(worker) -> bool:
    return not any(worker.metrics.gauges.values())


def expected_ended(role: str, stage: str | None) -> list[str]:
    order = STAGE_ORDER[role]
    if stage == NOT_CALLED:
        return []
    return list(order if stage is None else order[:order.index(stage)])


@pytest.mark.parametrize("stall", STALLS, ids=[s.fault.split(":")[0] for s in STALLS])
def test_a_hung_request_shows_the_stages_that_ended_and_the_one_it_is_in(deployment, start_proxy, stall):
    harness, receiver = deployment
    hang = stall.vllm if harness.speaks_vllm else stall.sglang
    harness.reset()
    getattr(harness, stall.worker).set_faults([stall.fault])
    proxy = start_proxy(harness.router_url)
    client = RawClient(proxy.port)
    client.request("POST", "/v1/chat/completions", JSON, chat())
    # The live join: the trace traceproxy has in flight is the engines' trace.
    assert wait_until(lambda: json.loads(admin_get(proxy, "/debug/inflight"))["requests"], timeout=5)
    [inflight] = json.loads(admin_get(proxy, "/debug/inflight"))["requests"]
    trace_id = inflight["trace_id"]
    pre = request_in(harness.prefill, trace_id)
    client_span_id = pre.headers["traceparent"].split("-")[2]

    engine = EngineSpans(receiver, trace_id)
    stuck_in = {"prefill": hang.prefill_in, "decode": hang.decode_in}
    expected = {role: expected_ended(role, stage) for role, stage in stuck_in.items()}
    assert wait_until(lambda: all(engine.ended(role) == expected[role] for role in stuck_in),
                      timeout=SPAN_TIMEOUT), {role: engine.ended(role) for role in stuck_in}
    for worker, name in hang.gauges.items():  # the gauges agree
        assert wait_until(lambda: gauge(getattr(harness, worker), name) == 1, timeout=5), (worker, name)
    if stall.fault.startswith("decode_stall"):  # its two decode steps' spans come after the stages'
        assert wait_until(lambda: sum(s.name == "decode_loop" for s in engine.all()) == 2, timeout=SPAN_TIMEOUT)
    time.sleep(QUIET)  # while it hangs, nothing more comes

    for role, stage in stuck_in.items():
        stages = engine.stages(role)
        assert [s.name for s in stages] == expected[role]
        if stage == NOT_CALLED:
            assert getattr(harness, role).requests == [] and engine.request_of(role) is None
            continue
        assert stage_in(role, [s.name for s in stages]) == stage
        # One scheduler thread's stages, each linked to the one before, none with attributes of its own.
        assert len({s.parent_span_id for s in stages}) == 1
        assert all(s.attributes == {} for s in stages)
        assert all(linked_to(stage) == [before.span_id] for before, stage in zip(stages, stages[1:]))
        # The request's own spans end with it: a hung worker has exported none.
        assert (engine.request_of(role) is None) is (stage is not None)
    if stall.fault.startswith("decode_stall"):
        # Two decode steps ran inside the open decode_forward.
        nested = [s for s in engine.all() if s.name in ("fake_output", "decode_loop")]
        assert [(s.name, s.attributes) for s in by_start(nested)] == [
            ("fake_output", {}), ("decode_loop", {"decode_ct": 0}), ("decode_loop", {"decode_ct": 1})]

    seen = {"prefill": pre}
    if hang.decode_in != NOT_CALLED:
        seen["decode"] = request_in(harness.decode, trace_id)
    # The client leaves first, so that no router retries the request (sglang-router and smg
    # retry a prefill that dropped); then the workers let go of what they still hold.
    client.close()
    assert wait_until(lambda: not json.loads(admin_get(proxy, "/debug/inflight"))["requests"], timeout=5)
    harness.reset()
    assert wait_until(lambda: all(engine.request_of(role, request.rid) for role, request in seen.items()),
                      timeout=SPAN_TIMEOUT), [s.name for s in engine.all()]
    spans = engine.all()
    for role, request in seen.items():
        req = engine.request_of(role, request.rid)
        assert req.name == f"{role} Req {request.rid[:8]}" and req.attributes == {"rid": request.rid}
        [room] = [s for s in spans if s.span_id == req.parent_span_id]
        # Under the parent the router forwarded: traceproxy's CLIENT span.
        assert room.name == f"Bootstrap Room {hex(request.room)}" and room.parent_span_id == client_span_id
        assert room.attributes == {"bootstrap_room": hex(request.room)}
        [thread] = children(spans, req)
        assert thread.name.startswith(f"{role.title()} Scheduler [TP 0] (host:")
        # A forward stage is an open span: it ends with the request (SGLang's abort ends open slices).
        opened = [stuck_in[role]] if stuck_in[role] in ("prefill_forward", "decode_forward") else []
        assert [s.name for s in children(spans, thread)] == expected[role] + opened
        # The worker the fault held, and the peer it failed, end their request in error.
        assert (thread.span.status.code == STATUS_ERROR) is (stuck_in[role] is not None)
    if stall.fault.startswith("decode_stall"):
        forward = one(spans, "decode_forward")
        assert {s.parent_span_id for s in spans if s.name in ("fake_output", "decode_loop")} == {forward.span_id}
    assert wait_until(lambda: idle(harness.prefill) and idle(harness.decode), timeout=5)
