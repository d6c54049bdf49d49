"""Behind the real sglang-router 0.3.2 in PD mode, each fault that hangs a request at one PD
stage is named live by traceproxy: the simulated workers export SGLang's spans to
traceproxy's own receiver (over OTLP/gRPC, SGLang's default, and OTLP/HTTP), and
/debug/inflight names the component, the role, the SGLang stage and the worker that hold
the hung request; its stall verdict keeps its code and names the component. With the
receiver off, the workers' and the router's gauges, labelled by role, name the same
component."""

from __future__ import annotations

import json
import os
import re
import socket
from typing import NamedTuple

import pytest

from traceproxy.app import ProxyServer
from traceproxy.config import default_settings
from traceproxy.lifecycle.hooks import Fanout
from traceproxy.ports import free_port
from traceproxy.sim.faults import FAULTS
from traceproxy.sim.otel import host_id
from traceproxy.sim.routers import router_kind

from .router_harness import RouterHarness, wait_for_requests
from .support import RawClient, admin_get, wait_until

JSON = [("Content-Type", "application/json")]
STALL_AFTER = 1.0


def chat(max_tokens: int = 4) -> bytes:
    return json.dumps({"model": "sim-llama", "messages": [{"role": "user", "content": "Say hi"}],
                       "max_tokens": max_tokens, "stream": True}).encode()


class Hang(NamedTuple):
    fault: str
    component: str
    role: str
    stage: str
    verdicts: tuple[str, ...]  # the stall it becomes (either of two: see below)


HANGS = [
    Hang("bootstrap_stall", "bootstrap", "prefill", "prefill_bootstrap", ("FBS",)),
    Hang("prefill_stall", "prefill", "prefill", "prefill_forward", ("FBS",)),
    Hang("kv_transfer_stall", "kv_transfer", "prefill", "prefill_transfer_kv_cache", ("FBS",)),
    # Prefill finished: whether sglang-router has passed decode's response head on by the
    # time the stall is judged varies from run to run; no token follows either way.
    Hang("decode_waiting_stall", "kv_transfer", "decode", "decode_transferred", ("FBS", "MSS")),
    Hang("decode_stall:2", "decode", "decode", "decode_forward", ("MSS",)),
]
IDS = [hang.fault.split(":")[0] for hang in HANGS]


def requires_sglang_router() -> None:
    if not router_kind("sglang-router").installed:
        pytest.skip("sglang-router is not installed (pip install sglang-router; the test extra installs it)")


def the_entry(proxy) -> dict:
    [entry] = json.loads(admin_get(proxy, "/debug/inflight"))["requests"]
    return entry


def hang(harness, proxy, fault: str) -> RawClient:
    worker = harness.prefill if FAULTS[fault.split(":")[0]].home == "prefill" else harness.decode
    worker.set_faults([fault])
    client = RawClient(proxy.port)
    client.request("POST", "/v1/chat/completions", JSON, chat())
    wait_for_requests(harness.decode, 1)
    return client


def let_go(harness, client: RawClient) -> None:
    client.close()  # the client leaves first, so the router retries nothing
    harness.reset()


# ----------------------------------------------------------------------------------
# engine spans to traceproxy's receiver
# ----------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["grpc", "http/protobuf"])
def traced_deployment(request, loop_thread):
    """The workers export to the receiver of one proxy, kept for the module: its port is
    held by a placeholder socket from the moment the workers are told it until the proxy
    binds it, and by the proxy from then on (a port that was free a moment ago can be any
    process's by the time it is bound again, as the suite runs test files side by side)."""
    requires_sglang_router()
    placeholder = socket.socket()
    # Below the ephemeral range: between the placeholder's close and the receiver's bind,
    # no bind(0) or outgoing connection elsewhere in the suite can be handed the port.
    placeholder.bind(("127.0.0.1", free_port()))
    placeholder.listen()
    port = placeholder.getsockname()[1]
    endpoint = f"127.0.0.1:{port}" if request.param == "grpc" else f"http://127.0.0.1:{port}"
    key = "engines.otlp_receiver_grpc" if request.param == "grpc" else "engines.otlp_receiver"
    try:
        with RouterHarness(loop_thread, "sglang-router", otlp_endpoint=endpoint,
                           otlp_protocol=request.param) as harness:
            settings = default_settings().replace(**{
                "listen": "127.0.0.1:0", "admin": "127.0.0.1:0", "upstream": harness.router_url,
                "tracing.exporter": "off", "access_log.path": "", key: f"127.0.0.1:{port}",
                "stall.first_byte": STALL_AFTER, "stall.stream_gap": STALL_AFTER})
            proxy = ProxyServer(settings, Fanout([]))
            placeholder.close()
            loop_thread.run(proxy.start())
            try:
                yield harness, proxy
            finally:
                loop_thread.run(proxy.shutdown(grace=0))
    finally:
        placeholder.close()


@pytest.fixture
def traced_proxy(traced_deployment):
    harness, proxy = traced_deployment
    harness.reset()
    # Nothing left in flight from the test before (its client left, its faults are cleared).
    assert wait_until(lambda: json.loads(admin_get(proxy, "/debug/inflight"))["count"] == 0, timeout=10)
    # One request through, healthy: the workers' finished spans name them (host, pid) from now on.
    assert RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", JSON, chat(2)).status == 200
    assert wait_until(lambda: json.loads(admin_get(proxy, "/debug/inflight")).get("engine_spans", {}).get(
        "workers_known", 0) >= 2, timeout=10)
    harness.clear()
    return harness, proxy


@pytest.mark.parametrize("expected", HANGS, ids=IDS)
def test_a_hung_request_is_named_live_by_its_component_stage_and_worker(traced_proxy, expected):
    harness, proxy = traced_proxy
    client = hang(harness, proxy, expected.fault)
    try:
        def named() -> bool:
            stage = the_entry(proxy).get("engine_stage") or {}
            return stage.get("stage") == expected.stage

        assert wait_until(named, timeout=10), the_entry(proxy)
        stage = the_entry(proxy)["engine_stage"]
        assert (stage["component"], stage["role"], stage["state"], stage["source"]) == (
            expected.component, expected.role, "in", "spans")
        # The simulated workers run in this process: the worker is this host and this pid.
        assert stage["worker"] == {"service": "sglang", "host": host_id(), "pid": os.getpid()}
        def stalled() -> bool:
            verdict = the_entry(proxy)["verdict"] or {}
            return verdict.get("stalled") and verdict.get("outcome") in expected.verdicts

        assert wait_until(stalled, timeout=10), the_entry(proxy)
        verdict = the_entry(proxy)["verdict"]
        assert (verdict["blame"], verdict["component"]) == ("engine", expected.component)
    finally:
        let_go(harness, client)


def test_the_receiver_relays_what_it_received(traced_proxy):
    _, proxy = traced_proxy
    counts = json.loads(admin_get(proxy, "/debug/inflight"))["engine_spans"]
    assert counts["spans_received"] > 0 and sum(counts["rejected"].values()) == 0
    assert counts["spans_relayed"] == 0  # tracing off in these tests: kept for the join, relayed nowhere


# ----------------------------------------------------------------------------------
# the receiver off: gauges labelled by role
# ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deployment(loop_thread):
    requires_sglang_router()
    with RouterHarness(loop_thread, "sglang-router") as harness:
        yield harness


@pytest.mark.parametrize("expected", HANGS, ids=IDS)
def test_with_the_receiver_off_the_gauges_by_role_name_the_component(deployment, start_proxy, expected):
    harness = deployment
    harness.reset()
    router = harness.deployment.router
    proxy = start_proxy(harness.router_url, **{
        "engines.prefill_metrics_urls": [f"{harness.prefill.url}/metrics"],
        "engines.decode_metrics_urls": [f"{harness.decode.url}/metrics"],
        "engines.router_metrics_urls": [f"http://127.0.0.1:{router.prometheus_port}/metrics"],
        "engines.scrape_interval": 0.2})
    assert proxy.engine_side.receiver is None
    client = hang(harness, proxy, expected.fault)
    try:
        def named() -> bool:  # the router's count scraped with the workers' (it may lag them by a scrape)
            stage = the_entry(proxy).get("engine_stage") or {}
            running = re.search(r"router (\d+) running$", stage.get("detail", ""))
            # At least this one: sglang-router 0.3.2 still counts the earlier tests' requests, whose
            # clients left before their answer (see observe/engines.py).
            return stage.get("stage") == expected.stage and running and int(running.group(1)) >= 1

        assert wait_until(named, timeout=10), the_entry(proxy).get("engine_stage")
        stage = the_entry(proxy)["engine_stage"]
        assert (stage["component"], stage["role"], stage["source"]) == (expected.component, expected.role, "gauges")
    finally:
        let_go(harness, client)
