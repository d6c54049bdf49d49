"""The access log: one valid JSON line per request, nginx-style timings, the outcome
and blame, and the keep-alive ledger."""

from __future__ import annotations

import asyncio
import json
import socket

from .support import RawClient, raw_exchange, wait_until


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_one_json_line_per_request_with_timings_outcome_and_ledger(fast_upstream, start_proxy, tmp_path):
    log = tmp_path / "logs" / "access.log"
    proxy = start_proxy(fast_upstream().url, **{"access_log.path": str(log)})
    client = RawClient(proxy.port)
    for _ in range(2):
        client.roundtrip("POST", "/v1/chat/completions?x=\"q\"",
                         headers=[("x-request-id", 'id "with" quotes\\')], body=b'{"stream": true}')
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    failing = start_proxy(f"http://127.0.0.1:{dead}", **{"access_log.path": str(log)})
    RawClient(failing.port).roundtrip("GET", "/v1/models")
    assert wait_until(lambda: len(_lines(log)) == 3, timeout=5)  # flushed within the flush interval
    first, second, failed = _lines(log)
    assert first["request_id"] == 'id "with" quotes\\' and first["path"] == '/v1/chat/completions?x="q"'
    assert first["status"] == 200 and first["outcome"] == "OK" and first["blame"] == "-"
    assert first["client_request_sequence"] == 1 and second["client_request_sequence"] == 2
    assert first["upstream_reused"] is False and second["upstream_reused"] is True
    assert second["client_idle_gap"] >= 0 and second["upstream_connection_request"] == 2
    for name in ("upstream_connect_time", "upstream_header_time", "upstream_response_time", "time_to_first_byte",
                 "time_to_first_chunk", "request_time"):
        assert 0 <= first[name] <= first["request_time"] + 1e-6, name
    assert len(first["trace_id"]) == 32 and first["time"].endswith("Z") and first["chunks"] >= 1
    assert failed["status"] == 502 and failed["outcome"] == "UF" and failed["blame"] == "engine"
    assert "refused" in failed["error"] and failed["upstream_connection"] is None


def test_the_proxys_own_replies_count_their_body_and_first_byte(fast_upstream, start_proxy, tmp_path):
    # Like nginx's $body_bytes_sent for an error page: the JSON error body the proxy
    # wrote is what the client received, whether the upstream failed or the request
    # was refused before anything went upstream.
    log = tmp_path / "access.log"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    failing = start_proxy(f"http://127.0.0.1:{dead}", **{"access_log.path": str(log)})
    refused_by_upstream = RawClient(failing.port).roundtrip("GET", "/v1/models")
    proxy = start_proxy(fast_upstream().url, **{"access_log.path": str(log)})
    refused_here = raw_exchange(proxy.port, b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\n"
                                            b"Content-Length: 2\r\n\r\nxy")
    assert wait_until(lambda: len(_lines(log)) == 2, timeout=5)
    upstream_failed, bad_request = _lines(log)
    assert upstream_failed["status"] == 502 and upstream_failed["response_bytes"] == len(refused_by_upstream.body) > 0
    assert refused_here.startswith(b"HTTP/1.1 400 ")
    assert bad_request["status"] == 400 and bad_request["outcome"] == "DPE"
    assert bad_request["response_bytes"] == len(refused_here.split(b"\r\n\r\n", 1)[1]) > 0
    assert 0 <= bad_request["time_to_first_byte"] <= bad_request["request_time"] + 1e-6


def test_a_pipelined_requests_connect_time_is_not_its_wait_for_its_turn(scripted_upstream, start_proxy, tmp_path):
    async def slow_then_fast(reader, writer, upstream):
        for delay in (0.6, 0):
            await reader.read_request()
            await asyncio.sleep(delay)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    log = tmp_path / "access.log"
    proxy = start_proxy(scripted_upstream(slow_then_fast).url, **{"access_log.path": str(log)})
    reply = raw_exchange(proxy.port, b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n"
                                     b"GET /behind HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    assert reply.count(b"HTTP/1.1 200 OK") == 2
    assert wait_until(lambda: len(_lines(log)) == 2, timeout=5)
    slow, behind = _lines(log)
    assert behind["path"] == "/behind" and behind["upstream_reused"] is True
    assert behind["request_time"] >= 0.5  # it waited for /slow
    assert behind["upstream_connect_time"] < 0.1  # a pooled connection, taken at once in its turn
