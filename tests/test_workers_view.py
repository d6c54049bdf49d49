"""One service, one view: ``--workers N`` seen from the outside is one proxy.

(a) the pure parts: Accept negotiation, merging the workers' numbers (late counters,
fresh gauges, histograms bucket by bucket, exemplars), the shared healthy-trace
ceiling; (b) OpenMetrics with exemplars read by prometheus_client's parser; (c) real
``traceproxy serve --workers N`` processes: counters under load never go down and end
at the requests sent, every held stream once in /debug/inflight, /healthz and top
from one snapshot, a stopped worker makes answers late and partial but never
wrong; (d) the engines compared with the service's count: no false EOR, a real
orphan still one; (e) the healthy-trace ceiling is the service's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager

import pytest

from traceproxy.observe.exposition import wants_openmetrics
from traceproxy.observe.metrics import (EXEMPLAR_PREFER_FAILED_NS, HISTOGRAM_SHAPES, Histogram, LATENCY_BUCKETS,
                                        NS_PER_S, ProxyMetrics, prometheus_totals)
from traceproxy.observe.service_metrics import merge
from traceproxy.observe.tracing import SharedRateCeiling
from traceproxy.sim.launch import free_port

from .support import RawClient, wait_until

S = NS_PER_S
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPENMETRICS_ACCEPT = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75," \
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"  # what Prometheus sends with exemplars on


# ----------------------------------------------------------------------------------
# (a) pure
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("accept, openmetrics", [
    (None, False), ("", False), ("*/*", False), ("text/plain", False),
    (OPENMETRICS_ACCEPT, True),
    ("application/openmetrics-text", True),
    ("application/openmetrics-text;q=0, text/plain", False),
    ("text/plain;q=0.9, application/openmetrics-text;q=0.5", False),
    ("Application/OpenMetrics-Text; version=1.0.0", True),
])
def test_openmetrics_only_when_the_scraper_prefers_it(accept, openmetrics):
    assert wants_openmetrics(accept) is openmetrics


def _numbers(requests: int = 0, in_flight: int = 0, *, duration_ns: int = 0, exemplar=None, learned=None) -> dict:
    """One worker's numbers as ProxyMetrics.numbers() and the worker view make them."""
    histograms = {name: [[0] * (len(bounds) + 1), 0, [None] * (len(bounds) + 1)]
                  for name, (bounds, _) in HISTOGRAM_SHAPES.items()}
    if requests:
        counts = histograms["request_duration_seconds"]
        counts[0][0], counts[1] = requests, duration_ns
        counts[2][0] = exemplar
    return {"requests": {(200, "OK"): requests} if requests else {}, "stalls": {}, "stalls_resolved": {},
            "pool": {"opened": requests}, "spans": {}, "shed": None, "observer_errors": 0,
            "stall_listener_errors": 0, "histograms": histograms,
            "in_flight": {"streaming_response": in_flight}, "stalls_open": 0, "client_connections": in_flight,
            "upstream_open": 1, "upstream_idle": 1, "warm_target": 1, "keepalive_learned": learned,
            "keepalive_misaligned": False, "client_keepalive": 75.0}


def test_a_late_worker_counts_with_its_last_counters_and_is_left_out_of_the_gauges():
    fresh, late = _numbers(5, in_flight=2, duration_ns=5_000), _numbers(7, in_flight=3, duration_ns=7_000)
    service = merge([fresh], [late])
    assert service["requests"] == {(200, "OK"): 12} and service["pool"]["opened"] == 12
    assert service["histograms"]["request_duration_seconds"][0][0] == 12
    assert service["histograms"]["request_duration_seconds"][1] == 12_000
    assert service["in_flight"]["streaming_response"] == 2 and service["client_connections"] == 2
    assert service["in_flight"]["awaiting_upstream_headers"] == 0  # every phase, zeros included


def test_non_count_gauges_are_reduced_not_summed():
    service = merge([_numbers(learned=None), _numbers(learned=5.0), _numbers(learned=4.5)])
    assert service["keepalive_learned"] == 4.5  # the smallest learned: the one the pool must stay below
    assert service["client_keepalive"] == 75.0 and service["warm_target"] == 3


def _exemplar(trace_id: int, end_s: float, failed: bool) -> tuple:
    return (1_000_000, trace_id, f"req-{trace_id}", int(end_s * S), failed)


@pytest.mark.parametrize("a, b, kept", [
    (_exemplar(1, 10, False), _exemplar(2, 11, False), 2),  # the later healthy one
    (_exemplar(1, 10, True), _exemplar(2, 11, False), 1),  # a recent failure over a later healthy one
    (_exemplar(1, 10, True), _exemplar(2, 10 + EXEMPLAR_PREFER_FAILED_NS / S + 1, False), 2),  # not for ever
    (_exemplar(1, 10, False), _exemplar(2, 9, True), 2),  # an earlier failure over a later healthy one
])
def test_merged_exemplar_is_the_one_a_single_worker_would_keep(a, b, kept):
    for first, second in ((a, b), (b, a)):
        service = merge([_numbers(1, duration_ns=1, exemplar=first), _numbers(1, duration_ns=1, exemplar=second)])
        assert service["histograms"]["request_duration_seconds"][2][0][1] == kept


def test_a_histogram_keeps_a_recent_failure_as_its_bucket_exemplar():
    histogram = Histogram(LATENCY_BUCKETS, NS_PER_S, exemplars=True)
    histogram.count_raw_with_exemplar(1_000, 0xAA, "failed", 10 * S, True)
    histogram.count_raw_with_exemplar(2_000, 0xBB, "healthy", 11 * S, False)
    assert histogram.exemplars[0][1] == 0xAA and histogram.bucket_counts[0] == 2
    histogram.count_raw_with_exemplar(3_000, 0xCC, "healthy later", 10 * S + EXEMPLAR_PREFER_FAILED_NS + 1, False)
    assert histogram.exemplars[0][1] == 0xCC


def test_the_shared_ceiling_is_one_bucket_for_every_process_that_takes_from_it():
    ceiling = SharedRateCeiling(10)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # another worker: takes from the same bucket at the same moment
        os.close(read)
        taken = sum(ceiling.take(1_000 * S) for _ in range(8))
        os.write(write, bytes([taken]))
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    taken_there = os.read(read, 1)[0]
    os.close(read)
    taken_here = sum(ceiling.take(1_000 * S) for _ in range(8))
    assert taken_there == 8 and taken_here == 2  # a burst of 10 between them, not 10 each
    assert ceiling.take(1_000 * S + S // 10)  # and a tenth of a second later, one more


def test_without_a_shared_lock_each_worker_keeps_its_share_of_the_ceiling(monkeypatch, caplog):
    import multiprocessing.context

    def no_semaphores(self):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(multiprocessing.context.BaseContext, "Lock", no_semaphores)
    ceiling = SharedRateCeiling.for_service(10, 3)
    assert not isinstance(ceiling, SharedRateCeiling) and ceiling.per_second == 3  # 3 workers stay under 10
    assert "split between the 3 workers (3 each)" in caplog.text


# ----------------------------------------------------------------------------------
# A real multi-worker service
# ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def upstream_process():
    proc = subprocess.Popen([sys.executable, "-m", "traceproxy", "upstream"], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)
    line = proc.stdout.readline()
    assert "listening on" in line, line
    yield line.rsplit(" ", 1)[1].strip()
    proc.terminate()
    proc.wait(10)


class Service:
    def __init__(self, proc: subprocess.Popen, port: int, admin: int, workers: int) -> None:
        self.proc, self.port, self.admin, self.workers = proc, port, admin, workers

    def get(self, path: str, accept: str | None = None, timeout: float = 10) -> tuple[str, str]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.admin}{path}",
                                         headers={"Accept": accept} if accept else {})
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.headers["Content-Type"], resp.read().decode()

    def json(self, path: str) -> dict:
        return json.loads(self.get(path)[1])

    def totals(self) -> dict[str, float]:
        return prometheus_totals(self.get("/metrics")[1])

    def worker_pids(self) -> set[int]:
        return {int(pid) for pid in open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read().split()}


def _healthy(service: Service) -> bool:
    try:
        return service.json("/healthz")["workers_answering"] == service.workers
    except (OSError, ValueError, KeyError):
        return False


@contextmanager
def serving(upstream: str, workers: int, *extra: str, env: dict | None = None):
    port, admin = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "traceproxy", "serve", "--listen", f"127.0.0.1:{port}", "--upstream", upstream,
         "--admin", f"127.0.0.1:{admin}", "--workers", str(workers), *extra],
        stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "TRACEPROXY_TRACING_EXPORTER": "off", "TRACEPROXY_ACCESS_LOG_PATH": "", **(env or {})})
    service = Service(proc, port, admin, workers)
    try:
        ok = wait_until(lambda: proc.poll() is not None or _healthy(service), timeout=30, interval=0.05)
        assert ok and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else "not healthy"
        yield service
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                for pid in service.worker_pids():
                    os.kill(pid, signal.SIGKILL)
                proc.kill()
                proc.wait(5)


def _load(port: int, connections: int, stop: threading.Event, sent: list[int], max_each: int = 3000) -> list:
    """``connections`` threads each sending GETs on one keep-alive connection until ``stop``."""

    def one(index: int) -> None:
        client = RawClient(port)
        try:
            for _ in range(max_each):
                if stop.is_set():
                    break
                assert client.roundtrip("GET", "/health").status == 200
                sent[index] += 1
        finally:
            client.close()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(connections)]
    for thread in threads:
        thread.start()
    return threads


@pytest.mark.parametrize("workers", [2, 3])
def test_counters_under_load_never_go_down_and_end_at_the_requests_sent(upstream_process, workers):
    with serving(upstream_process, workers) as service:
        stop, sent = threading.Event(), [0] * 8
        threads = _load(service.port, 8, stop, sent)
        readings = []
        try:
            assert wait_until(lambda: sum(sent) > 0, timeout=10)
            for _ in range(50):
                totals = service.totals()
                readings.append((totals["traceproxy_requests_total"], totals["traceproxy_request_duration_seconds_count"]))
        finally:
            stop.set()
            for thread in threads:
                thread.join(30)
        requests, observed = zip(*readings)
        assert list(requests) == sorted(requests) and list(observed) == sorted(observed), readings
        assert requests[-1] > requests[0], "the scrapes were not under load"
        # Every worker answering (on a loaded machine one may miss a scrape's deadline).
        assert wait_until(lambda: service.totals()["traceproxy_workers_answering"] == workers, timeout=10)
        final = service.totals()
        assert final["traceproxy_requests_total"] == sum(sent)
        assert final["traceproxy_request_duration_seconds_count"] == sum(sent)
        assert final["traceproxy_requests_in_flight"] == 0
        assert final["traceproxy_workers"] == workers and final["traceproxy_workers_answering"] == workers


def _hold_streams(port: int, n: int, headers=()) -> list[RawClient]:
    clients = []
    for index in range(n):
        client = RawClient(port)
        client.request("POST", "/v1/chat/completions",
                       headers=[("x-fake-tps", "1"), ("x-request-id", f"held-{index}"), *headers],
                       body=b'{"stream": true, "max_tokens": 100}')
        clients.append(client)
    return clients


@pytest.mark.parametrize("workers", [2, 3])
def test_every_held_stream_appears_once_with_its_worker_and_the_service_count(upstream_process, workers):
    held = 3 * workers
    with serving(upstream_process, workers) as service:
        clients = _hold_streams(service.port, held)
        try:
            views = []

            def all_held():
                views.append(service.json("/debug/inflight"))
                return views[-1]["count"] == held and views[-1]["workers_answering"] == workers

            assert wait_until(all_held, timeout=10)
            view = views[-1]
            pids = service.worker_pids()
            ids = [entry["request_id"] for entry in view["requests"]]
            assert sorted(ids) == sorted(f"held-{i}" for i in range(held))  # each once
            assert {entry["worker"] for entry in view["requests"]} <= pids
            ages = [entry["age_s"] for entry in view["requests"]]
            assert ages == sorted(ages, reverse=True)  # oldest first, across workers
            assert {w["pid"] for w in view["workers"]} == pids and all(w["answered"] for w in view["workers"])
            assert sum(w["count"] for w in view["workers"]) == held
            assert view["health"]["requests_in_flight"] == held  # the same snapshot
            health = service.json("/healthz")
            assert health["requests_in_flight"] == held and health["pid"] == service.proc.pid
            assert {w["pid"] for w in health["workers"]} == pids
            totals = service.totals()
            assert totals["traceproxy_requests_in_flight"] == held
            assert totals["traceproxy_client_connections_open"] == held
            frame = subprocess.run([sys.executable, "-m", "traceproxy", "top", "--admin",
                                    f"127.0.0.1:{service.admin}", "--once", "--no-color"],
                                   capture_output=True, text=True, timeout=30, cwd=ROOT)
            assert frame.returncode == 0, frame.stderr
            assert f"{held} in flight" in frame.stdout and f"in flight {held}" in frame.stdout, frame.stdout
            assert f"workers {workers}" in frame.stdout, frame.stdout
        finally:
            for client in clients:
                client.close()


def test_a_stopped_worker_makes_answers_late_and_partial_never_wrong(upstream_process):
    with serving(upstream_process, 2) as service:
        for _ in range(20):
            assert RawClient(service.port).roundtrip("GET", "/health").status == 200
        befores = []
        assert wait_until(lambda: befores.append(service.totals()) or
                          befores[-1]["traceproxy_workers_answering"] == 2, timeout=10)
        before = befores[-1]
        stopped = min(service.worker_pids())
        os.kill(stopped, signal.SIGSTOP)
        try:
            started = time.monotonic()
            during = service.totals()
            took = time.monotonic() - started
            view = service.json("/debug/inflight")
            health = service.json("/healthz")
        finally:
            os.kill(stopped, signal.SIGCONT)
        assert took < 8  # late by the answer deadline, not hung on the stopped worker
        assert during["traceproxy_workers_answering"] == 1 and during["traceproxy_workers"] == 2
        assert during["traceproxy_worker_answers_late_total"] >= 1
        assert during["traceproxy_requests_total"] == before["traceproxy_requests_total"] == 20  # its last counters
        assert {w["pid"]: w["answered"] for w in view["workers"]}[stopped] is False
        assert view["workers_answering"] == 1 and health["workers_answering"] == 1
        assert {w["pid"]: w["answered"] for w in health["workers"]}[stopped] is False
        assert wait_until(lambda: service.totals()["traceproxy_workers_answering"] == 2, timeout=10)
        after = service.totals()
        assert after["traceproxy_requests_total"] == 20
        assert after["traceproxy_worker_answers_late_total"] >= during["traceproxy_worker_answers_late_total"]


# ----------------------------------------------------------------------------------
# (b) OpenMetrics and exemplars
# ----------------------------------------------------------------------------------
def _traceparent(trace_id: int) -> tuple[str, str]:
    return ("traceparent", f"00-{trace_id:032x}-{0x1122334455667788:016x}-01")


def _exemplars(text: str) -> dict[str, list]:
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    found: dict[str, list] = {}
    for family in text_string_to_metric_families(text):  # raises on anything that is not OpenMetrics
        for sample in family.samples:
            if sample.exemplar is not None:
                found.setdefault(family.name, []).append(sample.exemplar)
    return found


@pytest.mark.parametrize("workers", [1, 2])
def test_openmetrics_parses_and_its_exemplars_are_the_requests_sent(upstream_process, workers):
    pytest.importorskip("prometheus_client", reason="the OpenMetrics parser is prometheus_client's")
    sent = {0xC0FFEE0000000000000000000000 + i for i in range(12)}
    with serving(upstream_process, workers) as service:
        for trace_id in sorted(sent):
            client = RawClient(service.port)
            resp = client.roundtrip("POST", "/v1/chat/completions", headers=[_traceparent(trace_id)],
                                    body=b'{"stream": true, "max_tokens": 2}')
            assert resp.status == 200
            client.close()
        content_type, text = service.get("/metrics", OPENMETRICS_ACCEPT)
        assert content_type == "application/openmetrics-text; version=1.0.0; charset=utf-8"
        assert text.endswith("# EOF\n")
        assert re.search(r"^traceproxy_requests_created\{.*\} \d+\.\d+$", text, re.M)
        exemplars = _exemplars(text)
        for family in ("traceproxy_request_duration_seconds", "traceproxy_time_to_first_byte_seconds",
                       "traceproxy_time_to_first_chunk_seconds"):
            assert exemplars.get(family), family
            for exemplar in exemplars[family]:
                assert int(exemplar.labels["trace_id"], 16) in sent
                assert exemplar.labels["request_id"] and exemplar.timestamp is not None
        plain_type, plain = service.get("/metrics")  # no Accept: the text format, no exemplars
        assert plain_type == "text/plain; version=0.0.4; charset=utf-8"
        assert " # {" not in plain and "# EOF" not in plain


def test_a_request_id_past_the_label_budget_is_left_out_of_the_exemplar(upstream_process):
    pytest.importorskip("prometheus_client", reason="the OpenMetrics parser is prometheus_client's")
    with serving(upstream_process, 1) as service:
        client = RawClient(service.port)
        long_id = "r" * 100
        assert client.roundtrip("GET", "/health", headers=[("x-request-id", long_id),
                                                           _traceparent(0xABC)]).status == 200
        client.close()
        exemplar = _exemplars(service.get("/metrics", OPENMETRICS_ACCEPT)[1])["traceproxy_request_duration_seconds"][0]
        assert exemplar.labels == {"trace_id": f"{0xABC:032x}"}


# ----------------------------------------------------------------------------------
# (d) the engines against the service's count
# ----------------------------------------------------------------------------------
def test_engines_are_compared_with_every_worker_s_requests(loop_thread):
    from traceproxy.sim.engine import SimWorker

    engine = loop_thread.run(SimWorker("decode").start())
    try:
        with serving(engine.url, 2, "--engines-metrics-urls", f"{engine.url}/metrics",
                     env={"TRACEPROXY_ENGINES_SCRAPE_INTERVAL": "0.2", "TRACEPROXY_ENGINES_ORPHAN_AFTER": "0.5"}
                     ) as service:
            held = 6
            clients = []
            for index in range(held):  # one token, then the engine holds each stream open
                client = RawClient(service.port)
                client.request("POST", "/v1/chat/completions", headers=[("x-sim-fault", "decode_stall:1"),
                                                                        ("x-request-id", f"held-{index}")],
                               body=json.dumps({"model": "sim-llama", "stream": True, "max_tokens": 50,
                                                "messages": [{"role": "user", "content": "hi"}]}).encode())
                clients.append(client)
            try:
                def both_counts_are_held():
                    correlation = service.json("/debug/inflight").get("correlation") or {}
                    return correlation.get("engine_in_flight") == held and correlation.get("proxy_at_engines") == held

                assert wait_until(both_counts_are_held, timeout=15)
                time.sleep(1.5)  # three times orphan_after, several scrapes
                totals = service.totals()
                assert totals["traceproxy_engine_orphaned_requests"] == 0
                assert totals["traceproxy_engine_orphans_total"] == 0
                view = service.json("/debug/inflight")
                assert not view["correlation"]["orphan"]["reported"]
                # The readings reached each worker: its streams are the engine's (ESL).
                assert {e["correlation"]["outcome"] for e in view["requests"] if e["correlation"]} == {"ESL"}
                # A request the engine keeps counting after it answered: a real orphan.
                client = RawClient(service.port)
                resp = client.roundtrip("POST", "/v1/chat/completions", headers=[("x-sim-fault", "pinned_request")],
                                        body=json.dumps({"model": "sim-llama", "max_tokens": 2, "messages": [
                                            {"role": "user", "content": "hi"}]}).encode())
                assert resp.status == 200
                client.close()
                assert wait_until(lambda: service.totals()["traceproxy_engine_orphaned_requests"] == 1, timeout=10)
                assert service.totals()["traceproxy_engine_orphans_total"] == 1
                orphan = service.json("/debug/inflight")["correlation"]["orphan"]
                assert orphan["reported"] and orphan["outcome"] == "EOR" and orphan["blame"] == "engine"
            finally:
                for client in clients:
                    client.close()
    finally:
        loop_thread.run(engine.stop())


# ----------------------------------------------------------------------------------
# (e) the healthy-trace ceiling is the service's
# ----------------------------------------------------------------------------------
def test_the_healthy_trace_ceiling_holds_for_the_service_not_each_worker(upstream_process, tmp_path):
    per_second, connections, each = 10, 20, 5
    with serving(upstream_process, 2, "--tracing-healthy-max-per-second", str(per_second),
                 env={"TRACEPROXY_TRACING_EXPORTER": "file",
                      "TRACEPROXY_TRACING_FILE_PATH": str(tmp_path / "spans.jsonl")}) as service:
        stop, sent = threading.Event(), [0] * connections
        started = time.monotonic()
        threads = _load(service.port, connections, stop, sent, max_each=each)
        for thread in threads:
            thread.join(30)
        elapsed = time.monotonic() - started
        assert sum(sent) == connections * each
        # The service says where its spans go, the parent's answer as one process's would.
        assert service.json("/healthz")["spans"] == str(tmp_path / "spans.jsonl")
        shed = service.get("/metrics")[1]
        rate_shed = float(re.search(r'^traceproxy_spans_shed_total\{reason="rate"\} (\S+)$', shed, re.M).group(1))
        backlog_shed = float(re.search(r'^traceproxy_spans_shed_total\{reason="backlog"\} (\S+)$', shed, re.M).group(1))
        kept = sum(sent) - rate_shed - backlog_shed
        # One bucket: its burst, plus what refilled while the requests ran.
        assert kept <= per_second + per_second * elapsed + 1, (kept, elapsed)


def test_a_single_process_renders_the_same_families_as_a_service(fast_upstream, start_proxy):
    proxy = start_proxy(fast_upstream().url)
    RawClient(proxy.port).roundtrip("GET", "/health")
    assert isinstance(proxy.metrics, ProxyMetrics)
    one = set(re.findall(r"^# TYPE (\S+) ", proxy.metrics.render(), re.M))
    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.admin_port}/metrics", timeout=5) as resp:
        served = set(re.findall(r"^# TYPE (\S+) ", resp.read().decode(), re.M))
    assert one == served and "traceproxy_workers" in served
