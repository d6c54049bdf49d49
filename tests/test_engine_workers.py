"""With ``--workers N`` the service's parent receives the engine spans, once for the service,
and each worker names its own requests with the stages the parent sends it."""

from __future__ import annotations

import json

import grpc
from prometheus_client.parser import text_string_to_metric_families

from traceproxy.sim.launch import free_port

from .sglang_spans import Request, payload, random_trace_id
from .support import RawClient, ScriptedUpstream, never_answers, wait_until
from .test_workers_view import serving

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
HELD = 6


def trace_ids(upstream: ScriptedUpstream) -> list[int]:
    found = []
    for seen in upstream.received:
        head = bytes(seen).lower()
        if b"traceparent: 00-" in head:
            found.append(int(head.split(b"traceparent: 00-")[1][:32], 16))
    return found


def test_the_parent_receives_and_every_worker_names_its_requests(loop_thread):
    upstream = loop_thread.run(ScriptedUpstream(never_answers).start())
    receiver = free_port()
    try:
        with serving(upstream.url, 2, "--engines-otlp-receiver-grpc", f"127.0.0.1:{receiver}",
                     env={"TRACEPROXY_ENGINES_ORPHAN_AFTER": "0.3"}) as service:
            clients = [RawClient(service.port) for _ in range(HELD)]
            try:
                for client in clients:
                    client.request("POST", "/v1/chat/completions", [("Content-Type", "application/json")], CHAT)
                assert wait_until(lambda: len(trace_ids(upstream)) == HELD, timeout=10)
                orphan = random_trace_id()
                with grpc.insecure_channel(f"127.0.0.1:{receiver}") as channel:
                    export = channel.unary_unary(EXPORT)
                    spans = [span for trace_id in trace_ids(upstream)
                             for span in Request(trace_id, "prefill").stages(4)]
                    export(payload(spans), timeout=5)
                    export(payload(Request(orphan, "decode").stages(2)), timeout=5)  # no request here has it

                def all_named() -> bool:
                    entries = service.json("/debug/inflight")["requests"]
                    return len(entries) == HELD and all(
                        (e.get("engine_stage") or {}).get("stage") == "prefill_transfer_kv_cache" for e in entries)

                assert wait_until(all_named, timeout=10), service.json("/debug/inflight")["requests"]
                view = service.json("/debug/inflight")
                assert {e["engine_stage"]["component"] for e in view["requests"]} == {"kv_transfer"}
                assert view["engine_spans"]["spans_received"] == 4 * HELD + 2
                # On /metrics once, for the service: the parent's receiver, not once per worker.
                received = [sample.value for family in text_string_to_metric_families(service.get("/metrics")[1])
                            for sample in family.samples if sample.name == "traceproxy_engine_spans_received_total"]
                assert received == [4 * HELD + 2], received
                # The service's parent sees every worker's requests: only the orphan is unexplained.
                assert wait_until(lambda: [w["trace_id"] for w in service.json("/debug/inflight")["correlation"][
                    "orphan"]["engine_work"]] == ["%032x" % orphan], timeout=5)
            finally:
                for client in clients:
                    client.close()
    finally:
        loop_thread.run(upstream.stop())
