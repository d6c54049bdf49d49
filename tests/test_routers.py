"""traceproxy behind each real router, for what a deployment relies on across them.

* ``--inject-rid`` (``request_id.inject_rid``) puts the proxy's request id into the
  body of ``/generate``, and every router carries it to both engines: behind
  vllm-router, which replaces ``x-request-id``, it is how the engines' logs get it.
* Keep-alive holds across turns: one client connection, one pooled upstream
  connection, and the router reuses its own connections to the workers.
* The routers read the simulated workers' load reports (smg's ``/get_loads``).
* smg with ``--enable-trace`` continues the proxy's trace: its INTERNAL
  ``http_request`` span is the child of traceproxy's CLIENT span, and the engines'
  spans are its children. Its ``traceparent`` response header reaches the client
  unchanged, beside traceproxy's own ``traceresponse``.
* smg reports an engine that failed mid-stream inside a clean stream (an SSE
  ``error`` event, then ``[DONE]``): that is an upstream failure.

The harness is ``router_harness.py``; the per-fault verdicts are in ``test_sim.py``
and what each router forwards in ``test_router_trace.py``.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import requests

from .otlp_receiver import OtlpGrpcReceiver, OtlpHttpReceiver
from traceproxy.sim.routers import router_kind

from .router_harness import RouterHarness, wait_for_requests
from .router_harness import harness, pd_router  # noqa: F401  (fixtures, used by name)
from .support import Done, RawClient, wait_until

JSON = [("Content-Type", "application/json")]
FAST = {"stall.first_byte": 0.5, "stall.stream_gap": 0.5}
TURNS = 6
SPAN_KIND_INTERNAL, SPAN_KIND_CLIENT = 1, 3


def chat(stream: bool = True, max_tokens: int = 4) -> dict:
    return {"model": "sim-llama", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": max_tokens,
            "stream": stream}


def sse_events(body: bytes) -> list[str]:
    return [part[len(b"data: "):].decode() for part in body.split(b"\n\n") if part.startswith(b"data: ")]


@pytest.fixture
def pd(pd_router):
    return pd_router


# ----------------------------------------------------------------------------------
# every router
# ----------------------------------------------------------------------------------
def test_inject_rid_reaches_both_engines_through_every_router(pd, start_proxy):
    proxy = start_proxy(pd.router_url, **{"request_id.inject_rid": True})
    body = json.dumps({"text": "Say hi", "sampling_params": {"max_new_tokens": 3}}).encode()
    resp = RawClient(proxy.port).roundtrip("POST", "/generate", JSON, body)
    assert resp.status == 200
    request_id = resp.headers["x-request-id"]
    [pre], [dec] = wait_for_requests(pd.prefill, 1), wait_for_requests(pd.decode, 1)
    # SGLang takes its request id from rid: both engines' logs and spans carry the proxy's id,
    # behind vllm-router too, whose x-request-id is its own.
    assert pre.rid == dec.rid == request_id
    assert json.loads(resp.body)["meta_info"]["id"] == request_id
    assert (pre.request_id == request_id) is pd.behaviour.engines_get_client_request_id


def test_keep_alive_holds_across_turns_on_every_hop(pd, start_proxy):
    done = Done()
    proxy = start_proxy(pd.router_url, observers=[done])
    url = f"http://127.0.0.1:{proxy.port}/v1/chat/completions"
    with requests.Session() as session:
        for turn in range(TURNS):
            stream = turn % 2 == 0
            with session.post(url, json=chat(stream=stream), stream=stream, timeout=10) as resp:
                assert resp.status_code == 200
                if stream:
                    assert sse_events(resp.content)[-1] == "[DONE]"
                else:
                    assert resp.json()["usage"]["completion_tokens"] == 4
    assert wait_until(lambda: len(done.records) == TURNS, timeout=5)
    assert [r.outcome.code for r in done.records] == ["OK"] * TURNS
    assert len({r.connection.id for r in done.records}) == 1  # the client's one connection
    assert proxy.ctx.pool.stats["opened"] == 1 and proxy.ctx.pool.stats["reused"] == TURNS - 1
    # The router, too, keeps its connections to the workers between turns: the connection
    # that carried a JSON answer carries the next turn. (After a stream, sglang-router and
    # smg now and then open a new one for the next turn.)
    for worker in (pd.prefill, pd.decode):
        peers = [seen.peer for seen in worker.requests]
        assert len(peers) == TURNS, (worker.role, peers)
        after_json = [(peers[turn], peers[turn + 1]) for turn in range(1, TURNS - 1, 2)]
        assert all(this == following for this, following in after_json), (pd.name, worker.role, peers)


# ----------------------------------------------------------------------------------
# smg
# ----------------------------------------------------------------------------------
def skip_unless_installed(name: str) -> None:
    kind = router_kind(name)
    if not kind.installed:
        pytest.skip(f"{name} is not installed (pip install {name}; the test extra installs it)")


@pytest.fixture(scope="module")
def smg(loop_thread):
    skip_unless_installed("smg")
    # smg polls its workers' load every 10 s by default; every second here.
    with RouterHarness(loop_thread, "smg", router_args=("--load-monitor-interval", "1")) as started:
        yield started


def test_smg_reads_the_load_each_worker_reports(smg):
    smg.reset()
    smg.decode.set_faults(["decode_stall:1"])
    client = RawClient(smg.router_port)
    client.request("POST", "/v1/chat/completions", JSON, json.dumps(chat()).encode())
    assert wait_until(lambda: smg.decode.metrics.gauges["sglang:num_running_reqs"] == 1, timeout=5)

    seen: dict = {}

    def decode_running() -> bool:
        # What smg last fetched; it drops a worker's entry while it polls it again.
        with urllib.request.urlopen(f"{smg.router_url}/get_loads", timeout=5) as resp:
            seen.clear()
            seen.update((load["worker_type"], load) for load in json.loads(resp.read())["loads"])
        return {"prefill", "decode"} <= set(seen) and seen["decode"]["num_running_reqs"] == 1

    # smg asks each worker for its load report (GET /loads) and shows what it got.
    assert wait_until(decode_running, timeout=5), seen
    assert seen["prefill"]["num_running_reqs"] == 0
    assert seen["decode"]["max_total_num_tokens"] == 131072  # the simulated pool's size
    assert {call.path.partition("?")[0] for call in smg.decode.calls} >= {"/loads"}
    client.close()
    smg.reset()


def test_smg_in_band_stream_error_is_an_engine_failure(smg, start_proxy):
    smg.reset()
    done = Done()
    proxy = start_proxy(smg.router_url, observers=[done], **FAST)
    smg.decode.set_faults(["reset_mid_stream:3"])
    resp = RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", JSON,
                                           json.dumps(chat(max_tokens=8)).encode())
    smg.reset()
    # What smg makes of decode's reset: three tokens, an error event, [DONE], a clean end.
    # The client gets those bytes unchanged ...
    assert resp.status == 200 and resp.complete
    *tokens, error, last = sse_events(resp.body)
    assert last == "[DONE]" and len(tokens) == 3
    assert json.loads(error)["error"]["type"] == "stream_error"
    # ... and traceproxy records an upstream failure, blamed on the engine.
    record = done.one()
    assert not record.outcome.is_ok and record.outcome.blame.value == "engine", record.outcome


def enable_trace(receiver: OtlpGrpcReceiver) -> tuple[str, ...]:
    return ("--enable-trace", "--otlp-traces-endpoint", f"127.0.0.1:{receiver.port}")


@pytest.fixture(scope="module")
def traced_smg(loop_thread):
    """smg with --enable-trace, exporting its spans over OTLP/gRPC; the workers export over HTTP
    (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf), as traceproxy does.

    At log level info: smg's request span is an INFO-level span, and below info it makes none."""
    skip_unless_installed("smg")
    with OtlpGrpcReceiver() as smg_spans, OtlpHttpReceiver() as spans:
        with RouterHarness(loop_thread, "smg", otlp_endpoint=spans.endpoint, otlp_protocol="http/protobuf",
                           router_log_level="info",
                           router_args=enable_trace(smg_spans)) as started:
            yield started, smg_spans, spans


def test_smg_with_enable_trace_parents_the_engines_on_its_own_span(traced_smg, start_proxy):
    smg, smg_spans, spans = traced_smg
    smg.reset()
    proxy = start_proxy(smg.router_url, **{"tracing.exporter": "otlp", "tracing.otlp_endpoint": spans.endpoint,
                                           "tracing.otlp_protocol": "http/protobuf"})
    resp = RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", JSON, json.dumps(chat()).encode())
    assert resp.status == 200 and resp.complete and sse_events(resp.body)[-1] == "[DONE]"
    _, trace_id, proxy_server_span, _ = resp.headers["traceresponse"].split("-")
    [pre], [dec] = wait_for_requests(smg.prefill, 1), wait_for_requests(smg.decode, 1)
    assert pre.headers["traceparent"] == dec.headers["traceparent"]
    assert pre.trace_id == dec.trace_id == trace_id  # the trace id still joins everything
    smg_span_id = pre.headers["traceparent"].split("-")[2]
    # Without a tracestate from its client, smg sends the engines an empty one.
    assert pre.headers["tracestate"] == dec.headers["tracestate"] == ""

    def named(receiver, name):
        return [s for s in receiver.find(trace_id=trace_id) if s.name == name]

    assert wait_until(lambda: named(smg_spans, "http_request"), timeout=15), smg_spans.spans()
    [smg_span] = named(smg_spans, "http_request")
    assert smg_span.span_id == smg_span_id and smg_span.span.kind == SPAN_KIND_INTERNAL
    assert smg_span.resource["service.name"] == "smg"
    assert smg_span.attributes["request_id"] == resp.headers["x-request-id"]

    room = f"Bootstrap Room {hex(pre.room)}"
    assert wait_until(lambda: len(named(spans, room)) == 2
                      and [s for s in spans.find(trace_id=trace_id) if s.span.kind == SPAN_KIND_CLIENT], timeout=15)
    [proxy_client] = [s for s in spans.find(trace_id=trace_id) if s.span.kind == SPAN_KIND_CLIENT]
    # traceproxy SERVER -> traceproxy CLIENT -> smg http_request -> each engine's Bootstrap Room
    assert proxy_client.parent_span_id == proxy_server_span
    assert smg_span.parent_span_id == proxy_client.span_id
    for engine in named(spans, room):
        assert engine.parent_span_id == smg_span_id and engine.span.kind == SPAN_KIND_INTERNAL
    assert {s.name.split(" Req ")[0] for s in spans.find(trace_id=trace_id) if " Req " in s.name} == {
        "prefill", "decode"}

    # smg answers with a traceparent of its own span; traceproxy passes it to the client
    # unchanged (it replaces only x-request-id and traceresponse): same trace, smg's span.
    assert resp.headers["traceparent"] == f"00-{trace_id}-{smg_span_id}-01"
    assert resp.headers["traceresponse"] != resp.headers["traceparent"]


def test_smg_with_enable_trace_below_log_level_info_passes_the_traceparent_on(loop_thread):
    # The sim runs routers at log level warning. smg's span is made at INFO level, so
    # there --enable-trace exports nothing and smg forwards the traceparent verbatim.
    skip_unless_installed("smg")
    with OtlpGrpcReceiver() as smg_spans, RouterHarness(loop_thread, "smg", router_log_level="warning",
                                                        router_args=enable_trace(smg_spans)) as smg:
        traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        resp = RawClient(smg.router_port).roundtrip("POST", "/v1/chat/completions",
                                                    [*JSON, ("traceparent", traceparent)], json.dumps(chat()).encode())
        assert resp.status == 200 and "traceparent" not in resp.headers
        [pre], [dec] = wait_for_requests(smg.prefill, 1), wait_for_requests(smg.decode, 1)
        assert pre.headers["traceparent"] == dec.headers["traceparent"] == traceparent
        assert smg_spans.spans() == []


def test_sglang_router_with_enable_trace_starts_a_trace_of_its_own(loop_thread, start_proxy):
    # Why the docs say: run sglang-router 0.3.2 without --enable-trace. With it (at log
    # level info) the engines get a new trace id, and the proxy's no longer joins them.
    skip_unless_installed("sglang-router")
    with OtlpGrpcReceiver() as router_spans, RouterHarness(loop_thread, "sglang-router", router_log_level="info",
                                                           router_args=enable_trace(router_spans)) as router:
        proxy = start_proxy(router.router_url)
        resp = RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", JSON, json.dumps(chat()).encode())
        assert resp.status == 200 and resp.complete
        trace_id = resp.headers["traceresponse"].split("-")[1]
        [pre], [dec] = wait_for_requests(router.prefill, 1), wait_for_requests(router.decode, 1)
        assert pre.trace_id == dec.trace_id != trace_id
        assert pre.headers["tracestate"] == ""
        assert wait_until(lambda: router_spans.find(trace_id=pre.trace_id), timeout=15)
        [root] = router_spans.find(trace_id=pre.trace_id)
        assert root.name == "http_request" and root.parent_span_id == ""  # a root: the proxy's trace is cut
