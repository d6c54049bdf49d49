"""GET /metrics end to end: the exposition parses, counters move by exactly the
requests made, histograms are cumulative, the in-flight gauge and the stall
counters show a stuck request while it is stuck, the pool counters show reuse and
resends, and closed client connections land in their histogram."""

from __future__ import annotations

import re
import urllib.request

from traceproxy.lifecycle.machine import Phase
from traceproxy.observe.metrics import Histogram, format_labels, prometheus_totals

from .support import RawClient, admin_get, answers_in_parts, answers_then_drops_next_request, never_answers, wait_until

FAST = {"stall.client_headers": 0.3, "stall.client_body": 0.3, "stall.pool_wait": 0.3, "stall.first_byte": 0.3,
        "stall.stream_gap": 0.3, "stall.client_drain": 0.3}
HISTOGRAMS = ("traceproxy_request_duration_seconds", "traceproxy_time_to_first_byte_seconds",
              "traceproxy_time_to_first_chunk_seconds", "traceproxy_response_chunk_max_gap_seconds",
              "traceproxy_client_connection_requests")
COUNTERS = ("traceproxy_requests_total", "traceproxy_stalls_total", "traceproxy_stalls_resolved_total",
            "traceproxy_upstream_connections_opened_total", "traceproxy_upstream_connections_reused_total",
            "traceproxy_upstream_stale_connections_total", "traceproxy_upstream_retries_total",
            "traceproxy_upstream_connect_failures_total", "traceproxy_spans_dropped_total",
            "traceproxy_spans_exported_total", "traceproxy_spans_failed_total", "traceproxy_observer_errors_total")
GAUGES = ("traceproxy_requests_in_flight", "traceproxy_stalls_open", "traceproxy_upstream_connections_open",
          "traceproxy_upstream_connections_idle", "traceproxy_client_connections_open")


# ----------------------------------------------------------------------------------
# A tiny parser for the text exposition format 0.0.4, strict about shape
# ----------------------------------------------------------------------------------
NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
SAMPLE = re.compile(rf"^({NAME})(?:\{{({LABEL}(?:,{LABEL})*)\}})? (\S+)$")
LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


class Scrape:
    def __init__(self, text: str) -> None:
        self.types: dict[str, str] = {}
        self.samples: list[tuple[str, dict[str, str], float]] = []
        self._parse(text)

    def _parse(self, text: str) -> None:
        assert text.endswith("\n"), "the exposition must end with a newline"
        family, helped = None, set()
        for line in text[:-1].split("\n"):
            if line.startswith("# HELP "):
                name = line.split(" ", 3)[2]
                assert re.fullmatch(NAME, name) and name not in helped, line
                helped.add(name)
            elif line.startswith("# TYPE "):
                _, _, name, kind = line.split(" ")
                assert name in helped and name not in self.types, f"TYPE without HELP or twice: {line}"
                assert kind in ("counter", "gauge", "histogram"), line
                self.types[name], family = kind, name
            else:
                match = SAMPLE.match(line)
                assert match, f"not a sample line: {line!r}"
                name, labels, value = match.group(1), dict(LABEL_PAIR.findall(match.group(2) or "")), match.group(3)
                assert family is not None and _belongs(name, family, self.types[family]), f"{name} outside its family"
                self.samples.append((name, labels, float(value)))
        keys = [(name, tuple(sorted(labels.items()))) for name, labels, _ in self.samples]
        assert len(keys) == len(set(keys)), "a series appears twice"

    def value(self, name: str, **labels: str) -> float | None:
        for sample_name, sample_labels, value in self.samples:
            if sample_name == name and sample_labels == labels:
                return value
        return None

    def series(self, name: str) -> list[tuple[dict[str, str], float]]:
        return [(labels, value) for sample_name, labels, value in self.samples if sample_name == name]

    def buckets(self, histogram: str) -> list[tuple[str, float]]:
        return [(labels["le"], value) for labels, value in self.series(histogram + "_bucket")]

    def bucket(self, histogram: str, le: float) -> float:
        return next(count for bound, count in self.buckets(histogram) if float(bound) == le)


def _belongs(sample: str, family: str, kind: str) -> bool:
    if kind == "histogram":
        return any(sample == family + suffix for suffix in HISTOGRAM_SUFFIXES)
    return sample == family


def scrape(proxy) -> Scrape:
    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.admin_port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        return Scrape(resp.read().decode("utf-8"))


def assert_cumulative(result: Scrape, histogram: str) -> None:
    buckets = result.buckets(histogram)
    bounds = [float(le) for le, _ in buckets]
    counts = [count for _, count in buckets]
    assert buckets and buckets[-1][0] == "+Inf", f"{histogram} must end with +Inf"
    assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds), f"{histogram} bounds not increasing"
    assert counts == sorted(counts), f"{histogram} buckets are not cumulative: {counts}"
    assert counts[-1] == result.value(histogram + "_count"), f"{histogram}: +Inf bucket != _count"


# ----------------------------------------------------------------------------------
# Shape
# ----------------------------------------------------------------------------------
def test_exposition_parses_and_declares_every_family(fast_upstream, start_proxy):
    proxy = start_proxy(fast_upstream().url)
    RawClient(proxy.port).roundtrip("GET", "/health")
    result = scrape(proxy)
    for name in COUNTERS:
        assert result.types.get(name) == "counter", name
    for name in GAUGES:
        assert result.types.get(name) == "gauge", name
    for name in HISTOGRAMS:
        assert result.types.get(name) == "histogram", name
        assert_cumulative(result, name)
    # Every phase a live request can be in, zeros included.
    phases = {labels["phase"]: value for labels, value in result.series("traceproxy_requests_in_flight")}
    assert phases == {**{phase.value: 0 for phase in Phase if phase is not Phase.DONE}, "waiting_turn": 0}
    # Tracing is off in tests: the span counters are present and zero.
    assert result.value("traceproxy_spans_dropped_total") == 0
    assert result.value("traceproxy_spans_exported_total") == 0
    assert result.value("traceproxy_spans_failed_total") == 0


def test_span_shedding_has_no_samples_while_only_the_access_log_is_on(fast_upstream, start_proxy, tmp_path):
    # The access log alone keeps a tracing observer, which never sheds: the docs
    # promise no samples while tracing is off, not a zero that looks like a gauge of health.
    proxy = start_proxy(fast_upstream().url, **{"access_log.path": str(tmp_path / "access.log")})
    RawClient(proxy.port).roundtrip("GET", "/health")
    result = scrape(proxy)
    assert result.types.get("traceproxy_spans_shed_total") == "counter"
    assert result.series("traceproxy_spans_shed_total") == []


def test_label_values_are_escaped():
    assert format_labels((("outcome", 'a"b\\c\nd'),)) == '{outcome="a\\"b\\\\c\\nd"}'
    line = "traceproxy_x" + format_labels((("a", '"'), ("b", "\\"))) + " 1"
    assert SAMPLE.match(line)


def test_histogram_bucket_edges_are_inclusive_and_cumulative():
    histogram = Histogram((0.1, 1.0))
    for value in (0.1, 0.5, 1.0, 7.0):
        histogram.observe(value)
    assert histogram.cumulative() == [(0.1, 1), (1.0, 3), (float("inf"), 4)]
    assert histogram.count == 4 and histogram.sum == 8.6


def test_nanosecond_histogram_buckets_and_sums_in_seconds():
    # The latency histograms count integer ns; bounds and _sum are still seconds.
    histogram = Histogram((0.005, 0.01), scale=1_000_000_000)
    for ns in (5_000_000, 5_000_001, 20_000_000):
        histogram.count_raw(ns)
    assert histogram.cumulative() == [(0.005, 1), (0.01, 2), (float("inf"), 3)]
    assert histogram.count == 3 and histogram.sum == 0.030000001


# ----------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------
def test_request_counter_and_histograms_move_by_exactly_the_requests_made(fast_upstream, start_proxy):
    proxy = start_proxy(fast_upstream().url)
    before = scrape(proxy)
    assert before.series("traceproxy_requests_total") == []
    assert before.value("traceproxy_request_duration_seconds_count") == 0
    client = RawClient(proxy.port)
    for _ in range(3):
        # Paced: each token its own upstream read, so every request has gaps to observe.
        resp = client.roundtrip("POST", "/v1/chat/completions", headers=[("x-fake-tps", "200")],
                                body=b'{"stream": true, "max_tokens": 8}')
        assert resp.status == 200 and resp.complete
    assert wait_until(lambda: scrape(proxy).value("traceproxy_request_duration_seconds_count") == 3)
    after = scrape(proxy)
    assert after.series("traceproxy_requests_total") == [({"status": "200", "outcome": "OK", "blame": "-"}, 3)]
    for histogram in HISTOGRAMS[:3]:
        assert after.value(histogram + "_count") == 3, histogram
        assert after.value(histogram + "_sum") > 0, histogram
        assert_cumulative(after, histogram)
    # Observed once per request, never per chunk: 3 streams of many reads each.
    assert after.value("traceproxy_response_chunk_max_gap_seconds_count") == 3
    client.close()


def test_time_to_first_byte_is_the_head_and_first_chunk_the_body(scripted_upstream, start_proxy):
    head_then_body_later = answers_in_parts(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                                            b"3\r\none\r\n0\r\n\r\n", pause=0.6)

    proxy = start_proxy(scripted_upstream(head_then_body_later).url)
    client = RawClient(proxy.port)
    assert client.roundtrip("GET", "/").body == b"one"
    assert wait_until(lambda: scrape(proxy).value("traceproxy_time_to_first_chunk_seconds_count") == 1)
    result = scrape(proxy)
    assert result.bucket("traceproxy_time_to_first_byte_seconds", 0.25) == 1
    assert result.bucket("traceproxy_time_to_first_chunk_seconds", 0.5) == 0
    assert 0.5 < result.value("traceproxy_time_to_first_chunk_seconds_sum") < 5
    # One body read has no gap between reads: nothing observed.
    assert result.value("traceproxy_response_chunk_max_gap_seconds_count") == 0
    client.close()


def test_upstream_connect_failure_counts_as_uf_502_blamed_on_the_engine(start_proxy, dead_upstream):
    proxy = start_proxy(dead_upstream)
    client = RawClient(proxy.port)
    for _ in range(2):
        assert client.roundtrip("GET", "/v1/models").status == 502
    assert wait_until(lambda: scrape(proxy).value("traceproxy_request_duration_seconds_count") == 2)
    result = scrape(proxy)
    assert result.series("traceproxy_requests_total") == [({"status": "502", "outcome": "UF", "blame": "engine"}, 2)]
    assert result.value("traceproxy_upstream_connect_failures_total") == 2
    assert result.value("traceproxy_upstream_connections_opened_total") == 0
    # The proxy's own 502s are the first bytes those clients got.
    assert result.value("traceproxy_time_to_first_byte_seconds_count") == 2
    client.close()


def test_observer_errors_are_counted(fast_upstream, start_proxy):
    class Broken:
        def on_done(self, record):
            raise RuntimeError("observer bug")

    proxy = start_proxy(fast_upstream().url, observers=[Broken()])
    RawClient(proxy.port).roundtrip("GET", "/health")
    assert wait_until(lambda: scrape(proxy).value("traceproxy_observer_errors_total") == 1)
    assert scrape(proxy).value("traceproxy_requests_total", status="200", outcome="OK", blame="-") == 1


def test_metrics_do_no_work_per_mark(fast_upstream, start_proxy):
    proxy = start_proxy(fast_upstream().url)
    assert proxy.metrics in proxy.fanout.done_observers
    assert proxy.metrics not in proxy.fanout.mark_observers
    assert proxy.metrics not in proxy.fanout.start_observers


# ----------------------------------------------------------------------------------
# Stalls and the in-flight gauge
# ----------------------------------------------------------------------------------
def test_stuck_request_shows_in_flight_awaiting_upstream_headers_and_counts_a_stall(scripted_upstream,
                                                                                    start_proxy):
    proxy = start_proxy(scripted_upstream(never_answers).url, **FAST)
    stuck = {"phase": "awaiting_upstream_headers"}
    assert scrape(proxy).value("traceproxy_requests_in_flight", **stuck) == 0
    client = RawClient(proxy.port)
    client.request("POST", "/v1/chat/completions", body=b"{}")
    assert wait_until(lambda: scrape(proxy).value("traceproxy_requests_in_flight", **stuck) == 1, timeout=3)
    assert wait_until(lambda: scrape(proxy).value("traceproxy_stalls_open") == 1, timeout=3)
    result = scrape(proxy)
    assert result.series("traceproxy_stalls_total") == [({"outcome": "FBS", "blame": "engine"}, 1)]
    assert result.value("traceproxy_requests_in_flight", **stuck) == 1  # still stuck
    assert sum(v for _, v in result.series("traceproxy_requests_in_flight")) == 1
    assert result.series("traceproxy_requests_total") == []
    # Two more pipelined behind it (one whole, one a head half sent): they wait their
    # turn, as /debug/inflight says, not for a connection or for the client.
    client.sock.sendall(b"GET /second HTTP/1.1\r\nHost: a\r\n\r\nGET /third HTTP/1.1\r\nHo")
    waiting = {"phase": "waiting_turn"}
    assert wait_until(lambda: scrape(proxy).value("traceproxy_requests_in_flight", **waiting) == 2, timeout=3)
    assert sum(v for _, v in scrape(proxy).series("traceproxy_requests_in_flight")) == 3
    client.close()
    assert wait_until(lambda: scrape(proxy).value("traceproxy_requests_in_flight", **stuck) == 0)
    result = scrape(proxy)
    assert result.value("traceproxy_stalls_open") == 0
    # Ended by the client closing, not by the awaited byte arriving: not resolved.
    assert result.series("traceproxy_stalls_resolved_total") == []


def test_stall_that_resolves_is_counted_and_its_gap_observed_once(scripted_upstream, start_proxy):
    pauses_then_finishes = answers_in_parts(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\none\r\n",
                                            b"3\r\ntwo\r\n0\r\n\r\n", pause=0.8)

    proxy = start_proxy(scripted_upstream(pauses_then_finishes).url, **FAST)
    client = RawClient(proxy.port)
    resp = client.roundtrip("GET", "/")
    assert resp.complete and resp.body == b"onetwo"
    assert wait_until(lambda: scrape(proxy).value("traceproxy_response_chunk_max_gap_seconds_count") == 1)
    result = scrape(proxy)
    assert result.series("traceproxy_stalls_total") == [({"outcome": "MSS", "blame": "engine"}, 1)]
    assert result.series("traceproxy_stalls_resolved_total") == [({"outcome": "MSS"}, 1)]
    assert result.value("traceproxy_stalls_open") == 0
    gap = "traceproxy_response_chunk_max_gap_seconds"
    assert result.bucket(gap, 0.5) == 0 and result.bucket(gap, 2.5) == 1
    assert 0.6 < result.value(gap + "_sum") < 5
    client.close()


# ----------------------------------------------------------------------------------
# The upstream pool
# ----------------------------------------------------------------------------------
def test_pool_counters_reflect_reuse(fast_upstream, start_proxy):
    proxy = start_proxy(fast_upstream().url)
    client = RawClient(proxy.port)
    for _ in range(4):
        assert client.roundtrip("GET", "/health").status == 200
    assert wait_until(lambda: scrape(proxy).value("traceproxy_upstream_connections_idle") == 1)
    result = scrape(proxy)
    assert result.value("traceproxy_upstream_connections_opened_total") == 1
    assert result.value("traceproxy_upstream_connections_reused_total") == 3
    assert result.value("traceproxy_upstream_connections_open") == 1
    assert result.value("traceproxy_upstream_retries_total") == 0
    assert result.value("traceproxy_upstream_stale_connections_total") == 0
    client.close()


def test_stale_reused_connection_counts_a_retry_and_a_stale_connection(scripted_upstream, start_proxy):
    proxy = start_proxy(scripted_upstream(answers_then_drops_next_request()).url)
    client = RawClient(proxy.port)
    assert client.roundtrip("POST", "/", body=b'{"turn": 1}').status == 200
    assert client.roundtrip("POST", "/", body=b'{"turn": 2}').status == 200
    assert wait_until(lambda: scrape(proxy).value("traceproxy_request_duration_seconds_count") == 2)
    result = scrape(proxy)
    assert result.value("traceproxy_upstream_retries_total") == 1
    assert result.value("traceproxy_upstream_stale_connections_total") == 1
    assert result.value("traceproxy_upstream_connections_opened_total") == 2
    assert result.value("traceproxy_upstream_connections_reused_total") == 1
    assert result.series("traceproxy_requests_total") == [({"status": "200", "outcome": "OK", "blame": "-"}, 2)]
    client.close()


# ----------------------------------------------------------------------------------
# Client connections
# ----------------------------------------------------------------------------------
def test_client_connection_requests_observed_when_each_connection_closes(fast_upstream, start_proxy):
    proxy = start_proxy(fast_upstream().url)
    busy, light = RawClient(proxy.port), RawClient(proxy.port)
    for _ in range(3):
        busy.roundtrip("GET", "/health")
    light.roundtrip("GET", "/health")
    assert wait_until(lambda: scrape(proxy).value("traceproxy_client_connections_open") == 2)
    assert scrape(proxy).value("traceproxy_client_connection_requests_count") == 0
    busy.close()
    light.close()
    histogram = "traceproxy_client_connection_requests"
    assert wait_until(lambda: scrape(proxy).value(histogram + "_count") == 2)
    result = scrape(proxy)
    assert result.value("traceproxy_client_connections_open") == 0
    assert result.value(histogram + "_sum") == 4
    assert result.bucket(histogram, 1) == 1
    assert result.bucket(histogram, 2) == 1
    assert result.bucket(histogram, 4) == 2
    assert_cumulative(result, histogram)


def test_every_exposed_metric_is_documented(fast_upstream, start_proxy):
    import re
    from pathlib import Path

    proxy = start_proxy(fast_upstream().url)
    exposed = set(re.findall(r"^# TYPE (traceproxy_\w+) ", admin_get(proxy, "/metrics"), re.M))
    documented = set(re.findall(r"`(traceproxy_\w+)`", (Path(__file__).parents[1] / "docs" / "metrics.md").read_text()))
    assert exposed and exposed == documented


def test_prometheus_totals_sum_over_labels():
    text = ("# HELP traceproxy_requests_total x\n# TYPE traceproxy_requests_total counter\n"
            'traceproxy_requests_total{status="200",outcome="OK"} 7\n'
            'traceproxy_requests_total{status="502",outcome="UF"} 2\n'
            "traceproxy_spans_dropped_total 0\n")
    totals = prometheus_totals(text)
    assert totals["traceproxy_requests_total"] == 9 and totals["traceproxy_spans_dropped_total"] == 0
