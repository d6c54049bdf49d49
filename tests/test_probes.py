"""Keep-alive alignment (learned passively) and the fresh-connection stall probe."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time

from traceproxy.proxy.upstream import KeepAliveLearner

from .support import RawClient, admin_get, admin_metric, wait_until

SECOND_NS = 1_000_000_000


# -- keep-alive alignment -----------------------------------------------------------
def _paced_requests(proxy, count: int, pause: float) -> None:
    client = RawClient(proxy.port)
    try:
        for _ in range(count):
            response = client.roundtrip("GET", "/health")
            assert response.status == 200
            time.sleep(pause)
    finally:
        client.close()


def test_idle_closes_are_learned_and_a_misaligned_pool_is_reported(fast_upstream, start_proxy, caplog):
    upstream = fast_upstream(idle_close_after=0.5)
    proxy = start_proxy(upstream.url, **{"pool.idle_timeout": 2.0})
    assert math.isnan(admin_metric(proxy, "traceproxy_upstream_keepalive_timeout_seconds"))
    with caplog.at_level(logging.WARNING, logger="traceproxy.upstream"):
        _paced_requests(proxy, 3, 0.7)
        assert wait_until(lambda: admin_metric(proxy, "traceproxy_upstream_keepalive_misaligned") == 1)
    learned = admin_metric(proxy, "traceproxy_upstream_keepalive_timeout_seconds")
    assert 0.45 <= learned <= 0.7, learned
    assert admin_metric(proxy, "traceproxy_client_keepalive_timeout_seconds") == 75.0
    warnings = [r.getMessage() for r in caplog.records if "keep-alive misaligned" in r.getMessage()]
    assert len(warnings) == 1 and "pool.idle_timeout is 2 s" in warnings[0] and "lower pool.idle_timeout" in warnings[0]
    health = json.loads(admin_get(proxy, "/healthz"))
    assert health["upstream_keepalive_misaligned"] is True
    assert 0.45 <= health["upstream_keepalive_timeout_s"] <= 0.7
    assert health["client_keepalive_timeout_s"] == 75.0


def test_an_upstream_restart_closing_every_pooled_connection_teaches_nothing():
    learner = KeepAliveLearner(idle_timeout=4.0)
    restart_ns = 50 * SECOND_NS
    for idle_age_s in (0.3, 1.1, 2.0, 2.9, 3.7):  # all closed by one restart, within a millisecond
        learner.saw_idle_close(int(idle_age_s * SECOND_NS), restart_ns + int(idle_age_s * 1e5))
    assert learner.learned is None and not learner.misaligned
    # A real idle timeout repeats at the same age, on separate events.
    learner.saw_idle_close(int(2.5 * SECOND_NS), 60 * SECOND_NS)
    assert learner.learned is None
    learner.saw_idle_close(int(2.52 * SECOND_NS), 61 * SECOND_NS)
    assert learner.learned == 2.5 and learner.misaligned


def test_a_pool_idle_timeout_below_the_upstreams_is_aligned(fast_upstream, start_proxy):
    upstream = fast_upstream(idle_close_after=0.5)
    proxy = start_proxy(upstream.url, **{"pool.idle_timeout": 0.2})
    _paced_requests(proxy, 3, 0.7)
    assert admin_metric(proxy, "traceproxy_upstream_keepalive_misaligned") == 0
    assert upstream.idle_closes == 0  # the pool closed them first


def _keepalive_header_upstream(scripted_upstream):
    async def handler(reader, writer, _up):
        while True:
            await reader.read_request()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n"
                         b"Keep-Alive: timeout=1, max=100\r\n\r\nok")
            await writer.drain()

    return scripted_upstream(handler)


def test_keepalive_header_is_learned(scripted_upstream, start_proxy):
    upstream = _keepalive_header_upstream(scripted_upstream)
    proxy = start_proxy(upstream.url)  # pool.idle_timeout 4.0 > 1.0
    _paced_requests(proxy, 1, 0)
    assert admin_metric(proxy, "traceproxy_upstream_keepalive_timeout_seconds") == 1.0
    assert admin_metric(proxy, "traceproxy_upstream_keepalive_misaligned") == 1


def test_keepalive_header_with_margin_is_aligned(scripted_upstream, start_proxy):
    upstream = _keepalive_header_upstream(scripted_upstream)
    proxy = start_proxy(upstream.url, **{"pool.idle_timeout": 0.5})
    _paced_requests(proxy, 1, 0)
    assert admin_metric(proxy, "traceproxy_upstream_keepalive_timeout_seconds") == 1.0
    assert admin_metric(proxy, "traceproxy_upstream_keepalive_misaligned") == 0


# -- the stall probe ----------------------------------------------------------------
STALL = {"stall.first_byte": 0.3, "stall.stream_gap": 0.3, "stall.pool_wait": 0.3}


def _probe_proxy(start_proxy, url, **extra):
    return start_proxy(url, **{"engines.probe_on_stall": True, "engines.probe_timeout": 0.8, **STALL, **extra})


def _wait_for_probe(proxy) -> dict:
    assert wait_until(lambda: proxy.prober.results, timeout=8)
    return next(iter(proxy.prober.results.values()))


def test_probe_off_by_default(fast_upstream, start_proxy):
    proxy = start_proxy(fast_upstream().url)
    assert proxy.prober is None
    assert "probe" not in admin_get(proxy, "/debug/inflight")


def test_probe_says_fresh_works_when_only_the_reused_connection_hangs(scripted_upstream, start_proxy):
    first_conn = []

    async def handler(reader, writer, up):
        head, _ = await reader.read_request()
        if not first_conn:
            first_conn.append(True)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            await reader.read_request()
            await asyncio.sleep(30)  # the second request on this connection hangs
            return
        status = b"200 OK" if head.startswith(b"GET /health ") else b"404 Not Found"
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()

    upstream = scripted_upstream(handler)
    proxy = _probe_proxy(start_proxy, upstream.url)
    client = RawClient(proxy.port)
    try:
        assert client.roundtrip("GET", "/v1/models").status == 200
        client.send(b"GET /v1/models HTTP/1.1\r\nHost: test.local\r\n\r\n")
        probe = _wait_for_probe(proxy)
        assert probe["fresh_works"] is True and probe["status"] == 200
        assert probe["stall"] == "FBS" and probe["upstream_reused"] is True
        assert probe["verdict"] == "connection-state fault (fresh works)"
        assert re.match(r"fresh connection answered 200 in \d+ ms while the request waits on reused connection #\d+",
                        probe["detail"]), probe["detail"]
        inflight = json.loads(admin_get(proxy, "/debug/inflight"))
        assert inflight["requests"][0]["probe"]["verdict"] == probe["verdict"]
    finally:
        client.close()


def test_probe_says_fresh_hangs_too_when_the_engine_answers_nothing(scripted_upstream, start_proxy):
    async def handler(reader, writer, up):
        await reader.read_head()
        await asyncio.sleep(30)

    upstream = scripted_upstream(handler)
    proxy = _probe_proxy(start_proxy, upstream.url)
    client = RawClient(proxy.port)
    try:
        client.request("GET", "/v1/models")
        probe = _wait_for_probe(proxy)
        assert probe["fresh_works"] is False and probe["status"] is None
        assert probe["verdict"] == "engine unresponsive (fresh hangs too)"
        assert "no answer within 0.8 s" in probe["detail"]
        assert proxy.prober.probes == 1  # one stall, one probe
    finally:
        client.close()


def test_restarts_that_close_connections_of_the_same_ages_teach_nothing():
    # Periodic traffic leaves the pool with the same idle ages before each restart:
    # each restart is one event whose ages disagree, so neither counts.
    learner = KeepAliveLearner(idle_timeout=4.0)
    for restart_s in (10, 12):
        for idle_age_s in (1.1, 0.6, 0.1):
            learner.saw_idle_close(int(idle_age_s * SECOND_NS), restart_s * SECOND_NS + int(idle_age_s * 1e4))
    assert learner.learned is None and not learner.misaligned
    # Connections that went idle together and time out together are one event that counts.
    for at_s in (20, 25):
        for _ in range(3):
            learner.saw_idle_close(int(3.0 * SECOND_NS), at_s * SECOND_NS)
    assert learner.learned == 3.0 and learner.misaligned


def test_a_learnt_timeout_survives_a_restart_that_closes_a_full_window():
    learner = KeepAliveLearner(idle_timeout=4.0)
    for at_s in (100, 110):
        learner.saw_idle_close(int(3.0 * SECOND_NS), at_s * SECOND_NS)
    assert learner.learned == 3.0 and learner.misaligned
    for i in range(40):  # one restart: forty pooled connections of mixed ages at once
        learner.saw_idle_close(int((0.1 + i * 0.05) * SECOND_NS), 200 * SECOND_NS + i * 1000)
    assert learner.learned == 3.0 and learner.misaligned


def test_a_probe_that_fails_on_our_side_says_why_instead_of_vanishing(fast_upstream, loop_thread):
    # The config refuses such a path; the probe still never fails silently if one gets by.
    from traceproxy.observe.probe import StallProber

    up = fast_upstream()
    prober = StallProber("127.0.0.1", up.port, "/h\u20acalth", 1.0, f"127.0.0.1:{up.port}")
    status, error = loop_thread.run(prober._probe())
    assert status is None and error.startswith("failed (UnicodeEncodeError")
