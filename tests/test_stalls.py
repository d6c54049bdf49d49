"""The watchdog end to end: it fires for stuck requests while they are stuck, says
whose turn it is, aborts when asked, records stalls that resolve, and stays quiet
for healthy traffic."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import socket
import time
import urllib.request

from traceproxy.observe.spandata import KIND_INTERNAL
from traceproxy.observe.tracing import TracingObserver

from .support import (ListSink, RawClient, answers_in_parts, ended, header_value, never_answers, raw_exchange,
                      recv_until, streams_without_end, wait_until)

FAST = {"stall.client_headers": 0.3, "stall.client_body": 0.3, "stall.pool_wait": 0.3, "stall.first_byte": 0.3,
        "stall.stream_gap": 0.3, "stall.client_drain": 0.3}


def _proxy(start_proxy, upstream_url, **overrides):
    sink = ListSink()
    tracer = TracingObserver(sink, ("127.0.0.1", 0), ("127.0.0.1", 0), 1.0)
    proxy = start_proxy(upstream_url, observers=[tracer], **{**FAST, **overrides})
    proxy.watchdog.listeners.append(tracer)
    return proxy, sink


def _inflight(proxy) -> list[dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.admin_port}/debug/inflight", timeout=5) as resp:
        return json.loads(resp.read())["requests"]


def test_lone_stuck_request_on_an_idle_proxy_is_reported_while_stuck(scripted_upstream, start_proxy, caplog):
    caplog.set_level(logging.WARNING, logger="traceproxy.watchdog")
    proxy, sink = _proxy(start_proxy, scripted_upstream(never_answers).url)
    client = RawClient(proxy.port)
    client.request("POST", "/v1/chat/completions", headers=[("x-request-id", "stuck-1")], body=b"{}")
    assert wait_until(lambda: sink.now_items, timeout=3), "the watchdog never fired"
    # Still stuck, and visible as such:
    entry = _inflight(proxy)[0]
    assert entry["request_id"] == "stuck-1" and entry["phase"] == "awaiting_upstream_headers"
    assert entry["verdict"]["outcome"] == "FBS" and entry["verdict"]["blame"] == "engine"
    assert entry["verdict"]["stalled"] is True and entry["stalls"][0]["outcome"] == "FBS"
    span = sink.now_items[0]
    record = next(iter(proxy.ctx.in_flight.values()))
    assert span.kind == KIND_INTERNAL and span.trace_id == record.trace_id and span.parent_span_id == record.span_id
    assert span.attributes["traceproxy.stall.outcome"] == "FBS" and span.attributes["traceproxy.blame"] == "engine"
    line = next(r.getMessage() for r in caplog.records if "stall FBS" in r.getMessage())
    assert "stuck-1" in line and "blame engine" in line and "%032x" % record.trace_id in line
    client.close()


def test_slow_reader_is_blamed_on_the_client_not_the_engine(scripted_upstream, start_proxy):
    proxy, sink = _proxy(start_proxy, scripted_upstream(streams_without_end).url)
    client = RawClient(proxy.port)
    client.request("GET", "/big")  # and never read
    assert wait_until(lambda: sink.now_items, timeout=5)
    assert sink.now_items[0].attributes["traceproxy.stall.outcome"] == "DNR"
    assert sink.now_items[0].attributes["traceproxy.blame"] == "client"
    assert _inflight(proxy)[0]["client_paused_s"] is not None
    client.close()


def test_engine_silent_mid_stream_is_blamed_on_the_engine(scripted_upstream, start_proxy):
    stalls_mid_stream = answers_in_parts(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n7\r\ntoken-1\r\n")

    proxy, sink = _proxy(start_proxy, scripted_upstream(stalls_mid_stream).url)
    client = RawClient(proxy.port)
    client.request("POST", "/v1/chat/completions", body=b"{}")
    assert wait_until(lambda: sink.now_items, timeout=3)
    assert sink.now_items[0].attributes["traceproxy.stall.outcome"] == "MSS"
    assert _inflight(proxy)[0]["verdict"]["blame"] == "engine"
    client.close()


def test_a_stall_that_resolves_is_recorded_with_its_duration(scripted_upstream, start_proxy):
    pauses_then_finishes = answers_in_parts(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\none\r\n",
                                            b"3\r\ntwo\r\n0\r\n\r\n", pause=0.8)

    proxy, sink = _proxy(start_proxy, scripted_upstream(pauses_then_finishes).url)
    done = ended(proxy)
    resp = RawClient(proxy.port).roundtrip("GET", "/")
    assert resp.complete and resp.body == b"onetwo"
    assert wait_until(lambda: done)
    stall = done[0].stalls[0]
    assert stall.code == "MSS" and stall.resolved_ns is not None
    assert 0.6 < (stall.resolved_ns - stall.since_ns) / 1e9 < 5
    assert done[0].outcome.code == "OK"


def test_abort_action_ends_a_stuck_request_with_504_and_the_outcome(scripted_upstream, start_proxy):
    up = scripted_upstream(never_answers)
    proxy, _ = _proxy(start_proxy, up.url, **{"stall.action": "abort"})
    resp = RawClient(proxy.port).roundtrip("POST", "/generate", body=b"{}")
    assert resp.status == 504
    error = json.loads(resp.body)["error"]
    assert error["code"] == "FBS" and "aborted by the watchdog" in error["message"]
    assert up.closed.wait(2), "the upstream request must be cancelled"


def test_abort_on_lists_kinds_that_abort_while_others_only_observe(scripted_upstream, start_proxy):
    proxy, sink = _proxy(start_proxy, scripted_upstream(never_answers).url,
                         **{"stall.abort_on": ["stream_gap"]})
    client = RawClient(proxy.port)
    client.request("GET", "/")
    assert wait_until(lambda: sink.now_items, timeout=3)
    time.sleep(0.3)
    assert proxy.ctx.in_flight, "first_byte is not in abort_on: observed, not aborted"
    client.close()
    # ... and a kind that is listed does abort: the stream is cut, the request ends MSS.
    silent = answers_in_parts(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n7\r\ntoken-1\r\n")
    proxy, sink = _proxy(start_proxy, scripted_upstream(silent).url, **{"stall.abort_on": ["stream_gap"]})
    done = ended(proxy)
    client = RawClient(proxy.port)
    client.request("POST", "/v1/chat/completions", body=b"{}")
    response = client.response()
    assert response.status == 200 and not response.complete  # cut short, not ended as if whole
    assert wait_until(lambda: done, timeout=5) and done[0].outcome.code == "MSS"
    client.close()


def test_header_stall_from_a_client_that_stops_mid_head(fast_upstream, start_proxy):
    proxy, sink = _proxy(start_proxy, fast_upstream().url)
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: a\r\n")
        assert wait_until(lambda: sink.now_items, timeout=3)
    assert sink.now_items[0].attributes["traceproxy.stall.outcome"] == "DHS"
    assert sink.now_items[0].attributes["traceproxy.blame"] == "client"


def test_a_head_stall_span_and_its_request_share_one_trace(fast_upstream, start_proxy):
    # The watchdog gives a request stalled mid-head its ids for the stall span; when
    # the head then completes (no trace context of its own), the request keeps them.
    proxy, sink = _proxy(start_proxy, fast_upstream().url)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: a\r\n")
        assert wait_until(lambda: sink.now_items, timeout=3)
        sock.sendall(b"Connection: close\r\n\r\n")
        reply = recv_until(sock, b"\r\n\r\n")
    assert wait_until(lambda: sink.items)
    stall, summary = sink.now_items[0], sink.items[0]
    assert stall.trace_id == summary.trace_id and stall.parent_span_id == summary.span_id
    assert stall.attributes["traceproxy.request_id"] == summary.request_id
    assert header_value(reply, b"x-request-id").decode() == summary.request_id


def test_no_false_alarms_for_2000_healthy_streams_with_jitter(fast_upstream, start_proxy, loop_thread):
    up = fast_upstream()
    proxy, sink = _proxy(start_proxy, up.url)
    rng = random.Random(7)

    async def one_connection(rounds: int) -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        ok = 0
        for _ in range(rounds):
            tps = rng.choice([50, 80, 120])  # token gaps of 8..20 ms, well under the 300 ms threshold
            body = b'{"stream": true, "max_tokens": 6}'
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nx-fake-tps: %d\r\n"
                         b"x-fake-ttft-ms: %d\r\nContent-Length: %d\r\n\r\n%s"
                         % (tps, rng.randint(1, 40), len(body), body))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200")
            data = b""
            while not data.endswith(b"0\r\n\r\n"):
                data += await asyncio.wait_for(reader.read(65536), 10)
            ok += b"[DONE]" in data
            await asyncio.sleep(rng.uniform(0, 0.02))
        writer.close()
        return ok

    async def run() -> int:
        results = await asyncio.gather(*(one_connection(20) for _ in range(100)))
        return sum(results)

    assert loop_thread.run(run(), timeout=120) == 2000
    assert sink.now_items == []
    assert all(not r.stalls for r in sink.items) if sink.items else True
    assert proxy.watchdog.open == {}


def _slow_first_stream(requests: int):
    """An upstream that answers ``requests`` requests in turn, each with a chunked
    stream: 8 tokens 0.15 s apart for /slow (slowly but steadily), 1 for the others."""
    async def handler(reader, writer, upstream):
        for _ in range(requests):
            head, _ = await reader.read_request()
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(8 if b"/slow" in head else 1):
                await asyncio.sleep(0.15)
                writer.write(b"3\r\ntok\r\n")
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    return handler


def _read_until_closed(sock: socket.socket) -> bytes:
    reply = b""
    for _ in range(200):  # bounded: a few short responses need far fewer reads
        piece = sock.recv(65536)
        if not piece:
            break
        reply += piece
    return reply


def test_a_pipelined_request_waiting_its_turn_is_not_a_stall_and_never_aborted(scripted_upstream, start_proxy):
    # The first request streams slowly but steadily; the second, sent with it, has
    # nothing left to send: nobody owes it a byte until its turn. An abort written
    # for it would land inside the first response's body.
    proxy, sink = _proxy(start_proxy, scripted_upstream(_slow_first_stream(2)).url,
                         **{"stall.stream_gap": 1.0, "stall.action": "abort"})
    reply = raw_exchange(proxy.port, b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n"
                                     b"GET /second HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    assert reply.count(b"HTTP/1.1 200 OK") == 2 and b" 408 " not in reply and not sink.now_items
    assert reply.count(b"3\r\ntok\r\n") == 9


def test_a_head_the_proxy_stopped_reading_behind_queued_requests_is_not_the_clients_stall(
        scripted_upstream, start_proxy):
    # The third request's head is complete on the wire 0.1 s after its first line, but
    # the proxy stops reading at the queued second request: the silence is the proxy's
    # pipeline, not the client's. An abort (a 408) would land inside the first response.
    proxy, sink = _proxy(start_proxy, scripted_upstream(_slow_first_stream(3)).url,
                         **{"stall.stream_gap": 1.0, "stall.action": "abort"})
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\nGET /second HTTP/1.1\r\nHost: a\r\n\r\n"
                     b"GET /third HTTP/1.1\r\n")
        time.sleep(0.1)
        sock.sendall(b"Host: a\r\nConnection: close\r\n\r\n")
        assert wait_until(lambda: [e["phase"] for e in _inflight(proxy)].count("waiting_turn") == 2)
        reply = _read_until_closed(sock)
    assert reply.count(b"HTTP/1.1 200 OK") == 3 and b" 408 " not in reply, reply[-300:]
    assert not sink.now_items, "a stall was reported for a head the proxy was not reading"


def test_a_pipelined_body_is_timed_from_its_turn_not_from_when_it_was_queued(scripted_upstream, start_proxy):
    # The second request's body stops short while the first response takes 2 s: the
    # proxy is not reading then. In its turn the client finishes it within 0.5 s, far
    # less than the 1 s allowed for a silent body: no stall, no 408.
    proxy, sink = _proxy(start_proxy, scripted_upstream(_slow_first_stream(2)).url,
                         **{"stall.client_body": 1.0, "stall.stream_gap": 5.0, "stall.action": "abort",
                            "timeouts.client_body": 1.0})
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n"
                     b"POST /second HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\nConnection: close\r\n\r\nab")
        assert wait_until(lambda: any(e["phase"] == "awaiting_request_body" for e in _inflight(proxy)), timeout=10)
        time.sleep(0.5)
        sock.sendall(b"cd")
        reply = _read_until_closed(sock)
    assert reply.count(b"HTTP/1.1 200 OK") == 2 and b" 408 " not in reply, reply[-300:]
    assert not sink.now_items, "a stall was reported for the time the request waited its turn"


def test_a_shorter_stall_after_a_longer_wait_is_found_at_its_own_threshold(scripted_upstream, start_proxy, caplog):
    # First byte allowed 5 s; the head and a token come after 0.5 s, then silence:
    # the stream-gap stall (0.3 s) is due long before the first-byte deadline the
    # watchdog aimed at when it last looked.
    async def stalls_mid_stream(reader, writer, upstream):
        await reader.read_request()
        await asyncio.sleep(0.5)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n7\r\ntoken-1\r\n")
        await writer.drain()
        await reader.read(1)

    proxy, sink = _proxy(start_proxy, scripted_upstream(stalls_mid_stream).url, **{"stall.first_byte": 5.0})
    client = RawClient(proxy.port)
    started = time.monotonic()
    client.request("POST", "/v1/chat/completions", body=b"{}")
    assert wait_until(lambda: sink.now_items, timeout=8)
    assert sink.now_items[0].attributes["traceproxy.stall.outcome"] == "MSS"
    # Due at about 0.9 s (the head, the gap threshold, at most a quarter of the smallest
    # threshold); a watchdog that slept to the first-byte deadline would say it at 5 s.
    assert time.monotonic() - started < 3.0
    client.close()


def test_a_client_not_reading_is_disconnected_when_its_stall_aborts_the_stream(scripted_upstream, start_proxy):
    # A clean close would wait for the client to drain what is buffered, which a
    # client that is not reading never does: the connection would stay open.
    proxy, sink = _proxy(start_proxy, scripted_upstream(streams_without_end).url, **{"stall.abort_on": ["client_drain"]})
    client = RawClient(proxy.port)
    client.request("GET", "/big")  # and never read
    assert wait_until(lambda: sink.now_items, timeout=5)
    assert wait_until(lambda: not proxy.ctx.connections, timeout=3)
    client.close()


def test_a_stall_resolved_by_the_end_of_a_stream_without_done_is_resolved(scripted_upstream, start_proxy):
    # The engine goes silent mid-stream, then ends it cleanly but without [DONE] (NDN):
    # the awaited bytes came, so the stall resolved; NDN is about the ending, not it.
    pauses_then_ends = answers_in_parts(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"b\r\ndata: one\n\n\r\n", b"b\r\ndata: two\n\n\r\n0\r\n\r\n", pause=0.8)
    proxy, sink = _proxy(start_proxy, scripted_upstream(pauses_then_ends).url)
    done = ended(proxy)
    assert RawClient(proxy.port).roundtrip("GET", "/").complete
    assert wait_until(lambda: done)
    assert done[0].outcome.code == "NDN"
    assert done[0].stalls and done[0].stalls[0].code == "MSS" and done[0].stalls[0].resolved_ns is not None


def test_a_head_stall_resolves_when_the_head_arrives(scripted_upstream, start_proxy):
    async def answers_later(reader, writer, upstream):
        await reader.read_request()
        await asyncio.sleep(0.6)  # the watchdog looks again before the request ends
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    proxy, sink = _proxy(start_proxy, scripted_upstream(answers_later).url, **{"stall.first_byte": 5.0})
    done = ended(proxy)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: a\r\n")
        assert wait_until(lambda: sink.now_items, timeout=3)
        sock.sendall(b"Connection: close\r\n\r\n")
        assert recv_until(sock, b"ok").startswith(b"HTTP/1.1 200 ")
    assert wait_until(lambda: done)
    stall = done[0].stalls[0]
    assert stall.code == "DHS" and stall.resolved_ns is not None


def test_a_refused_pipelined_request_waiting_its_turn_is_not_a_stall(scripted_upstream, start_proxy):
    proxy, sink = _proxy(start_proxy, scripted_upstream(_slow_first_stream(1)).url, **{"stall.stream_gap": 1.0})
    reply = raw_exchange(proxy.port, b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\nGET /second HTTP/1.1\r\nHost: a/b\r\n\r\n")
    assert reply.count(b"3\r\ntok\r\n") == 8 and b"HTTP/1.1 400 " in reply
    assert not sink.now_items


def test_a_client_body_stall_outlives_a_resend_and_resolves_when_the_body_comes():
    # The client went silent mid-body on a reused connection, which then died and was
    # replaced: the silence is still the client's, and its stall ends when it sends.
    from traceproxy.lifecycle.marks import MARK
    from traceproxy.lifecycle.stall import StallThresholds, judge
    from traceproxy.lifecycle.timeline import ClientConnectionRecord
    from traceproxy.observe.watchdog import Watchdog

    second = 1_000_000_000
    record = ClientConnectionRecord(peer="p", opened_ns=0).begin_request(0)
    record.mark(MARK.LAST_DOWNSTREAM_RX_HEADER_BYTE, 0)
    record.new_attempt(0, 1)
    record.mark(MARK.POOL_ACQUIRED, 0)
    record.mark(MARK.FIRST_UPSTREAM_TX_BYTE, 0)
    record.last_downstream_rx_ns = 1 * second
    thresholds = StallThresholds(client_headers=1, client_body=1, pool_wait=1, first_byte=1, stream_gap=1,
                                 client_drain=1)
    watchdog = Watchdog(lambda: [record], thresholds)
    judgement = judge(record, 3 * second, thresholds)
    assert judgement is not None and judgement.verdict.outcome.code == "DBS"
    watchdog._report(judgement, 3 * second)
    record.new_attempt(4 * second, 2)  # the resend: for a moment it reads as a connect
    watchdog._check_open(int(4.001 * second))
    assert record.stalls[0].resolved_ns is None and record.id in watchdog.open  # still the client's silence
    record.mark(MARK.POOL_ACQUIRED, 4 * second)
    record.mark(MARK.FIRST_UPSTREAM_TX_BYTE, 4 * second)
    record.last_downstream_rx_ns = 5 * second  # the client's next bytes, then its last
    record.mark(MARK.LAST_DOWNSTREAM_RX_BYTE, 5 * second)
    record.mark(MARK.LAST_UPSTREAM_TX_BYTE, 5 * second)
    watchdog._check_open(5 * second)
    (stall,) = record.stalls
    assert stall.code == "DBS" and stall.resolved_ns == 5 * second


def _streaming_record(start_ns: int):
    from traceproxy.lifecycle.marks import MARK
    from traceproxy.lifecycle.timeline import ClientConnectionRecord

    record = ClientConnectionRecord(peer="p", opened_ns=start_ns).begin_request(start_ns)
    for mark in (MARK.LAST_DOWNSTREAM_RX_HEADER_BYTE, MARK.LAST_DOWNSTREAM_RX_BYTE):
        record.mark(mark, start_ns)
    record.new_attempt(start_ns, 1)
    for mark in (MARK.POOL_ACQUIRED, MARK.FIRST_UPSTREAM_TX_BYTE, MARK.LAST_UPSTREAM_TX_BYTE):
        record.mark(mark, start_ns)
    return record


ONE_SECOND_EACH = dict(client_headers=1, client_body=1, pool_wait=1, first_byte=1, stream_gap=1, client_drain=1)


def test_an_engine_stall_on_a_connection_that_died_and_was_resent_stays_unresolved():
    from traceproxy.lifecycle.marks import MARK
    from traceproxy.lifecycle.stall import StallThresholds, judge
    from traceproxy.observe.watchdog import Watchdog

    second = 1_000_000_000
    record = _streaming_record(0)  # sent, no response byte
    thresholds = StallThresholds(**ONE_SECOND_EACH)
    watchdog = Watchdog(lambda: [record], thresholds)
    watchdog._report(judge(record, 3 * second, thresholds), 3 * second)
    record.new_attempt(4 * second, 2)  # the connection died; resent on a fresh one, which answers
    for mark in (MARK.POOL_ACQUIRED, MARK.FIRST_UPSTREAM_TX_BYTE, MARK.LAST_UPSTREAM_TX_BYTE,
                 MARK.FIRST_UPSTREAM_RX_BYTE, MARK.LAST_UPSTREAM_RX_HEADER_BYTE):
        record.mark(mark, 4 * second)
    watchdog._check_open(5 * second)
    (stall,) = record.stalls
    assert stall.code == "FBS" and stall.resolved_ns is None  # no byte ever came on the attempt it was judged on


def test_the_watchdog_re_judges_an_open_stall_and_resolves_it_when_the_client_reads_again():
    import time as clock

    from traceproxy.lifecycle.marks import MARK
    from traceproxy.lifecycle.stall import StallThresholds
    from traceproxy.observe.watchdog import Watchdog

    async def main():
        second = 1_000_000_000
        start = clock.monotonic_ns() - 10 * second
        record = _streaming_record(start)
        for mark in (MARK.FIRST_UPSTREAM_RX_BYTE, MARK.LAST_UPSTREAM_RX_HEADER_BYTE, MARK.FIRST_DOWNSTREAM_TX_BYTE,
                     MARK.FIRST_UPSTREAM_RX_BODY_BYTE, MARK.FIRST_DOWNSTREAM_TX_BODY_BYTE):
            record.mark(mark, start)
        record.upstream_rx_chunks = 1
        record.last_upstream_rx_ns = record.last_downstream_tx_ns = start
        record.downstream_paused_since_ns = start + 2 * second  # the client stopped reading
        watchdog = Watchdog(lambda: [record], StallThresholds(**ONE_SECOND_EACH))
        watchdog._wake()
        (stall,) = record.stalls
        assert stall.code == "DNR" and stall.resolved_ns is None
        resumed = clock.monotonic_ns()
        record.downstream_paused_since_ns = None  # it reads again, and takes what was waiting
        record.last_upstream_rx_ns = record.last_downstream_tx_ns = resumed
        watchdog._wake()
        watchdog.stop()
        assert stall.resolved_ns is not None and stall.resolved_ns >= resumed

    asyncio.run(main())


def test_a_client_body_stall_does_not_hide_the_engine_stall_that_follows_it():
    # The client sent 10 of 100 body bytes and went silent; the engine answered early,
    # then went silent too: that second stall is the engine's, and must be reported.
    from traceproxy.lifecycle.marks import MARK
    from traceproxy.lifecycle.stall import StallThresholds, judge
    from traceproxy.lifecycle.timeline import ClientConnectionRecord
    from traceproxy.observe.watchdog import Watchdog

    second = 1_000_000_000
    record = ClientConnectionRecord(peer="p", opened_ns=0).begin_request(0)
    record.mark(MARK.LAST_DOWNSTREAM_RX_HEADER_BYTE, 0)
    record.new_attempt(0, 1)
    for mark in (MARK.POOL_ACQUIRED, MARK.FIRST_UPSTREAM_TX_BYTE):
        record.mark(mark, 0)
    record.last_downstream_rx_ns = 0
    thresholds = StallThresholds(**ONE_SECOND_EACH)
    watchdog = Watchdog(lambda: [record], thresholds)
    watchdog._report(judge(record, 2 * second, thresholds), 2 * second)
    for mark in (MARK.FIRST_UPSTREAM_RX_BYTE, MARK.LAST_UPSTREAM_RX_HEADER_BYTE, MARK.FIRST_DOWNSTREAM_TX_BYTE,
                 MARK.FIRST_UPSTREAM_RX_BODY_BYTE, MARK.FIRST_DOWNSTREAM_TX_BODY_BYTE):
        record.mark(mark, 3 * second)
    record.upstream_rx_chunks = 1
    record.last_upstream_rx_ns = record.last_downstream_tx_ns = 3 * second
    later = judge(record, 5 * second, thresholds)
    assert later.stalled and later.verdict.outcome.code == "MSS"
    watchdog._check_open(5 * second)
    assert record.id not in watchdog.open, "the client's stall still held the request's one open stall"
    watchdog._report(later, 5 * second)  # what the same pass of the watchdog does next
    assert [stall.code for stall in record.stalls] == ["DBS", "MSS"]
