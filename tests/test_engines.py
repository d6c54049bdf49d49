"""Correlation with the engines: the pure cross-check rules, then the scraper live.

(a) table-driven tests of ``lifecycle.correlation`` and the exposition parser;
(b) the ``pinned_request`` fault behind the real router is reported as an engine
orphan (EOR) and no client request is blamed; (c) a request waiting for its head
while the engines hold nothing is "lost" (LST) in ``/debug/inflight``; (d) a dead
and a slow metrics endpoint are counted as failures while requests keep flowing.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest

from traceproxy.lifecycle import correlation
from traceproxy.lifecycle.correlation import OrphanState, check_orphans, correlate
from traceproxy.lifecycle.flags import Blame, Flag
from traceproxy.lifecycle.machine import Phase
from traceproxy.observe.metrics import prometheus_totals
from traceproxy.sim.engine import SimWorker
from traceproxy.sim.launch import SimDeployment

from .support import RawClient, admin_get, admin_metric, never_answers, wait_until

S = 1_000_000_000
JSON = [("Content-Type", "application/json")]
CHAT = json.dumps({"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 3, "stream": True}).encode()


def inflight(proxy) -> dict:
    return json.loads(admin_get(proxy, "/debug/inflight"))


# ----------------------------------------------------------------------------------
# (a) the rules, pure
# ----------------------------------------------------------------------------------
def test_new_outcomes_blame_as_documented():
    assert Flag.EOR.blame is Blame.ENGINE and Flag.ESL.blame is Blame.ENGINE
    assert Flag.LST.blame is Blame.UNKNOWN
    assert all(o.local_status is None for o in (Flag.EOR, Flag.LST, Flag.ESL))


PD = {"sglang:num_running_reqs": 1, "sglang:num_decode_prealloc_queue_reqs": 0}


@pytest.mark.parametrize("endpoints, work", [
    ([], 0.0),
    ([{"sglang:num_running_reqs": 2, "sglang:num_queue_reqs": 3}], 5.0),
    # One PD request, counted on prefill (running) and decode (prealloc): once, not twice.
    ([{"sglang:num_running_reqs": 1}, {"sglang:num_decode_prealloc_queue_reqs": 1}], 1.0),
    ([{"sglang:num_prefill_inflight_queue_reqs": 1}, {"smg_active_workers": 7}], 1.0),
])
def test_engine_work_is_the_largest_endpoint_total(endpoints, work):
    assert correlation.engines_work(endpoints) == work


@pytest.mark.parametrize("prev, engine, proxy, now, expected", [
    (OrphanState(), 0, 0, 10 * S, OrphanState()),
    (OrphanState(), 1, 1, 10 * S, OrphanState()),  # explained by the proxy's request
    (OrphanState(), 1, 0, 10 * S, OrphanState(1, 10 * S, False)),  # starts
    (OrphanState(1, 10 * S, False), 1, 0, 39 * S, OrphanState(1, 10 * S, False)),  # not yet 30 s
    (OrphanState(1, 10 * S, False), 2, 0, 40 * S, OrphanState(2, 10 * S, True)),  # reported
    (OrphanState(2, 10 * S, True), 2, 2, 41 * S, OrphanState()),  # cleared
])
def test_orphan_rule(prev, engine, proxy, now, expected):
    assert check_orphans(prev, engine, proxy, now, 30 * S) == expected


@pytest.mark.parametrize("phase, since, work, streaming, scraped, expected", [
    (Phase.AWAITING_UPSTREAM_HEADERS, 0, None, 0, None, None),  # no scrape yet
    (Phase.AWAITING_UPSTREAM_HEADERS, 0, 0, 0, 2 * S, Flag.LST),  # nothing at the engines
    (Phase.AWAITING_UPSTREAM_HEADERS, 0, 0, 0, S // 2, None),  # too fresh to call lost
    (Phase.AWAITING_UPSTREAM_HEADERS, 3 * S, 0, 0, 2 * S, None),  # sent after the scrape
    (Phase.AWAITING_UPSTREAM_HEADERS, 0, 1, 0, 2 * S, Flag.ESL),
    (Phase.STREAMING_RESPONSE, 0, 1, 1, 2 * S, Flag.ESL),
    (Phase.STREAMING_RESPONSE, 0, 1, 0, 2 * S, None),
    (Phase.AWAITING_REQUEST_BODY, 0, 0, 0, 2 * S, None),  # the client's turn: engines irrelevant
])
def test_per_request_correlation(phase, since, work, streaming, scraped, expected):
    assert correlate(phase, since, work, streaming, scraped) is expected


def test_scraped_exposition_keeps_work_gauges_and_router_series_summed_over_labels():
    text = "\n".join([
        "# HELP sglang:num_running_reqs x", "# TYPE sglang:num_running_reqs gauge",
        'sglang:num_running_reqs{model_name="a"} 2', 'sglang:num_running_reqs{model_name="b}"} 1.0',
        'sglang:num_queue_reqs 4 1700000000', "sglang:prompt_tokens_total 99",
        'smg_router_active_requests{route="x"} 3', "smg_http_errors_total 5", "smg_uptime 1",
        "sglang:num_queue_reqs{broken", ""])
    assert prometheus_totals(text, correlation.is_kept) == {
        "sglang:num_running_reqs": 3.0, "sglang:num_queue_reqs": 4.0,
        "smg_router_active_requests": 3.0, "smg_http_errors_total": 5.0}


def test_summary_names_each_reported_gauge():
    assert correlation.summary([{"sglang:num_running_reqs": 1, "sglang:num_queue_reqs": 0},
                                {"sglang:num_prefill_inflight_queue_reqs": 1}]) == \
        "running=1 queued=0 prefill_inflight=1"


# ----------------------------------------------------------------------------------
# (b) the pinned request behind the real router: an engine orphan, no client blamed
# ----------------------------------------------------------------------------------
class Done:
    def __init__(self) -> None:
        self.records = []

    def on_done(self, record) -> None:
        self.records.append(record)


def test_pinned_request_is_an_engine_orphan_and_no_client_request_is_blamed(loop_thread, start_proxy, caplog):
    pytest.importorskip("sglang_router", reason="sglang-router cannot be imported", exc_type=ImportError)
    dep = SimDeployment(router=True)
    loop_thread.run(dep.start(), timeout=90)
    try:
        done = Done()
        urls = [f"{dep.router_url}/metrics", f"{dep.prefill.url}/metrics", f"{dep.decode.url}/metrics"]
        proxy = start_proxy(dep.router_url, observers=[done], **{
            "engines.metrics_urls": urls, "engines.scrape_interval": 0.2, "engines.orphan_after": 0.5})
        dep.prefill.set_faults(["pinned_request"])
        resp = RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", JSON, CHAT)
        assert resp.status == 200 and resp.complete
        dep.prefill.set_faults([])
        assert wait_until(lambda: admin_metric(proxy, "traceproxy_engine_orphaned_requests") > 0, timeout=5)
        assert admin_metric(proxy, "traceproxy_engine_orphans_total") == 1
        view = inflight(proxy)
        orphan = view["correlation"]["orphan"]
        assert orphan["outcome"] == "EOR" and orphan["blame"] == "engine" and orphan["reported"]
        prefill = view["engines"][f"{dep.prefill.url}/metrics"]
        assert prefill["gauges"]["sglang:num_prefill_inflight_queue_reqs"] == 1 and prefill["error"] is None
        assert any("engine orphan EOR" in r.getMessage() for r in caplog.records)
        # The finished request is OK, and so is every request the proxy counted.
        assert [r.outcome.code for r in done.records] == ["OK"]
        outcomes = re.findall(r'^traceproxy_requests_total{[^}]*outcome="(\w+)"', admin_get(proxy, "/metrics"), re.M)
        assert outcomes == ["OK"]
    finally:
        loop_thread.run(dep.stop(), timeout=30)


# ----------------------------------------------------------------------------------
# (c) waiting for a first byte while the engines hold nothing: lost
# ----------------------------------------------------------------------------------
def test_request_waiting_for_its_head_with_idle_engines_is_lost(loop_thread, start_proxy, scripted_upstream):
    worker = loop_thread.run(SimWorker("prefill").start())
    try:
        up = scripted_upstream(never_answers)
        proxy = start_proxy(up.url, **{"engines.metrics_urls": [f"{worker.url}/metrics"],
                                       "engines.scrape_interval": 0.2})
        client = RawClient(proxy.port)
        client.request("GET", "/v1/models")

        def lost():
            view = inflight(proxy)
            entries = [e for e in view["requests"] if e["correlation"]]
            return entries and entries[0]["correlation"]["outcome"] == "LST" and view

        assert wait_until(lost, timeout=5)
        view = lost()
        [entry] = view["requests"]
        assert entry["phase"] == "awaiting_upstream_headers"
        assert entry["correlation"]["blame"] == "unknown"
        assert entry["verdict"]["outcome"] == "FBS"  # the watchdog's verdict is unchanged
        assert view["correlation"]["requests"] == {"LST": 1}
        client.close()
    finally:
        loop_thread.run(worker.stop())


# ----------------------------------------------------------------------------------
# (d) a dead and a slow endpoint never slow the proxy down
# ----------------------------------------------------------------------------------
async def accepts_and_waits(reader, writer, upstream):
    await asyncio.sleep(3600)


def roundtrips(port: int, n: int) -> list[int]:
    client = RawClient(port)
    statuses = [client.roundtrip("GET", "/").status for _ in range(n)]
    client.close()
    return statuses


def test_dead_and_slow_endpoints_are_counted_and_requests_keep_flowing(loop_thread, start_proxy, fast_upstream,
                                                                      scripted_upstream, dead_upstream):
    up = fast_upstream()
    slow = scripted_upstream(accepts_and_waits)
    dead = f"{dead_upstream}/metrics"
    baseline = start_proxy(up.url)
    assert baseline.engines is None  # the default: nothing starts
    expected = roundtrips(baseline.port, 300)  # whatever the fast upstream answers, every time
    assert len(set(expected)) == 1 and expected[0] < 500

    proxy = start_proxy(up.url, **{"engines.metrics_urls": [dead, f"{slow.url}/metrics"],
                                   "engines.scrape_interval": 0.05, "engines.scrape_timeout": 0.2})
    lags = []

    async def loop_lag():
        # How late a 10 ms sleep wakes up, while the scraper fails over and over.
        for _ in range(50):
            start = time.monotonic()
            await asyncio.sleep(0.01)
            lags.append(time.monotonic() - start - 0.01)

    lag_future = asyncio.run_coroutine_threadsafe(loop_lag(), loop_thread.loop)
    assert roundtrips(proxy.port, 300) == expected
    lag_future.result(timeout=10)
    assert wait_until(lambda: proxy.engines.endpoints[f"{slow.url}/metrics"].errors >= 2, timeout=5)
    assert admin_metric(proxy, "traceproxy_engine_scrape_errors_total") >= 3
    view = inflight(proxy)["engines"]
    assert view[dead]["error"] and view[f"{slow.url}/metrics"]["error"].startswith("TimeoutError")
    # Below the scrape timeout (0.2 s): a scrape that blocked the loop would show as a
    # lag of up to that long; a healthy loop wakes within milliseconds.
    assert max(lags) < 0.15, lags


# ----------------------------------------------------------------------------------
# Answers that must not read as "the engines hold nothing" or stall the proxy
# ----------------------------------------------------------------------------------
def test_exposition_tokens_split_by_tabs_and_non_finite_work_skipped():
    text = 'sglang:num_running_reqs\t4\nsglang:num_queue_reqs{a="b"}\t5\t1700000000\n' \
           'sglang:num_prefill_inflight_queue_reqs NaN\nsmg_router_active_requests +Inf\n'
    assert prometheus_totals(text, correlation.is_kept, finite_only=True) == {
        "sglang:num_running_reqs": 4.0, "sglang:num_queue_reqs": 5.0}
    # Our own exposition says "not known yet" with NaN: read as it is when asked for everything.
    assert str(prometheus_totals("x NaN\n")["x"]) == "nan"


def test_an_answer_without_samples_is_a_scrape_failure_and_an_empty_one_is_not():
    from traceproxy.observe.engines import _parse

    with pytest.raises(ValueError, match="no Prometheus samples"):
        _parse(b"<html><body>Not the metrics</body></html>\n")
    assert _parse(b"") == {}
    assert _parse(b"# only comments\n") == {}
    assert _parse(b"other_metric 1\n") == {}  # Prometheus text, just none of the engine gauges


async def answers_too_much(reader, writer, upstream):
    await reader.readuntil(b"\r\n\r\n")
    size = 6 << 20
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % size)
    line = b"x_filler_metric 1\n"
    for _ in range(size // len(line)):
        writer.write(line)
    await writer.drain()
    await asyncio.sleep(3600)


async def answers_html(reader, writer, upstream):
    await reader.readuntil(b"\r\n\r\n")
    body = b"<html><body>login</body></html>"
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()


def test_an_oversized_or_html_metrics_answer_is_an_error_not_idle_engines(loop_thread, start_proxy, fast_upstream,
                                                                          scripted_upstream):
    up = fast_upstream()
    huge, html = scripted_upstream(answers_too_much), scripted_upstream(answers_html)
    proxy = start_proxy(up.url, **{"engines.metrics_urls": [f"{huge.url}/metrics", f"{html.url}/metrics"],
                                   "engines.scrape_interval": 0.2, "engines.scrape_timeout": 2.0})
    assert wait_until(lambda: all(ep.errors >= 1 for ep in proxy.engines.endpoints.values()), timeout=10)
    view = inflight(proxy)["engines"]
    assert "larger than 4 MiB" in view[f"{huge.url}/metrics"]["error"]
    assert "no Prometheus samples" in view[f"{html.url}/metrics"]["error"]
    assert inflight(proxy)["correlation"]["engine_in_flight"] is None  # nothing known, not "zero work"


def test_debug_inflight_json_has_no_nan_or_infinity():
    from traceproxy.admin import _dumps

    text = _dumps({"engines": {"u": {"gauges": {"a": float("nan"), "b": float("inf"), "c": 1.5}}},
                   "requests": [{"age_s": float("-inf")}]})
    document = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in JSON"))
    assert document == {"engines": {"u": {"gauges": {"a": None, "b": None, "c": 1.5}}}, "requests": [{"age_s": None}]}
