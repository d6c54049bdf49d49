"""Spans built from real requests through the proxy: structure, ids that match the
wire, marks as events, the keep-alive ledger, GenAI attributes, tail sampling."""

from __future__ import annotations

import json
import socket
import time

from traceproxy.observe import semconv as sc
from traceproxy.observe.spandata import KIND_CLIENT, KIND_SERVER, STATUS_ERROR
from traceproxy.observe.spans import spans_for
from traceproxy.observe.tracing import RateCeiling, TracingObserver, healthy_ratio_from_environment
from traceproxy.proxy import tracecontext as tc

from .support import ListSink, RawClient, answers_in_parts, answers_then_drops_next_request, header_value, wait_until


def _traced(start_proxy, upstream_url, sink=None, ratio=1.0, settings=None, **options):
    """(proxy, sink, observer): a proxy (``settings``: overrides of its own) whose tracing
    observer (``options``: its own) hands its output to ``sink``."""
    sink = sink if sink is not None else ListSink()
    observer = TracingObserver(sink, ("127.0.0.1", 8000), ("127.0.0.1", 1), ratio, **options)
    return start_proxy(upstream_url, observers=[observer], **(settings or {})), sink, observer


def _traced_proxy(start_proxy, upstream_url, ratio=1.0, **overrides):
    proxy, sink, _ = _traced(start_proxy, upstream_url, ratio=ratio, settings=overrides)
    return proxy, sink


CHAT = json.dumps({"model": "m-7b", "stream": True, "max_tokens": 5,
                   "messages": [{"role": "user", "content": "hi"}]}).encode()


def test_streaming_chat_spans(fast_upstream, start_proxy):
    proxy, sink = _traced_proxy(start_proxy, fast_upstream().url)
    client = RawClient(proxy.port)
    resp = client.roundtrip("POST", "/v1/chat/completions", headers=[("User-Agent", "harness/1")], body=CHAT)
    time.sleep(0.2)  # the harness thinks between turns: the second request's idle gap
    client.roundtrip("POST", "/v1/chat/completions", body=CHAT)
    assert wait_until(lambda: len(sink.items) == 2)
    server, upstream_span = spans_for(sink.items[0])
    assert server.kind == KIND_SERVER and upstream_span.kind == KIND_CLIENT
    assert server.name == "POST /v1/chat/completions"
    assert upstream_span.parent_span_id == server.span_id and upstream_span.trace_id == server.trace_id
    returned = tc.parse_traceparent(resp.headers["traceresponse"].encode())
    assert (returned.trace_id, returned.parent_span_id) == (server.trace_id, server.span_id)
    # Ended at the last byte, not at the response headers.
    event_times = {e.name: e.time_unix_ns for e in server.events}
    assert server.end_unix_ns >= event_times["last_downstream_tx_byte"] > event_times["first_downstream_tx_byte"]
    assert [e.time_unix_ns for e in server.events] == sorted(e.time_unix_ns for e in server.events)
    attrs = server.attributes
    assert attrs[sc.HTTP_RESPONSE_STATUS_CODE] == 200 and attrs[sc.HTTP_ROUTE] == "/v1/chat/completions"
    assert attrs[sc.USER_AGENT_ORIGINAL] == "harness/1" and attrs[sc.OUTCOME] == "OK"
    assert attrs[sc.GEN_AI_REQUEST_MODEL] == "m-7b" and attrs[sc.GEN_AI_REQUEST_STREAM] is True
    assert attrs[sc.GEN_AI_REQUEST_MAX_TOKENS] == 5
    assert attrs[sc.GEN_AI_USAGE_OUTPUT_TOKENS] == 5 and attrs[sc.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
    assert attrs[sc.DONE_SEEN] is True and attrs[sc.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] > 0
    assert attrs[sc.REQUEST_ID] == resp.headers["x-request-id"]
    second_server, second_client = spans_for(sink.items[1])
    assert second_server.attributes[sc.CLIENT_REQUEST_SEQUENCE] == 2
    assert 0.2 <= second_server.attributes[sc.CLIENT_IDLE_GAP] < 5
    assert second_client.attributes[sc.UPSTREAM_CONNECTION_REUSED] is True
    assert second_client.attributes[sc.UPSTREAM_CONNECTION_REQUEST_NUMBER] == 2


def test_failed_request_span_is_an_error_with_the_outcome(start_proxy):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    proxy, sink = _traced_proxy(start_proxy, f"http://127.0.0.1:{dead}")
    RawClient(proxy.port).roundtrip("GET", "/v1/models")
    assert wait_until(lambda: sink.items)
    server, attempt = spans_for(sink.items[0])
    assert server.status_code == STATUS_ERROR and "refused" in server.status_message
    assert server.attributes[sc.OUTCOME] == "UF" and server.attributes[sc.BLAME] == "engine"
    assert server.attributes[sc.ERROR_TYPE] == "upstream_connection_failure"
    assert attempt.status_code == STATUS_ERROR
    # The attempt never had a connection: its span still has a real id (OTLP: all
    # zeros is invalid), spans the connect, and reports no status the engine never sent.
    assert attempt.span_id != 0
    assert server.start_unix_ns <= attempt.start_unix_ns < attempt.end_unix_ns <= server.end_unix_ns
    assert sc.HTTP_RESPONSE_STATUS_CODE not in attempt.attributes
    assert server.attributes[sc.HTTP_RESPONSE_STATUS_CODE] == 502
    # Nor a connection it never had (not "connection 0, new, request 0 on it").
    assert not {sc.UPSTREAM_CONNECTION_ID, sc.UPSTREAM_CONNECTION_REUSED, sc.UPSTREAM_CONNECTION_IDLE_AGE,
                sc.UPSTREAM_CONNECTION_REQUEST_NUMBER} & set(attempt.attributes)


def test_a_refused_request_is_named_by_what_of_it_was_read(fast_upstream, start_proxy):
    # Refused after its request line (a bad Host, a head llhttp rejects): its span and
    # log line still say which request it was; before it, the span is named "HTTP".
    proxy, sink = _traced_proxy(start_proxy, fast_upstream().url)
    for raw in (b"GET /v1/models?a=1 HTTP/1.1\r\nHost: a b\r\n\r\n",
                b"GET http://alice:s3cret@example.com/v1/models HTTP/1.1\r\nHost: a\r\n\r\n",
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nBad Header: x\r\n\r\n",
                b"\x01\x02 / HTTP/1.1\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
            sock.sendall(raw)
            assert sock.recv(65536).startswith(b"HTTP/1.1 400 ")
    assert wait_until(lambda: len(sink.items) == 4)
    names = [spans_for(summary)[0].name for summary in sink.items]
    assert names == ["GET /v1/models", "GET", "POST /v1/chat/completions", "HTTP"]
    assert spans_for(sink.items[1])[0].attributes[sc.URL_PATH] == "http://example.com/v1/models"  # no password
    unknown = spans_for(sink.items[3])[0].attributes
    assert unknown[sc.HTTP_REQUEST_METHOD] == "_OTHER"
    assert spans_for(sink.items[0])[0].attributes[sc.URL_QUERY] == "a=1"


def test_a_resend_is_a_second_client_span_with_resend_count(scripted_upstream, start_proxy):
    proxy, sink = _traced_proxy(start_proxy, scripted_upstream(answers_then_drops_next_request()).url)
    client = RawClient(proxy.port)
    client.roundtrip("GET", "/v1/models")
    client.roundtrip("GET", "/v1/models")
    assert wait_until(lambda: len(sink.items) == 2)
    server, stale, fresh = spans_for(sink.items[1])
    assert stale.attributes[sc.OUTCOME] == "SRC" and stale.attributes[sc.UPSTREAM_CONNECTION_REUSED] is True
    assert fresh.attributes[sc.HTTP_REQUEST_RESEND_COUNT] == 1 and fresh.attributes[sc.OUTCOME] == "OK"
    assert server.attributes[sc.ATTEMPTS] == 2 and server.attributes[sc.OUTCOME] == "OK"
    assert stale.parent_span_id == fresh.parent_span_id == server.span_id
    # The failed attempt ends when its connection went, before the resend started.
    assert stale.end_unix_ns <= fresh.start_unix_ns


def test_healthy_requests_sampled_by_ratio_errors_always_kept(fast_upstream, start_proxy):
    proxy, sink = _traced_proxy(start_proxy, fast_upstream().url, ratio=0.0)
    client = RawClient(proxy.port)
    for _ in range(5):
        client.roundtrip("GET", "/v1/models")
    client.roundtrip("GET", "/missing")  # a 404 is not an error of the proxy's: sampled like the rest
    raw = b"GET / HTTP/1.1\r\nHost: a\r\nBad\r\n\r\n"
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(raw)
        assert header_value(sock.recv(65536), b"x-traceproxy-outcome") == b"DPE"
    assert wait_until(lambda: len(sink.items) == 1)
    assert sink.items[0].outcome == "DPE"


def test_a_backlogged_exporter_sheds_healthy_spans_but_never_failed_ones(fast_upstream, start_proxy):
    proxy, sink, observer = _traced(start_proxy, fast_upstream().url, ListSink(backlog=True))
    client = RawClient(proxy.port)
    for _ in range(3):
        client.roundtrip("GET", "/v1/models")
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: a\r\nBad\r\n\r\n")
        assert header_value(sock.recv(65536), b"x-traceproxy-outcome") == b"DPE"
    assert wait_until(lambda: len(sink.items) == 1)
    assert sink.items[0].outcome == "DPE"
    assert observer.shed == {"rate": 0, "backlog": 3} and observer.sampled_out == 0
    sink.backlog = False  # caught up: healthy spans flow again
    client.roundtrip("GET", "/v1/models")
    assert wait_until(lambda: len(sink.items) == 2) and sink.items[1].outcome == "OK"


def test_shed_requests_still_send_their_access_log_line(fast_upstream, start_proxy):
    proxy, sink, observer = _traced(start_proxy, fast_upstream().url, ListSink(backlog=True), access_log=True)
    RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", body=b'{"model": "m", "max_tokens": 2}')
    assert wait_until(lambda: len(sink.lines) == 1)
    assert observer.shed == {"rate": 0, "backlog": 1}
    assert sink.items == []  # its spans were shed: nothing else goes to the exporter
    line = json.loads(sink.lines[0])
    assert line["outcome"] == "OK" and line["request_bytes"] > 0 and line["response_bytes"] > 0


def test_a_kept_request_sends_its_summary_and_its_line(fast_upstream, start_proxy):
    proxy, sink, observer = _traced(start_proxy, fast_upstream().url, access_log=True)
    RawClient(proxy.port).roundtrip("GET", "/v1/models")
    assert wait_until(lambda: len(sink.lines) == 1 and len(sink.items) == 1)
    [summary] = sink.items
    assert json.loads(sink.lines[0])["trace_id"] == f"{summary.trace_id:032x}"


def test_healthy_traces_past_the_rate_ceiling_are_shed_failed_ones_never(fast_upstream, start_proxy):
    proxy, sink, observer = _traced(start_proxy, fast_upstream().url, healthy_max_per_second=2)
    client = RawClient(proxy.port)
    for _ in range(5):  # well within one second: a burst of two is kept
        client.roundtrip("GET", "/v1/models")
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: a\r\nBad\r\n\r\n")
        assert header_value(sock.recv(65536), b"x-traceproxy-outcome") == b"DPE"
    assert wait_until(lambda: len(sink.items) == 3)
    assert [item.outcome for item in sink.items] == ["OK", "OK", "DPE"]
    assert observer.shed == {"rate": 3, "backlog": 0}


def test_rate_ceiling_is_a_token_bucket_on_the_callers_clock():
    second = 1_000_000_000
    ceiling = RateCeiling(4)
    assert [ceiling.take(0) for _ in range(5)] == [True] * 4 + [False]  # a burst of one second's worth
    assert ceiling.take(second // 4) and not ceiling.take(second // 4)  # refills at 4 a second
    assert not ceiling.take(second // 8)  # an earlier end than the last adds nothing
    assert [ceiling.take(10 * second) for _ in range(5)] == [True] * 4 + [False]  # never beyond one burst
    assert all(RateCeiling(0).take(0) for _ in range(1000))  # 0: no ceiling


def test_sample_ratio_from_otel_environment():
    assert healthy_ratio_from_environment(None, {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                                                 "OTEL_TRACES_SAMPLER_ARG": "0.25"}) == 0.25
    assert healthy_ratio_from_environment(None, {"OTEL_TRACES_SAMPLER": "always_off"}) == 0.0
    assert healthy_ratio_from_environment(0.5, {"OTEL_TRACES_SAMPLER": "always_off"}) == 0.5
    assert healthy_ratio_from_environment(None, {}) == 1.0


def test_genai_attributes_of_a_long_conversation(fast_upstream, start_proxy):
    # A multi-turn chat far past the kept head of the body, with the fields an SDK
    # writes after the messages, and a tool schema that names "model" and "stream" too.
    messages = [{"role": "user", "content": f'turn {i}: say "model": "x" ' + "words " * 40} for i in range(100)]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"model": {"type": "string"}, "stream": {"type": "boolean"}}}}}]
    body = json.dumps({"messages": messages, "model": "m-70b", "max_tokens": 3, "stream": True,
                       "tools": tools}).encode()
    assert len(body) > 20_000
    proxy, sink = _traced_proxy(start_proxy, fast_upstream().url)
    assert RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", body=body).complete
    assert wait_until(lambda: sink.items)
    attrs = spans_for(sink.items[0])[0].attributes
    assert attrs[sc.GEN_AI_REQUEST_MODEL] == "m-70b" and attrs[sc.GEN_AI_REQUEST_STREAM] is True
    assert attrs[sc.GEN_AI_REQUEST_MAX_TOKENS] == 3 and attrs[sc.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] > 0
    assert attrs[sc.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)


def test_genai_usage_and_finish_reason_of_a_long_non_streamed_answer():
    from traceproxy.observe.spans import _response_attributes

    answer = json.dumps({"id": "c-1", "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "a" * 20_000}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 34}}).encode()
    attrs: dict = {}
    _response_attributes(answer[-8192:], attrs)  # what is kept of it: its last reads
    assert attrs[sc.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert (attrs[sc.GEN_AI_USAGE_INPUT_TOKENS], attrs[sc.GEN_AI_USAGE_OUTPUT_TOKENS]) == (12, 34)


def test_finish_reason_usage_and_done_in_separate_reads_are_all_seen(scripted_upstream, start_proxy):
    # stream_options.include_usage: the finish chunk, the usage chunk and [DONE] can
    # each arrive in a read of its own at the end of the stream.
    events = [b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n',
              b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
              b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1}}\n\n',
              b"data: [DONE]\n\n"]
    parts = [b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"]
    parts += [b"%x\r\n%s\r\n" % (len(event), event) for event in events]
    parts[-1] += b"0\r\n\r\n"
    proxy, sink = _traced_proxy(start_proxy, scripted_upstream(answers_in_parts(*parts, pause=0.05)).url)
    body = json.dumps({"model": "m", "stream": True, "stream_options": {"include_usage": True},
                       "messages": []}).encode()
    assert RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", body=body).complete
    assert wait_until(lambda: sink.items)
    attrs = spans_for(sink.items[0])[0].attributes
    assert attrs[sc.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",) and attrs[sc.GEN_AI_USAGE_OUTPUT_TOKENS] == 1
    assert attrs[sc.DONE_SEEN] is True


def test_the_client_span_status_is_the_upstreams_not_the_proxys_reply(scripted_upstream, start_proxy):
    # The head (200) and a malformed chunk come in one read: the client gets a 502 UPE,
    # but the upstream answered 200, and that is what its CLIENT span says.
    proxy, sink = _traced_proxy(start_proxy, scripted_upstream(
        answers_in_parts(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n")).url)
    assert RawClient(proxy.port).roundtrip("GET", "/v1/models").status == 502
    assert wait_until(lambda: sink.items)
    server, attempt = spans_for(sink.items[0])
    assert server.attributes[sc.HTTP_RESPONSE_STATUS_CODE] == 502
    assert attempt.attributes[sc.HTTP_RESPONSE_STATUS_CODE] == 200 and attempt.status_code == STATUS_ERROR


def test_a_summary_is_built_whole_field_for_field(fast_upstream, start_proxy):
    # summarize builds its named tuples with tuple.__new__ (no field-count check): a
    # field added to RequestSummary or AttemptSummary and not to summarize must fail here.
    from traceproxy.observe.spans import AttemptSummary, RequestSummary

    proxy, sink = _traced_proxy(start_proxy, fast_upstream().url)
    RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", headers=[("User-Agent", "harness/1")],
                                    body=CHAT)
    assert wait_until(lambda: len(sink.items) == 1)
    [summary] = sink.items
    assert len(summary) == len(RequestSummary._fields) and RequestSummary(*summary) == summary
    [attempt] = summary.attempts
    assert len(attempt) == len(AttemptSummary._fields) and AttemptSummary(*attempt) == attempt
    assert (summary.user_agent, summary.status, summary.method) == ("harness/1", 200, "POST")
    assert summary.stalls == () and attempt.status == 200
