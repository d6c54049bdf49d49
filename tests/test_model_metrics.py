"""Metrics per model: the model label (the request body's model, bounded), the engine's
token counts (chat, completions, /generate; streamed and not), time to first token,
inter-token latency, end-to-end latency and heartbeats, through the real proxy, merged
over workers, and with exemplars in OpenMetrics."""

from __future__ import annotations

import json

import pytest

from traceproxy.lifecycle.stream_events import EventScanner
from traceproxy.observe.genai import OTHER, UNKNOWN, ModelLabels, request_model, token_counts, usage_in_body
from traceproxy.observe.metrics import (E2E_BUCKETS, INTER_TOKEN_BUCKETS, MODEL_HISTOGRAM_SHAPES, NS_PER_S,
                                        TTFT_BUCKETS, Histogram, ModelNumbers, observe_inter_token)
from traceproxy.observe.service_metrics import merge_models

from .support import RawClient, answers_in_parts, wait_until
from .test_metrics import Scrape, scrape
from .test_workers_view import upstream_process  # noqa: F401 (a fixture)

MS = 1_000_000


# ----------------------------------------------------------------------------------
# The model a request names
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("body, model", [
    (b'{"model": "m-8b", "messages": []}', "m-8b"),
    (b'{"messages": [{"role": "user", "content": "say \\"model\\": \\"x\\""}], "model": "m-8b"}', "m-8b"),
    (b'{"model": "caf\\u00e9"}', "caf\u00e9"),
    (b'{"messages": []}', None),  # no model
    (b'{"model": 7}', None),  # not a name
    (b'{"model": ""}', None),
    (b'model=m-8b', None),  # not JSON
    (b'["m-8b"]', None),
    (b'', None),
], ids=["first", "after-messages", "escaped", "none", "number", "empty", "form", "array", "no-body"])
def test_the_model_of_a_body_kept_whole(body, model):
    assert request_model(body, b"", len(body)) == model


def test_the_model_of_a_long_body_is_read_from_its_kept_start_or_end():
    # An SDK writes the model after the messages, far past the kept start; a tool's
    # schema names a property "model" (an object, not a name), and a message quotes one.
    messages = [{"role": "user", "content": f'turn {i}: "model": "x" ' + "words " * 40} for i in range(100)]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"model": {"type": "string"}}}}}]
    body = json.dumps({"tools": tools, "messages": messages, "model": "m-70b", "stream": True}).encode()
    head, tail = body[:8192], body[-4096:]
    assert request_model(head, tail, len(body)) == "m-70b"
    first = json.dumps({"model": "m-8b", "messages": messages}).encode()
    assert request_model(first[:8192], first[-4096:], len(first)) == "m-8b"
    assert request_model(body[:8192], b"", len(body)) is None  # the end not kept: no name, not a guess


def test_the_model_label_is_bounded():
    labels = ModelLabels(max_models=2)
    assert [labels.label(name) for name in ("a", "b", "c", "a", "c", None)] == ["a", "b", OTHER, "a", OTHER, UNKNOWN]
    assert ModelLabels(5).label("m" * 257) == OTHER  # a name too long to be a label
    # Never more than the cap, whatever the clients send.
    many = ModelLabels(32)
    assert len({many.label(f"model-{i}") for i in range(1000)}) == 33


# ----------------------------------------------------------------------------------
# Token counts: the engine's usage, else counted output events
# ----------------------------------------------------------------------------------
CHAT_ANSWER = json.dumps({"id": "c-1", "object": "chat.completion", "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "a" * 20_000}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 34, "total_tokens": 46,
              "prompt_tokens_details": {"cached_tokens": 3}, "completion_tokens_details": None}}).encode()
COMPLETION_ANSWER = json.dumps({"id": "c-2", "object": "text_completion", "model": "m", "choices": [
    {"index": 0, "text": "hello", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}).encode()
GENERATE_ANSWER = json.dumps({"text": "hello world", "output_ids": [1, 2], "meta_info": {
    "id": "r-1", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 9, "completion_tokens": 2,
    "cached_tokens": 0, "e2e_latency": 0.1}}).encode()


@pytest.mark.parametrize("answer, counts", [
    (CHAT_ANSWER, (12, 34)), (COMPLETION_ANSWER, (5, 1)), (GENERATE_ANSWER, (9, 2)),
    (b'{"error": {"message": "bad"}}', (None, None)),
    # The last of each with a count: not a later one without, nor one inside a text.
    (b'{"usage": {"prompt_tokens" : 7, "completion_tokens":3}, "echo": {"prompt_tokens": null},'
     b' "text": "\\"completion_tokens\\": 99"}' + b" " * 700, (7, 3)),
], ids=["chat", "completions", "generate", "none", "last-with-a-count"])
def test_usage_of_a_body_in_its_last_reads(answer, counts):
    # Kept as its last three reads, however it was split.
    reads = (answer[:-700], answer[-700:-30], answer[-30:])
    assert usage_in_body(reads) == counts
    assert usage_in_body((b"", b"", answer)) == counts


def _scanned(*events: bytes):
    scanner = EventScanner()
    for event in events:
        scanner.feed(event)
    return scanner.summary()


def test_usage_of_a_stream_is_the_engines_else_its_output_events_counted():
    delta = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n'
    ping = b": ping\n\n"
    with_usage = token_counts(_scanned(delta, ping, delta, usage, b"data: [DONE]\n\n"), ())
    assert with_usage == (5, 2, "usage")
    without = token_counts(_scanned(delta, ping, delta, b"data: [DONE]\n\n"), ())
    assert without == (None, 2, "counted")
    generate = b'data: {"text":"a b","output_ids":[1,2],"meta_info":{"prompt_tokens":4,"completion_tokens":2}}\n\n'
    assert token_counts(_scanned(generate, b"data: [DONE]\n\n"), ()) == (4, 2, "usage")


# ----------------------------------------------------------------------------------
# Inter-token latency: two observations per stream, exact sum and count
# ----------------------------------------------------------------------------------
def test_inter_token_latency_keeps_the_longest_gap_and_the_mean_of_the_rest():
    histogram = Histogram(INTER_TOKEN_BUCKETS, NS_PER_S, exemplars=True)
    # 11 output events 10 ms apart, but one gap of 3 s: 10 gaps, 3.09 s in all.
    observe_inter_token(histogram, 0, 3_090 * MS, 3_000 * MS, 11, 0xAB, "r", 4_000 * MS, False)
    assert histogram.count == 10 and histogram.raw_sum == 3_090 * MS
    cumulative = dict(histogram.cumulative())
    assert cumulative[0.01] == 9 and cumulative[2.5] == 9 and cumulative[4.0] == 10
    assert histogram.exemplars[INTER_TOKEN_BUCKETS.index(4.0)][1] == 0xAB  # the stall has its own exemplar
    one_gap = Histogram(INTER_TOKEN_BUCKETS, NS_PER_S, exemplars=True)
    observe_inter_token(one_gap, 0, 30 * MS, 30 * MS, 2, 0, "", 0, False)
    assert one_gap.count == 1 and one_gap.raw_sum == 30 * MS
    none = Histogram(INTER_TOKEN_BUCKETS, NS_PER_S, exemplars=True)
    observe_inter_token(none, 0, 0, 0, 1, 0, "", 0, False)  # one output event has no gap
    assert none.count == 0


def test_buckets_hold_every_bound_vllm_and_sglang_use():
    vllm_ttft = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
    sglang_ttft = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
    vllm_itl = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
    sglang_itl = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
                  0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)
    vllm_e2e = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
    sglang_e2e = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
    for ours, theirs in ((TTFT_BUCKETS, vllm_ttft + sglang_ttft), (INTER_TOKEN_BUCKETS, vllm_itl + sglang_itl),
                         (E2E_BUCKETS, vllm_e2e + sglang_e2e)):
        assert ours == tuple(sorted(set(map(float, theirs))))


# ----------------------------------------------------------------------------------
# Merged over workers
# ----------------------------------------------------------------------------------
def test_workers_per_model_numbers_merge_by_label():
    a, b = ModelNumbers(), ModelNumbers()
    a.e2e.count_raw_with_exemplar(2 * NS_PER_S, 1, "a", 10, False)
    a.prompt_tokens, a.generation_tokens, a.heartbeats = 5, 7, 1
    b.e2e.count_raw_with_exemplar(3 * NS_PER_S, 2, "b", 11, False)
    b.prompt_tokens, b.generation_tokens, b.heartbeats = 1, 2, 3
    other = ModelNumbers()
    other.generation_tokens = 4
    merged = merge_models([{"m": a.numbers()}, {"m": b.numbers(), "other": other.numbers()}])
    assert set(merged) == {"m", "other"}
    e2e_counts, e2e_sum, _ = merged["m"][2]
    assert sum(e2e_counts) == 2 and e2e_sum == 5 * NS_PER_S
    assert merged["m"][3:] == [6, 9, 4] and merged["other"][3:] == [0, 4, 0]
    assert len(merged["m"][0][0]) == len(MODEL_HISTOGRAM_SHAPES["time_to_first_token_seconds"][0]) + 1


# ----------------------------------------------------------------------------------
# Through the proxy
# ----------------------------------------------------------------------------------
def _post(port: int, path: str, body: bytes, headers=()):
    client = RawClient(port)
    try:
        return client.roundtrip("POST", path, headers=list(headers), body=body)
    finally:
        client.close()


def _model_value(result, name: str, model: str) -> float | None:
    return result.value(name, model=model)


def test_metrics_per_model_of_answers_that_are_not_streams(fast_upstream, start_proxy):
    proxy = start_proxy(fast_upstream().url)
    before = scrape(proxy)
    for family in ("traceproxy_time_to_first_token_seconds", "traceproxy_inter_token_latency_seconds",
                   "traceproxy_e2e_request_latency_seconds"):
        assert before.types[family] == "histogram" and before.series(family + "_count") == []
    for family in ("traceproxy_prompt_tokens_total", "traceproxy_generation_tokens_total",
                   "traceproxy_stream_heartbeats_total"):
        assert before.types[family] == "counter" and before.series(family) == []
    assert _post(proxy.port, "/v1/chat/completions", b'{"model": "m-8b", "max_tokens": 4}').status == 200
    assert _post(proxy.port, "/v1/chat/completions", b'{"model": "m-8b", "max_tokens": 5}').status == 200
    assert _post(proxy.port, "/v1/completions", b'{"model": "m-70b", "max_tokens": 3}').status == 200
    assert _post(proxy.port, "/generate", b'{"text": "hi", "sampling_params": {"max_new_tokens": 2}}').status == 200
    RawClient(proxy.port).roundtrip("GET", "/health")  # a GET names no model and is not counted per model
    count = "traceproxy_e2e_request_latency_seconds_count"
    assert wait_until(lambda: scrape(proxy).value(count, model="unknown") == 1)
    result = scrape(proxy)
    assert {labels["model"]: n for labels, n in result.series(count)} == {"m-8b": 2, "m-70b": 1, "unknown": 1}
    # The fast upstream reports 8 prompt tokens and max_tokens generated.
    assert _model_value(result, "traceproxy_prompt_tokens_total", "m-8b") == 16
    assert _model_value(result, "traceproxy_generation_tokens_total", "m-8b") == 9
    assert _model_value(result, "traceproxy_generation_tokens_total", "m-70b") == 3
    assert _model_value(result, "traceproxy_generation_tokens_total", "unknown") == 2
    # No event stream: no first token, no gaps between tokens, no heartbeats.
    assert result.series("traceproxy_time_to_first_token_seconds_count") == [
        ({"model": model}, 0) for model in ("m-70b", "m-8b", "unknown")]
    assert_cumulative_per_model(result, "traceproxy_e2e_request_latency_seconds")


def assert_cumulative_per_model(result, family: str) -> None:
    models = {labels["model"] for labels, _ in result.series(family + "_count")}
    for model in models:
        buckets = [(labels["le"], value) for labels, value in result.series(family + "_bucket")
                   if labels["model"] == model]
        counts = [value for _, value in buckets]
        assert buckets[-1][0] == "+Inf" and counts == sorted(counts), (family, model)
        assert counts[-1] == result.value(family + "_count", model=model)


def test_generate_meta_info_counts_through_the_proxy(scripted_upstream, start_proxy):
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(GENERATE_ANSWER), GENERATE_ANSWER)
    proxy = start_proxy(scripted_upstream(answers_in_parts(answer)).url)
    assert _post(proxy.port, "/generate", b'{"model": "m-gen", "text": "hi"}').status == 200
    assert wait_until(lambda: scrape(proxy).value("traceproxy_prompt_tokens_total", model="m-gen") == 9)
    assert scrape(proxy).value("traceproxy_generation_tokens_total", model="m-gen") == 2


def test_the_model_cap_through_the_proxy(fast_upstream, start_proxy):
    proxy = start_proxy(fast_upstream().url, **{"metrics.max_models": 2})
    for model in ("a", "b", "c", "d", "a"):
        assert _post(proxy.port, "/v1/chat/completions", json.dumps({"model": model, "max_tokens": 1}).encode()
                     ).status == 200
    assert _post(proxy.port, "/v1/chat/completions", b"not json").status == 400  # the fast upstream refuses it
    count = "traceproxy_e2e_request_latency_seconds_count"
    assert wait_until(lambda: sum(n for _, n in scrape(proxy).series(count)) == 6)
    assert {labels["model"]: n for labels, n in scrape(proxy).series(count)} == {"a": 2, "b": 1, "other": 2,
                                                                                  "unknown": 1}


def test_a_service_of_two_workers_shows_each_models_numbers_once(upstream_process):
    from .test_workers_view import serving

    with serving(upstream_process, 2) as service:
        for index in range(8):  # a connection each: the kernel spreads them over the workers
            body = json.dumps({"model": "m" if index % 2 else "n", "max_tokens": 3}).encode()
            assert _post(service.port, "/v1/chat/completions", body).status == 200
        _, text = service.get("/metrics")
    result = Scrape(text)
    count = "traceproxy_e2e_request_latency_seconds_count"
    assert {labels["model"]: n for labels, n in result.series(count)} == {"m": 4, "n": 4}
    assert result.value("traceproxy_generation_tokens_total", model="m") == 12
    assert result.value("traceproxy_prompt_tokens_total", model="n") == 32


def test_the_model_of_a_long_sdk_body_is_found_with_tracing_off(fast_upstream, start_proxy):
    # The OpenAI SDK writes the model after the messages, far past the kept start of the body.
    messages = [{"role": "user", "content": "words " * 50} for _ in range(60)]
    body = json.dumps({"messages": messages, "model": "m-sdk", "max_tokens": 1}).encode()
    assert len(body) > 16_000
    proxy = start_proxy(fast_upstream().url)  # tracing and the access log off
    assert _post(proxy.port, "/v1/chat/completions", body).status == 200
    count = "traceproxy_e2e_request_latency_seconds_count"
    assert wait_until(lambda: scrape(proxy).series(count))
    assert scrape(proxy).series(count) == [({"model": "m-sdk"}, 1)]
