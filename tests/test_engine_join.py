"""The live join on a running proxy: a hung request named by the PD component, SGLang stage
and worker that hold it, from engine spans sent to the receiver or, without them, from
gauges labelled by role; the same facts in /debug/inflight, the stall log line, the stall
span and the access log line; a request no engine opened is the router's; engine work no
request explains is named in the orphan's line."""

from __future__ import annotations

import http.client
import json
import logging
import re

import pytest
from aiohttp import web

from traceproxy.diagnose import file_spans
from traceproxy.observe import semconv as sc

from .sglang_spans import HOST_ID, Request, payload, random_trace_id
from .support import RawClient, admin_get, never_answers, wait_until

JSON = [("Content-Type", "application/json")]
CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
RECEIVER = {"engines.otlp_receiver": "127.0.0.1:0"}
TRACEPARENT = re.compile(rb"traceparent: 00-([0-9a-f]{32})-", re.I)


def inflight(proxy) -> dict:
    return json.loads(admin_get(proxy, "/debug/inflight"))


_EXPORTERS: dict[int, http.client.HTTPConnection] = {}


def send_spans(proxy, spans, **resource) -> None:
    """As an engine's OTLP/HTTP exporter sends them: on one keep-alive connection, which
    is how the receiver tells one exporting worker from another."""
    port = proxy.engine_side.receiver.http_port
    connection = _EXPORTERS.setdefault(port, http.client.HTTPConnection("127.0.0.1", port, timeout=5))
    connection.request("POST", "/v1/traces", payload(spans, **resource), {"Content-Type": "application/x-protobuf"})
    answer = connection.getresponse()
    answer.read()
    assert answer.status == 200


def hang_one(proxy, upstream) -> tuple[RawClient, int]:
    """A request the upstream never answers; the trace id the upstream saw."""
    client = RawClient(proxy.port)
    client.request("POST", "/v1/chat/completions", JSON, CHAT)
    assert wait_until(lambda: upstream.received and TRACEPARENT.search(bytes(upstream.received[-1])))
    return client, int(TRACEPARENT.search(bytes(upstream.received[-1])).group(1), 16)


def engine_stage(proxy) -> dict | None:
    [entry] = inflight(proxy)["requests"]
    return entry.get("engine_stage")


def test_a_hung_request_is_named_by_its_engine_stage_everywhere(start_proxy, scripted_upstream, tmp_path, caplog):
    caplog.set_level(logging.WARNING, "traceproxy.watchdog")
    upstream = scripted_upstream(never_answers)
    spans_path, access_path = tmp_path / "spans.jsonl", tmp_path / "access.log"
    proxy = start_proxy(upstream.url, **RECEIVER, **{
        "stall.first_byte": 2.0, "tracing.exporter": "file", "tracing.file_path": str(spans_path),
        "access_log.path": str(access_path)})
    client, trace_id = hang_one(proxy, upstream)
    # Sent well before the stall (2 s), so that its line and span can say where the engines have it.
    # A finished request on the same prefill worker taught its host and pid.
    done = Request(random_trace_id(), "prefill", pid=314)
    send_spans(proxy, done.stages(5) + done.finish())
    send_spans(proxy, Request(trace_id, "prefill").stages(4) + Request(trace_id, "decode").stages(2))
    assert wait_until(lambda: engine_stage(proxy) is not None)
    stage = engine_stage(proxy)
    assert {k: v for k, v in stage.items() if k != "since_s"} == {
        "component": "kv_transfer", "role": "prefill", "stage": "prefill_transfer_kv_cache", "state": "in",
        "worker": {"service": "sglang", "host": HOST_ID, "pid": 314}, "source": "spans"}
    assert stage["since_s"] >= 0
    # The stall: its verdict keeps FBS and blames the engine, and names the component.
    assert wait_until(lambda: (inflight(proxy)["requests"][0]["verdict"] or {}).get("stalled"), timeout=5)
    verdict = inflight(proxy)["requests"][0]["verdict"]
    assert (verdict["outcome"], verdict["blame"], verdict["component"]) == ("FBS", "engine", "kv_transfer")
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stall FBS")]
    assert "blame engine (kv_transfer);" in line
    assert line.endswith(f"engine_stage: kv_transfer (prefill prefill_transfer_kv_cache, sglang host {HOST_ID[:8]} "
                         "pid 314; from spans)")
    # The stall span, exported at once, says the same.
    assert wait_until(lambda: any(s.name.startswith("stall FBS") for s in file_spans(spans_path, "%032x" % trace_id)))
    [stall] = [s for s in file_spans(spans_path, "%032x" % trace_id) if s.name.startswith("stall FBS")]
    assert {key: stall.attributes.get(key) for key in (
        sc.ENGINE_COMPONENT, sc.ENGINE_ROLE, sc.ENGINE_STAGE, sc.ENGINE_STAGE_STATE, sc.ENGINE_SOURCE,
        sc.ENGINE_WORKER_SERVICE, sc.ENGINE_WORKER_HOST, sc.ENGINE_WORKER_PID)} == {
        sc.ENGINE_COMPONENT: "kv_transfer", sc.ENGINE_ROLE: "prefill", sc.ENGINE_STAGE: "prefill_transfer_kv_cache",
        sc.ENGINE_STAGE_STATE: "in", sc.ENGINE_SOURCE: "spans", sc.ENGINE_WORKER_SERVICE: "sglang",
        sc.ENGINE_WORKER_HOST: HOST_ID, sc.ENGINE_WORKER_PID: 314}
    # The client gives up: its access log line says where the engines had the request.
    client.close()
    assert wait_until(lambda: access_path.exists() and "%032x" % trace_id in access_path.read_text(), timeout=10)
    [logged] = [json.loads(x) for x in access_path.read_text().splitlines() if "%032x" % trace_id in x]
    assert logged["outcome"] == "DC" and logged["engine_stage"]["stage"] == "prefill_transfer_kv_cache"
    assert logged["engine_stage"]["component"] == "kv_transfer" and logged["engine_stage"]["source"] == "spans"
    # So does its own span, which diagnose reads after the fact.
    assert wait_until(lambda: any(s.kind == "server" for s in file_spans(spans_path, "%032x" % trace_id)), timeout=10)
    [server] = [s for s in file_spans(spans_path, "%032x" % trace_id) if s.kind == "server"]
    assert server.attributes[sc.ENGINE_COMPONENT] == "kv_transfer"
    assert server.attributes[sc.ENGINE_STAGE] == "prefill_transfer_kv_cache"


def test_a_request_no_engine_opened_is_the_routers(start_proxy, scripted_upstream):
    upstream = scripted_upstream(never_answers)
    proxy = start_proxy(upstream.url, **RECEIVER, **{"engines.span_settle": 0.3})
    client, _ = hang_one(proxy, upstream)
    assert engine_stage(proxy) is None  # no engine exports here yet: nothing is said
    send_spans(proxy, Request(random_trace_id(), "prefill").stages(1))  # now engines do, of other requests
    assert wait_until(lambda: engine_stage(proxy) is not None)
    stage = engine_stage(proxy)
    assert (stage["component"], stage["role"], stage["stage"], stage["source"]) == ("router", "router", None, "spans")
    assert stage["since_s"] >= 0.3 and stage["worker"] is None
    client.close()


def test_a_finished_request_no_engine_opened_names_the_router_once_settled():
    from types import SimpleNamespace

    from traceproxy.lifecycle.marks import MARK
    from traceproxy.lifecycle.timeline import Attempt, ClientConnectionRecord, RequestRecord
    from traceproxy.observe.engine_join import EngineStageJoin

    stages = SimpleNamespace(stage_of=lambda trace_id: None, seen_engine_spans=True)
    join = EngineStageJoin(stages, settle_s=0.3, clock_offset_ns=0)

    def finished(sent_ns: int, answered_ns: int, end_ns: int) -> RequestRecord:
        marks = {MARK.FIRST_UPSTREAM_TX_BYTE: sent_ns}
        if answered_ns:
            marks[MARK.FIRST_UPSTREAM_RX_BYTE] = answered_ns
        return RequestRecord(connection=ClientConnectionRecord(peer="127.0.0.1:5", opened_ns=0), sequence=1,
                             idle_gap_ns=None, trace_id=7, end_ns=end_ns, attempts=[Attempt(index=0, marks=marks)])

    stage = join.stage_at_end(finished(1_000_000_000, 0, 1_400_000_000))
    assert (stage["component"], stage["role"], stage["source"]) == ("router", "router", "spans")
    assert join.stage_at_end(finished(1_000_000_000, 0, 1_200_000_000)) is None  # not settled yet
    assert join.stage_at_end(finished(1_000_000_000, 1_100_000_000, 1_400_000_000)) is None  # answered


def test_with_the_receiver_off_nothing_changes(start_proxy, scripted_upstream, caplog):
    caplog.set_level(logging.WARNING, "traceproxy.watchdog")
    upstream = scripted_upstream(never_answers)
    proxy = start_proxy(upstream.url, **{"stall.first_byte": 0.3})
    client, _ = hang_one(proxy, upstream)
    assert wait_until(lambda: any(r.getMessage().startswith("stall FBS") for r in caplog.records), timeout=5)
    [entry] = inflight(proxy)["requests"]
    assert "engine_stage" not in entry and "component" not in entry["verdict"]
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stall FBS")]
    assert "engine_stage" not in line and "blame engine;" in line
    client.close()


# ----------------------------------------------------------------------------------
# gauges labelled by role, without spans
# ----------------------------------------------------------------------------------
class GaugeServer:
    """``/prefill``, ``/decode``, ``/router``: Prometheus text from ``gauges[path]``."""

    def __init__(self) -> None:
        self.gauges: dict[str, dict[str, float]] = {"prefill": {}, "decode": {}, "router": {}}
        self.runner = None
        self.port = 0

    async def start(self) -> "GaugeServer":
        app = web.Application()
        app.router.add_get("/{role}", self._answer)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def _answer(self, request: web.Request) -> web.Response:
        lines = [f'{name}{{model_name="m"}} {value}' for name, value in self.gauges[request.match_info["role"]].items()]
        return web.Response(text="\n".join(lines) + "\n")

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.port}/{role}"

    async def stop(self) -> None:
        await self.runner.cleanup()


@pytest.fixture
def gauge_server(loop_thread):
    server = loop_thread.run(GaugeServer().start())
    yield server
    loop_thread.run(server.stop())


def by_role(server: GaugeServer) -> dict:
    return {f"engines.{role}_metrics_urls": [server.url(role)] for role in ("prefill", "decode", "router")}


def test_without_spans_gauges_by_role_name_the_component(start_proxy, scripted_upstream, gauge_server, caplog):
    caplog.set_level(logging.WARNING, "traceproxy.watchdog")
    gauge_server.gauges = {"prefill": {"sglang:num_prefill_inflight_queue_reqs": 1},
                           "decode": {"sglang:num_decode_transfer_queue_reqs": 1},
                           "router": {"smg_http_requests_total": 5, "smg_http_responses_total": 4}}
    upstream = scripted_upstream(never_answers)
    proxy = start_proxy(upstream.url, **by_role(gauge_server), **{"engines.scrape_interval": 0.1,
                                                                 "stall.first_byte": 0.5})
    client, _ = hang_one(proxy, upstream)
    assert wait_until(lambda: engine_stage(proxy) is not None)
    assert engine_stage(proxy) == {
        "component": "kv_transfer", "role": "prefill", "stage": "prefill_transfer_kv_cache", "state": "in",
        "worker": None, "since_s": None, "source": "gauges",
        "detail": "prefill holds 1 in its KV-transfer queue, decode holds 1 in its KV-transfer queue, router 1 running"}
    assert wait_until(lambda: any(r.getMessage().startswith("stall FBS") for r in caplog.records), timeout=5)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stall FBS")]
    assert "blame engine (kv_transfer);" in line and "from gauges" in line and "router 1 running" in line
    # The workers empty, the router holding it: the router has it.
    gauge_server.gauges["prefill"], gauge_server.gauges["decode"] = {}, {}
    assert wait_until(lambda: engine_stage(proxy)["component"] == "router")
    assert engine_stage(proxy)["detail"] == "prefill 0, decode 0, router 1 running"
    client.close()


def test_unlabelled_metrics_urls_name_no_component(start_proxy, scripted_upstream, gauge_server):
    gauge_server.gauges["prefill"] = {"sglang:num_prefill_inflight_queue_reqs": 1}
    upstream = scripted_upstream(never_answers)
    proxy = start_proxy(upstream.url, **{"engines.metrics_urls": [gauge_server.url("prefill")],
                                         "engines.scrape_interval": 0.1})
    client, _ = hang_one(proxy, upstream)
    assert wait_until(lambda: inflight(proxy)["engines"][gauge_server.url("prefill")]["last_scrape_age_s"] is not None)
    assert engine_stage(proxy) is None
    client.close()


# ----------------------------------------------------------------------------------
# engine work no request in flight explains
# ----------------------------------------------------------------------------------
def test_an_engine_orphan_names_the_worker_and_stage_of_the_work_nobody_waits_for(start_proxy, fast_upstream,
                                                                                 gauge_server, caplog):
    caplog.set_level(logging.WARNING, "traceproxy.engines")
    gauge_server.gauges["prefill"] = {"sglang:num_prefill_inflight_queue_reqs": 1}
    proxy = start_proxy(fast_upstream().url, **RECEIVER, **by_role(gauge_server), **{
        "engines.scrape_interval": 0.1, "engines.orphan_after": 0.3})
    pinned = random_trace_id()
    done = Request(random_trace_id(), "prefill", pid=99)
    send_spans(proxy, done.stages(5) + done.finish())
    send_spans(proxy, Request(pinned, "prefill").stages(4))  # its KV transfer never ends, and no client waits
    assert wait_until(lambda: any("trace_id=%032x" % pinned in r.getMessage() for r in caplog.records), timeout=10)
    [line] = [r.getMessage() for r in caplog.records if "trace_id=%032x" % pinned in r.getMessage()]
    assert line.startswith("engine orphan EOR:")
    assert line.endswith(f"kv_transfer (prefill prefill_transfer_kv_cache, sglang host {HOST_ID[:8]} pid 99; "
                         "from spans)")
    orphan = inflight(proxy)["correlation"]["orphan"]
    assert orphan["reported"] and orphan["engine_work_total"] == 1
    [work] = orphan["engine_work"]
    assert (work["trace_id"], work["component"], work["stage"], work["worker"]["pid"]) == (
        "%032x" % pinned, "kv_transfer", "prefill_transfer_kv_cache", 99)


def test_unlabelled_metrics_urls_alone_put_nothing_on_the_request_path(start_proxy, fast_upstream, gauge_server):
    proxy = start_proxy(fast_upstream().url, **{"engines.metrics_urls": [gauge_server.url("prefill")],
                                                "tracing.exporter": "console"})
    assert proxy.engine_side.readings.join is None
    assert type(proxy.tracing.sink).__name__ == "SpanExportPipe"  # not wrapped: nothing looked up per request
    assert RawClient(proxy.port).roundtrip("GET", "/v1/models").status == 200
