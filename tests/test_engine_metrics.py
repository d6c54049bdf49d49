"""The engine span receivers' counts as Prometheus families on /metrics, read with the real
prometheus-client parser: what was taken, refused by reason, kept, dropped for lack of room
and relayed; declared without samples while the receivers are off."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .sglang_spans import Request, payload, random_trace_id
from .support import admin_get, wait_until

RECEIVER = {"engines.otlp_receiver": "127.0.0.1:0"}
FAMILIES = ("traceproxy_engine_span_requests", "traceproxy_engine_span_requests_rejected",
            "traceproxy_engine_spans_received", "traceproxy_engine_spans_kept", "traceproxy_engine_spans_dropped",
            "traceproxy_engine_spans_relayed", "traceproxy_engine_spans_relay_dropped",
            "traceproxy_engine_span_traces", "traceproxy_engine_span_traces_evicted")


def families(text: str) -> dict:
    """Family name (counters without _total, as the parser names them) -> {labels tuple: value}."""
    found = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("traceproxy_engine_span"):
            assert family.name not in found, f"{family.name} twice"
            found[family.name] = {tuple(sorted(s.labels.items())): s.value for s in family.samples
                                  if not s.name.endswith("_created")}
    return found


def post(port: int, body: bytes) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/traces", data=body, method="POST",
                                     headers={"Content-Type": "application/x-protobuf"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_receivers_counts_are_families_on_metrics(start_proxy, fast_upstream):
    proxy = start_proxy(fast_upstream().url, **RECEIVER, **{"engines.span_traces": 16})
    port = proxy.engine_side.receiver.http_port
    for _ in range(3):  # 18 traces with work at the engines, in a store of 16
        spans = [span for _ in range(6) for span in Request(random_trace_id(), "prefill").stages(2)]
        assert post(port, payload(spans)) == 200
    assert post(port, b"\x0a\xff\xff\xff\x0f") == 400

    def scraped() -> dict:
        return families(admin_get(proxy, "/metrics"))

    # The receivers' process reports its counts every second: a report can come between
    # the spans and the malformed request, so wait for the last of them to be counted.
    malformed = (("reason", "malformed"),)
    assert wait_until(lambda: scraped().get("traceproxy_engine_span_requests_rejected", {}).get(malformed) == 1,
                      timeout=5)
    found = scraped()
    assert set(found) == set(FAMILIES)
    assert found["traceproxy_engine_span_requests"] == {(): 3}
    assert found["traceproxy_engine_span_requests_rejected"] == {
        (("reason", "malformed"),): 1, (("reason", "too_large"),): 0, (("reason", "unsupported_media_type"),): 0}
    assert found["traceproxy_engine_spans_kept"] == {(): 36}
    assert found["traceproxy_engine_span_traces"] == {(): 16}
    assert found["traceproxy_engine_span_traces_evicted"] == {(): 2}
    assert found["traceproxy_engine_spans_dropped"] == {(): 4}  # two spans each, their work still at the engines
    assert found["traceproxy_engine_spans_relayed"] == {(): 0}  # the tests' proxy sends its spans nowhere
    assert found["traceproxy_engine_spans_relay_dropped"] == {(): 0}
    # In OpenMetrics too, which Prometheus asks for with exemplars on.
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families

    asked = urllib.request.Request(f"http://127.0.0.1:{proxy.admin_port}/metrics",
                                   headers={"Accept": "application/openmetrics-text"})
    with urllib.request.urlopen(asked, timeout=5) as answer:
        text = answer.read().decode()
    names = {family.name for family in openmetrics_families(text)}
    assert set(FAMILIES) <= names


def test_with_the_receivers_off_the_families_are_declared_without_samples(start_proxy, fast_upstream):
    proxy = start_proxy(fast_upstream().url)
    found = families(admin_get(proxy, "/metrics"))
    assert set(found) == set(FAMILIES)
    assert all(samples == {} for samples in found.values()), found


@pytest.mark.parametrize("key", ["engines.otlp_receiver", "engines.otlp_receiver_grpc"])
def test_either_receiver_alone_gives_the_families(start_proxy, fast_upstream, key):
    proxy = start_proxy(fast_upstream().url, **{key: "127.0.0.1:0"})
    assert wait_until(lambda: families(admin_get(proxy, "/metrics"))["traceproxy_engine_span_requests"] == {(): 0},
                      timeout=5)
