"""What reaches the engines through each real router in PD mode (sglang-router, smg, vllm-router).

Part 1 talks to the router directly and pins down what each one does on the way to
prefill and decode: which headers it forwards, rewrites or drops, what it does to the
JSON body, and in which order it calls the two workers. The routers differ, so the
tests assert each router's own behaviour (``traceproxy.sim.routers.RouterBehaviour``): a change
in any of them fails here. Part 2 puts traceproxy in front and checks what it must
guarantee behind every router: one trace id at the client and at both engines (the
join key), and the request id wherever the router lets it through.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from .router_harness import harness, pd_router  # noqa: F401  (fixtures, used by name)
from .router_harness import http_exchange, wait_for_requests

TRACEPARENT_RE = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
# vllm-router's own request id: ___prefill_addr_HOST:PORT___decode_addr_HOST:PORT_<32 hex>
VLLM_REQUEST_ID_RE = re.compile(r"^___prefill_addr_(?P<prefill>[^_]+)___decode_addr_(?P<decode>[^_]+)_[0-9a-f]{32}$")

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
CLIENT_TRACESTATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
CLIENT_BAGGAGE = "userId=alice,isProduction=false"


def request_body(path: str, stream: bool, rid: str | None = None) -> dict:
    if path == "/generate":
        body = {"text": "Say hi", "sampling_params": {"max_new_tokens": 4}, "stream": stream}
    elif path == "/v1/chat/completions":
        body = {"model": "sim-llama", "messages": [{"role": "user", "content": "Say hi"}],
                "max_tokens": 4, "stream": stream}
    else:
        body = {"model": "sim-llama", "prompt": "Say hi", "max_tokens": 4, "stream": stream}
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
    [pre] = wait_for_requests(harness.prefill, 1)
    [dec] = wait_for_requests(harness.decode, 1)
    assert pre.path == dec.path == path
    return pre, dec


def parse_traceparent(value: str) -> tuple[str, str, str]:
    match = TRACEPARENT_RE.match(value)
    assert match, f"not a version-00 traceparent: {value!r}"
    trace_id, span_id, flags = match.groups()
    assert trace_id != "0" * 32 and span_id != "0" * 16, value
    return trace_id, span_id, flags


def assert_vllm_request_id(value: str, harness) -> None:
    """vllm-router's made-up id names both workers it chose."""
    match = VLLM_REQUEST_ID_RE.match(value)
    assert match, f"not vllm-router's request id: {value!r}"
    assert f"http://{match['prefill']}" == harness.prefill.url and f"http://{match['decode']}" == harness.decode.url


# ----------------------------------------------------------------------------------
# 1. The router alone
# ----------------------------------------------------------------------------------
PATHS = ["/generate", "/v1/chat/completions", "/v1/completions"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("path", PATHS)
def test_what_each_router_forwards_and_rewrites_on_the_way_to_prefill_and_decode(pd_router, path, stream):
    behaviour = pd_router.behaviour
    rid = f"client-rid-{path.strip('/').replace('/', '-')}-{int(stream)}"
    status, headers, data = post_json(pd_router.router_port, path, request_body(path, stream, rid), {
        "traceparent": CLIENT_TRACEPARENT,
        "tracestate": CLIENT_TRACESTATE,
        "x-request-id": "req-trace-1",
        "baggage": CLIENT_BAGGAGE,
        "authorization": "Bearer sk-client",
        "x-custom": "must-not-leak",
    })
    assert_complete(path, stream, status, headers, data)
    assert headers["x-request-id"] == "req-trace-1"  # every router echoes the client's id to it

    pre, dec = one_request_each(pd_router, path)
    for side in (pre, dec):
        # Without --enable-trace no router touches the W3C trace context.
        assert side.headers["traceparent"] == CLIENT_TRACEPARENT
        assert side.headers["tracestate"] == CLIENT_TRACESTATE
        assert "x-custom" not in side.headers  # each forwards an allow-list of headers
        if behaviour.forwards_baggage:
            assert side.headers["baggage"] == CLIENT_BAGGAGE
        else:
            assert "baggage" not in side.headers
        if behaviour.keeps_authorization:
            assert side.headers["authorization"] == "Bearer sk-client"
        else:  # vllm-router sends its own (empty) key to the engines
            assert side.headers["authorization"] == "Bearer"
        if behaviour.engines_get_client_request_id:
            assert side.headers["x-request-id"] == "req-trace-1"
        else:  # vllm-router replaces it with its own, the same for prefill and decode
            assert_vllm_request_id(side.headers["x-request-id"], pd_router)
    assert pre.headers["x-request-id"] == dec.headers["x-request-id"]

    if pd_router.speaks_vllm:
        assert_vllm_bodies(path, stream, pre, dec)
    else:
        assert_sglang_bodies(pd_router, stream, pre, dec)

    # The client's rid is the engines' own request id (SGLang takes it from the body).
    if path == "/v1/chat/completions" and not behaviour.keeps_rid_on_chat:
        # sglang-router 0.3.2 parses chat into a typed struct without rid: neither engine sees it.
        assert "rid" not in pre.body and "rid" not in dec.body
    else:
        assert pre.body["rid"] == dec.body["rid"] == rid


def assert_sglang_bodies(harness, stream: bool, pre, dec) -> None:
    """SGLang's PD protocol: one body, with the bootstrap room, to both workers at once."""
    for side in (pre, dec):
        assert side.body["bootstrap_host"] == "127.0.0.1"
        assert side.body["bootstrap_port"] == harness.bootstrap_port
        assert isinstance(side.body["bootstrap_room"], int)
        assert side.body["stream"] is stream
        assert "kv_transfer_params" not in side.body
    assert pre.room == dec.room == pre.body["bootstrap_room"]
    assert pre.body == dec.body  # the very same body goes to both


def assert_vllm_bodies(path: str, stream: bool, pre, dec) -> None:
    """vLLM's PD protocol: prefill asked for one token, decode given prefill's kv_transfer_params."""
    assert pre.body["max_tokens"] == 1 and pre.body["min_tokens"] == 1  # top-level even on /generate
    assert pre.body["stream"] is False
    assert pre.body["kv_transfer_params"]["do_remote_decode"] is True
    assert pre.body["kv_transfer_params"]["do_remote_prefill"] is False
    params = dec.body["kv_transfer_params"]  # what the simulated prefill answered, passed on verbatim
    assert params["do_remote_prefill"] is True and params["remote_request_id"] == f"sim-room-{pre.room}"
    assert dec.room == pre.room
    assert dec.body["stream"] is stream
    assert "bootstrap_room" not in pre.body and "bootstrap_room" not in dec.body
    if path == "/generate":
        assert dec.body["sampling_params"] == {"max_new_tokens": 4}
    else:
        assert dec.body["max_tokens"] == 4


def test_without_ids_the_router_makes_one_up_for_the_client(pd_router):
    status, headers, data = post_json(pd_router.router_port, "/generate", request_body("/generate", False))
    assert status == 200, data
    assert headers.get("x-request-id"), headers
    pre, dec = one_request_each(pd_router, "/generate")
    if pd_router.behaviour.engines_get_client_request_id:
        # sglang-router and smg send the engines no x-request-id at all: a proxy in front
        # must send one for the engines' logs to carry it.
        assert "x-request-id" not in pre.headers and "x-request-id" not in dec.headers
    else:
        assert_vllm_request_id(pre.headers["x-request-id"], pd_router)
        assert pre.headers["x-request-id"] != headers["x-request-id"]
    # No router starts a trace of its own without --enable-trace.
    assert "traceparent" not in pre.headers and "traceparent" not in dec.headers


def test_the_order_in_which_each_router_calls_prefill_and_decode(pd_router):
    pd_router.prefill.prefill_tokens_per_s = 4.0  # the 2-token prompt takes 0.5 s to prefill
    t0 = time.monotonic()
    status, _, data = post_json(pd_router.router_port, "/generate", request_body("/generate", True))
    elapsed = time.monotonic() - t0
    assert status == 200, data
    pre, dec = one_request_each(pd_router, "/generate")
    if pd_router.kind.decode_waits_for_prefill:
        # vLLM's protocol: decode is called once prefill has answered.
        assert dec.received_at - pre.received_at >= 0.45
    else:
        # SGLang's: sent concurrently, decode did not wait for prefill's answer ...
        assert abs(pre.received_at - dec.received_at) < 0.25
    # ... and either way the client's (streamed) answer waited for prefill.
    assert elapsed >= 0.5


# ----------------------------------------------------------------------------------
# 2. traceproxy in front of the router
# ----------------------------------------------------------------------------------
@pytest.fixture
def proxy_to_router(pd_router, start_proxy, tmp_path):
    return start_proxy(pd_router.router_url, **{"tracing.file_path": str(tmp_path / "spans.jsonl")})


@pytest.mark.parametrize(("path", "stream"), [("/generate", False), ("/v1/chat/completions", True)],
                         ids=["generate-json", "chat-sse"])
def test_the_proxys_trace_id_is_the_join_key_at_both_engines(pd_router, proxy_to_router, path, stream):
    status, headers, data = post_json(proxy_to_router.port, path, request_body(path, stream))
    assert_complete(path, stream, status, headers, data)

    pre, dec = one_request_each(pd_router, path)
    pre_trace, _, _ = parse_traceparent(pre.headers["traceparent"])
    assert pre.headers["traceparent"] == dec.headers["traceparent"]  # one header, copied to both
    # The client learns the trace its request was recorded under (W3C trace context level 2),
    # and both engines' records carry it: the join key behind every router.
    assert "traceresponse" in headers, f"no traceresponse header: {headers}"
    assert parse_traceparent(headers["traceresponse"])[0] == pre_trace == pre.trace_id == dec.trace_id

    request_id = headers.get("x-request-id")
    assert request_id, headers
    if pd_router.behaviour.engines_get_client_request_id:
        assert pre.request_id == dec.request_id == request_id
    else:
        # Behind vllm-router the engines never see the proxy's request id: only the trace id joins.
        assert request_id not in (pre.request_id, dec.request_id)
        assert_vllm_request_id(pre.request_id, pd_router)


def test_the_proxy_continues_the_clients_trace_with_its_own_span(pd_router, proxy_to_router):
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
    assert "traceresponse" in headers, f"no traceresponse header: {headers}"
    assert parse_traceparent(headers["traceresponse"])[0] == CLIENT_TRACE_ID
