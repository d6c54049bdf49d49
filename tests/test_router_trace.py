"""What reaches the engines through the real sglang-router in PD mode.

Part 1 talks to the router directly and documents its behaviour (sglang-router
0.3.2): which headers it forwards to prefill and decode, and what it does to the
JSON body. Part 2 puts traceproxy in front of the router and checks the trace
context and request id the proxy must give both engines and the client.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from .router_harness import http_exchange, pd_router, router_harness  # noqa: F401  (fixtures)

TRACEPARENT_RE = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
CLIENT_TRACESTATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"


def request_body(path: str, stream: bool, rid: str | None = None) -> dict:
    if path == "/generate":
        body = {"text": "Say hi", "sampling_params": {"max_new_tokens": 4}, "stream": stream}
    elif path == "/v1/chat/completions":
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "Say hi"}],
                "max_tokens": 4, "stream": stream}
    else:
        body = {"model": "fake-model", "prompt": "Say hi", "max_tokens": 4, "stream": stream}
    if rid is not None:
        body["rid"] = rid
    return body


def post_json(port: int, path: str, body: dict, headers: dict[str, str] | None = None):
    return http_exchange(port, "POST", path, {"Content-Type": "application/json", **(headers or {})},
                         json.dumps(body).encode())


def assert_complete(path: str, stream: bool, status: int, headers: dict, data: bytes) -> None:
    assert status == 200, data[:500]
    if stream:
        assert headers["content-type"].startswith("text/event-stream")
        assert data.rstrip().endswith(b"data: [DONE]"), data[-300:]
    else:
        json.loads(data)


def one_request_each(harness, path: str):
    """The single inference request prefill and decode each received."""
    [pre] = harness.prefill.wait_for_requests(1)
    [dec] = harness.decode.wait_for_requests(1)
    assert pre.path == dec.path == path
    return pre, dec


def parse_traceparent(value: str) -> tuple[str, str, str]:
    match = TRACEPARENT_RE.match(value)
    assert match, f"not a version-00 traceparent: {value!r}"
    trace_id, span_id, flags = match.groups()
    assert trace_id != "0" * 32 and span_id != "0" * 16, value
    return trace_id, span_id, flags


# ----------------------------------------------------------------------------------
# 1. The router alone
# ----------------------------------------------------------------------------------
PATHS = ["/generate", "/v1/chat/completions", "/v1/completions"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("path", PATHS)
def test_router_forwards_trace_headers_verbatim_to_prefill_and_decode(pd_router, path, stream):
    rid = f"client-rid-{path.strip('/').replace('/', '-')}-{int(stream)}"
    status, headers, data = post_json(pd_router.router_port, path, request_body(path, stream, rid), {
        "traceparent": CLIENT_TRACEPARENT,
        "tracestate": CLIENT_TRACESTATE,
        "x-request-id": "req-trace-1",
        "baggage": "userId=alice,isProduction=false",
        "x-custom": "must-not-leak",
    })
    assert_complete(path, stream, status, headers, data)
    assert headers["x-request-id"] == "req-trace-1"  # the router echoes the client's id

    pre, dec = one_request_each(pd_router, path)
    for side in (pre, dec):
        assert side.headers["traceparent"] == CLIENT_TRACEPARENT
        assert side.headers["tracestate"] == CLIENT_TRACESTATE
        assert side.headers["x-request-id"] == "req-trace-1"
        # The router forwards only an allow-list of headers: W3C baggage and custom
        # headers do not reach the engines.
        assert "baggage" not in side.headers
        assert "x-custom" not in side.headers

    # The router re-serialises the JSON and adds the PD bootstrap fields; prefill and
    # decode must agree on the room to find each other's KV transfer.
    for side in (pre, dec):
        assert side.body["bootstrap_host"] == "127.0.0.1"
        assert side.body["bootstrap_port"] == pd_router.bootstrap_port
        assert isinstance(side.body["bootstrap_room"], int)
        assert side.body["stream"] is stream
    assert pre.body["bootstrap_room"] == dec.body["bootstrap_room"]
    assert pre.body == dec.body  # the very same body goes to both

    if path == "/v1/chat/completions":
        # Observed with sglang-router 0.3.2: the chat request is parsed into its typed
        # request struct, which has no rid field, so the client's rid is dropped and
        # neither engine sees it. /generate and /v1/completions keep it.
        assert "rid" not in pre.body and "rid" not in dec.body
    else:
        assert pre.body["rid"] == dec.body["rid"] == rid


def test_router_invents_a_request_id_for_the_client_but_not_for_the_engines(pd_router):
    # Without any request-id header the router makes one up (gnt-... for /generate)
    # and returns it to the client, but sends the engines no x-request-id at all:
    # a proxy in front must inject the id for the engines' logs to carry it.
    status, headers, data = post_json(pd_router.router_port, "/generate", request_body("/generate", False))
    assert status == 200, data
    assert headers.get("x-request-id"), headers
    pre, dec = one_request_each(pd_router, "/generate")
    assert "x-request-id" not in pre.headers and "x-request-id" not in dec.headers
    assert "traceparent" not in pre.headers and "traceparent" not in dec.headers


def test_prefill_and_decode_get_the_request_in_parallel_and_prefill_gates_the_answer(pd_router):
    pd_router.prefill.delay = 0.5
    t0 = time.monotonic()
    status, _, data = post_json(pd_router.router_port, "/generate", request_body("/generate", True))
    elapsed = time.monotonic() - t0
    assert status == 200, data
    pre, dec = one_request_each(pd_router, "/generate")
    # Sent concurrently: decode did not wait for prefill's answer ...
    assert abs(pre.received_at - dec.received_at) < 0.25
    # ... but the client's (streamed) answer waited until prefill's body was drained.
    assert elapsed >= 0.5


# ----------------------------------------------------------------------------------
# 2. traceproxy in front of the router
# ----------------------------------------------------------------------------------
@pytest.fixture
def proxy_to_router(pd_router, start_proxy, tmp_path):
    return start_proxy(pd_router.router_url, **{"tracing.file_path": str(tmp_path / "spans.jsonl")})


@pytest.mark.parametrize(("path", "stream"), [("/generate", False), ("/v1/chat/completions", True)],
                         ids=["generate-json", "chat-sse"])
def test_proxy_starts_a_trace_and_a_request_id_that_both_engines_share(pd_router, proxy_to_router, path, stream):
    status, headers, data = post_json(proxy_to_router.port, path, request_body(path, stream))
    assert_complete(path, stream, status, headers, data)

    pre, dec = one_request_each(pd_router, path)
    assert "traceparent" in pre.headers, f"prefill got no traceparent: {pre.headers}"
    assert "traceparent" in dec.headers, f"decode got no traceparent: {dec.headers}"
    pre_trace, _, _ = parse_traceparent(pre.headers["traceparent"])
    dec_trace, _, _ = parse_traceparent(dec.headers["traceparent"])
    assert pre_trace == dec_trace
    # The router copies the one header it got from the proxy to both engines.
    assert pre.headers["traceparent"] == dec.headers["traceparent"]

    request_id = pre.headers.get("x-request-id")
    assert request_id, f"prefill got no x-request-id: {pre.headers}"
    assert dec.headers.get("x-request-id") == request_id

    # The client learns both: the request id, and (W3C trace context level 2) the
    # trace its request was recorded under.
    assert headers.get("x-request-id") == request_id
    assert "traceresponse" in headers, f"no traceresponse header: {headers}"
    resp_trace, _, _ = parse_traceparent(headers["traceresponse"])
    assert resp_trace == pre_trace


def test_proxy_continues_the_clients_trace_with_its_own_span(pd_router, proxy_to_router):
    status, headers, data = post_json(proxy_to_router.port, "/generate", request_body("/generate", False), {
        "traceparent": CLIENT_TRACEPARENT,
        "tracestate": CLIENT_TRACESTATE,
    })
    assert_complete("/generate", False, status, headers, data)

    pre, dec = one_request_each(pd_router, "/generate")
    for side in (pre, dec):
        trace_id, parent_id, flags = parse_traceparent(side.headers["traceparent"])
        assert trace_id == CLIENT_TRACE_ID
        # The engines' parent is the proxy's span, not the client's.
        assert parent_id != CLIENT_SPAN_ID
        assert flags == "01"
        assert side.headers.get("tracestate") == CLIENT_TRACESTATE
    assert pre.headers["traceparent"] == dec.headers["traceparent"]
    assert pre.headers.get("x-request-id") and pre.headers["x-request-id"] == dec.headers.get("x-request-id")

    assert "traceresponse" in headers, f"no traceresponse header: {headers}"
    assert parse_traceparent(headers["traceresponse"])[0] == CLIENT_TRACE_ID
