"""Trace identity on the wire: W3C traceparent continued or started, tracestate
passed on, request ids kept or generated, and both returned on every response."""

from __future__ import annotations

import socket

import pytest

from traceproxy.proxy import tracecontext as tc

from .support import RawClient, answers_then_drops_next_request, header_value, raw_exchange

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
VALID = f"00-{TRACE}-{PARENT}-01"

PARSE_TABLE = [
    ("valid-sampled", VALID.encode(), (int(TRACE, 16), int(PARENT, 16), True)),
    ("valid-not-sampled", f"00-{TRACE}-{PARENT}-00".encode(), (int(TRACE, 16), int(PARENT, 16), False)),
    ("future-version-extra-field", f"cc-{TRACE}-{PARENT}-01-what".encode(), (int(TRACE, 16), int(PARENT, 16), True)),
    ("version-ff", f"ff-{TRACE}-{PARENT}-01".encode(), None),
    ("zero-trace-id", f"00-{'0' * 32}-{PARENT}-01".encode(), None),
    ("zero-parent-id", f"00-{TRACE}-{'0' * 16}-01".encode(), None),
    ("uppercase", f"00-{TRACE.upper()}-{PARENT}-01".encode(), None),
    ("version-00-extra-field", f"00-{TRACE}-{PARENT}-01-x".encode(), None),
    ("short", b"00-abc-def-01", None),
    ("not-hex", f"00-{'z' * 32}-{PARENT}-01".encode(), None),
]


@pytest.mark.parametrize("value,expected", [(v, e) for _, v, e in PARSE_TABLE], ids=[i for i, _, _ in PARSE_TABLE])
def test_traceparent_parsing_follows_w3c(value, expected):
    parsed = tc.parse_traceparent(value)
    assert (tuple(parsed) if parsed else None) == expected


def test_two_traceparent_headers_start_a_new_trace():
    decision = tc.continue_or_start([VALID.encode(), VALID.encode()])
    assert decision.trace_id != int(TRACE, 16) and decision.rejected


def _recording_upstream(scripted_upstream):
    async def handler(reader, writer, upstream):
        while True:
            await reader.read_request()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Request-Id: upstream-echo\r\n\r\nok")
            await writer.drain()

    return scripted_upstream(handler)


def _upstream_head(up, index=0) -> bytes:
    return bytes(up.received[index]).split(b"\r\n\r\n")[0]


def test_new_trace_and_request_id_when_the_client_sends_none(scripted_upstream, start_proxy):
    up = _recording_upstream(scripted_upstream)
    proxy = start_proxy(up.url)
    resp = RawClient(proxy.port).roundtrip("GET", "/v1/models")
    head = _upstream_head(up)
    sent = tc.parse_traceparent(header_value(head, b"traceparent"))
    assert sent is not None and sent.sampled
    request_id = header_value(head, b"x-request-id").decode()
    assert len(request_id) == 32
    assert resp.headers["x-request-id"] == request_id  # ours replaces the upstream's echo
    returned = tc.parse_traceparent(resp.headers["traceresponse"].encode())
    assert returned.trace_id == sent.trace_id
    assert returned.parent_span_id != sent.parent_span_id  # SERVER span vs the CLIENT span upstream


def test_valid_traceparent_is_continued_with_the_proxy_span_as_parent(scripted_upstream, start_proxy):
    up = _recording_upstream(scripted_upstream)
    proxy = start_proxy(up.url)
    resp = RawClient(proxy.port).roundtrip(
        "GET", "/", headers=[("traceparent", VALID), ("tracestate", "vendor=abc"), ("x-request-id", "client-id-1")])
    head = _upstream_head(up)
    sent = tc.parse_traceparent(header_value(head, b"traceparent"))
    assert sent.trace_id == int(TRACE, 16) and sent.parent_span_id != int(PARENT, 16)
    assert head.count(b"traceparent") == 1
    assert header_value(head, b"tracestate") == b"vendor=abc"
    assert header_value(head, b"x-request-id") == b"client-id-1"
    assert resp.headers["x-request-id"] == "client-id-1"
    assert resp.headers["traceresponse"].split("-")[1] == TRACE


def test_malformed_traceparent_starts_a_new_trace_and_drops_tracestate(scripted_upstream, start_proxy):
    up = _recording_upstream(scripted_upstream)
    proxy = start_proxy(up.url)
    RawClient(proxy.port).roundtrip("GET", "/", headers=[("traceparent", "00-nonsense"), ("tracestate", "a=b")])
    head = _upstream_head(up)
    sent = tc.parse_traceparent(header_value(head, b"traceparent"))
    assert sent is not None and sent.trace_id != int(TRACE, 16)
    assert header_value(head, b"tracestate") is None


@pytest.mark.parametrize("headers", [
    [("tracestate", "vendor=abc")],
    [("Connection", "traceparent"), ("traceparent", VALID), ("tracestate", "vendor=abc")],
], ids=["tracestate-alone", "traceparent-named-in-connection"])
def test_tracestate_without_a_valid_traceparent_is_dropped(scripted_upstream, start_proxy, headers):
    # W3C trace context: a tracestate received without its traceparent is discarded.
    up = _recording_upstream(scripted_upstream)
    proxy = start_proxy(up.url)
    RawClient(proxy.port).roundtrip("GET", "/", headers=headers)
    head = _upstream_head(up)
    assert tc.parse_traceparent(header_value(head, b"traceparent")).trace_id != int(TRACE, 16)
    assert header_value(head, b"tracestate") is None


def test_configured_request_id_headers(scripted_upstream, start_proxy):
    up = _recording_upstream(scripted_upstream)
    proxy = start_proxy(up.url, **{"request_id.headers": ["x-request-id", "x-correlation-id"]})
    resp = RawClient(proxy.port).roundtrip("GET", "/", headers=[("X-Correlation-Id", "corr-7")])
    head = _upstream_head(up)
    assert header_value(head, b"x-correlation-id") == b"corr-7"
    assert header_value(head, b"x-request-id") is None  # one id is enough; none generated
    assert resp.headers["x-request-id"] == "corr-7"


def test_proxy_errors_carry_the_ids(start_proxy):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    proxy = start_proxy(f"http://127.0.0.1:{dead}")
    resp = RawClient(proxy.port).roundtrip("GET", "/", headers=[("traceparent", VALID), ("x-request-id", "rid-9")])
    assert resp.status == 502
    assert resp.headers["x-request-id"] == "rid-9" and resp.headers["traceresponse"].split("-")[1] == TRACE
    reply = raw_exchange(proxy.port, b"GET / HTTP/1.1\r\nHost: a\r\nBad\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 400 ")
    assert header_value(reply, b"x-request-id") and header_value(reply, b"traceresponse")


@pytest.mark.parametrize("line, rest, status", [
    (b"GET / HTTP/1.1", b"Host: a\r\nHost: b\r\n", b"400"),  # two Hosts: refused once the head is read
    (b"POST / HTTP/1.1", b"Host: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n", b"400"),  # by llhttp
    (b"GET / HTTP/2.0", b"Host: a\r\n", b"505"),
], ids=["two-hosts", "conflicting-lengths", "http2-version"])
def test_a_refused_head_still_carries_the_clients_ids(start_proxy, line, rest, status):
    proxy = start_proxy("http://127.0.0.1:9")
    ids = b"traceparent: %s\r\nx-request-id: my-rid-1\r\n" % VALID.encode()
    reply = raw_exchange(proxy.port, line + b"\r\n" + ids + rest + b"\r\n")
    assert reply.startswith(b"HTTP/1.1 %s " % status)
    assert header_value(reply, b"x-request-id") == b"my-rid-1"
    assert header_value(reply, b"traceresponse").split(b"-")[1] == TRACE.encode()


def test_a_resend_is_a_new_client_span_in_the_same_trace(scripted_upstream, start_proxy):
    up = scripted_upstream(answers_then_drops_next_request())
    proxy = start_proxy(up.url)
    client = RawClient(proxy.port)
    client.roundtrip("GET", "/first")
    assert client.roundtrip("GET", "/second", headers=[("traceparent", VALID)]).status == 200
    stale_try = bytes(up.received[0]).split(b"GET /second")[1]
    resend = bytes(up.received[1])
    first = tc.parse_traceparent(header_value(b"X\r\n" + stale_try, b"traceparent"))
    second = tc.parse_traceparent(header_value(resend, b"traceparent"))
    assert first.trace_id == second.trace_id == int(TRACE, 16)
    assert first.parent_span_id != second.parent_span_id


GENERATE = b'{"text": "hello", "sampling_params": {"max_new_tokens": 4}}'


def _captures_bodies(scripted_upstream):
    async def handler(reader, writer, upstream):
        while True:
            _, body = await reader.read_request()
            upstream.bodies = getattr(upstream, "bodies", []) + [body]
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    return scripted_upstream(handler)


def test_inject_rid_sets_rid_on_generate_when_absent(scripted_upstream, start_proxy):
    import json

    up = _captures_bodies(scripted_upstream)
    proxy = start_proxy(up.url, **{"request_id.inject_rid": True})
    client = RawClient(proxy.port)
    resp = client.roundtrip("POST", "/generate", headers=[("Content-Type", "application/json")], body=GENERATE)
    assert json.loads(up.bodies[0]) == {**json.loads(GENERATE), "rid": resp.headers["x-request-id"]}
    with_rid = b'{"text": "x", "rid": "mine"}'
    client.roundtrip("POST", "/generate", body=with_rid)
    assert up.bodies[1] == with_rid  # never overwritten
    client.roundtrip("POST", "/v1/chat/completions", body=GENERATE)
    assert up.bodies[2] == GENERATE  # only /generate


def test_rid_left_alone_by_default(scripted_upstream, start_proxy):
    up = _captures_bodies(scripted_upstream)
    proxy = start_proxy(up.url)
    RawClient(proxy.port).roundtrip("POST", "/generate", body=GENERATE)
    assert up.bodies[0] == GENERATE


def test_an_empty_request_id_is_no_request_id(scripted_upstream, start_proxy):
    up = _recording_upstream(scripted_upstream)
    proxy = start_proxy(up.url)
    resp = RawClient(proxy.port).roundtrip("GET", "/", headers=[("x-request-id", "")])
    head = _upstream_head(up)
    generated = header_value(head, b"x-request-id")
    assert head.lower().count(b"x-request-id:") == 1 and len(generated) == 32
    assert resp.headers["x-request-id"] == generated.decode()


def test_a_refusal_with_an_empty_request_id_gets_a_generated_one(start_proxy):
    proxy = start_proxy("http://127.0.0.1:9")
    reply = raw_exchange(proxy.port, b"GET / HTTP/1.1\r\nx-request-id: \r\nHost: a/b\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 400 ") and len(header_value(reply, b"x-request-id")) == 32


def test_whitespace_after_trace_context_and_request_id_values_is_not_theirs(scripted_upstream, start_proxy):
    # RFC 9112 section 5: trailing whitespace is not part of a field value (llhttp
    # keeps it): the trace is continued, and the id comes back as the client sent it.
    up = _recording_upstream(scripted_upstream)
    proxy = start_proxy(up.url)
    reply = raw_exchange(proxy.port, b"GET / HTTP/1.1\r\nHost: a\r\ntraceparent: " + VALID.encode()
                         + b" \t\r\ntracestate: vendor=abc \r\nx-request-id: client-id-1  \r\nConnection: close\r\n\r\n")
    head = _upstream_head(up)
    assert tc.parse_traceparent(header_value(head, b"traceparent")).trace_id == int(TRACE, 16)
    assert header_value(head, b"tracestate") == b"vendor=abc"
    assert b"\r\nx-request-id: client-id-1\r\n" in reply.lower()


def test_a_refused_request_returns_its_request_id_without_the_whitespace_after_it(start_proxy):
    # The refusal carries the client's id, so the two can be matched: the same value
    # a forwarded request would have recorded.
    proxy = start_proxy("http://127.0.0.1:9")
    reply = raw_exchange(proxy.port, b"GET / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n"
                                     b"x-request-id: client-id-2 \t\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 400 ") and b"\r\nx-request-id: client-id-2\r\n" in reply.lower()
