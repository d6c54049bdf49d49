"""Tokens end to end, as the proxy judges an event stream: time to first token,
inter-token latency, heartbeats and counted tokens in /metrics per model, and the same
evidence on the span through the real exporter process and OTLP receiver."""

from __future__ import annotations

import urllib.request

from traceproxy.observe import semconv as sc

from .otlp_receiver import OtlpHttpReceiver
from .support import RawClient, answers_in_parts, wait_until
from .test_metrics import scrape
from .test_model_metrics import _model_value, _post, assert_cumulative_per_model

OPENMETRICS_ACCEPT = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant"},"finish_reason":null}]}\n\n'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
EMPTY = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":null}]}\n\n'
FINISH = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
DONE = b"data: [DONE]\n\n"


def _sse_head() -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunk(event: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(event), event)


def test_streams_per_model_through_the_proxy(fast_upstream, start_proxy):
    proxy = start_proxy(fast_upstream().url)
    # Paced: each token its own read. 6 tokens and the finish event are 7 output events, 6 gaps.
    assert _post(proxy.port, "/v1/chat/completions", b'{"model": "m-8b", "stream": true, "max_tokens": 6}',
                 [("x-fake-tps", "200")]).complete
    assert _post(proxy.port, "/v1/completions", b'{"model": "m-70b", "stream": true, "max_tokens": 3}').complete
    count = "traceproxy_time_to_first_token_seconds_count"
    assert wait_until(lambda: sum(n for _, n in scrape(proxy).series(count)) == 2)
    result = scrape(proxy)
    assert _model_value(result, count, "m-8b") == _model_value(result, count, "m-70b") == 1
    assert _model_value(result, "traceproxy_inter_token_latency_seconds_count", "m-8b") == 6
    assert _model_value(result, "traceproxy_inter_token_latency_seconds_sum", "m-8b") > 0.02  # paced at 5 ms
    assert _model_value(result, "traceproxy_inter_token_latency_seconds_count", "m-70b") == 3
    # The engine's usage event: 8 prompt tokens, max_tokens generated.
    assert _model_value(result, "traceproxy_prompt_tokens_total", "m-8b") == 8
    assert _model_value(result, "traceproxy_generation_tokens_total", "m-8b") == 6
    assert _model_value(result, "traceproxy_stream_heartbeats_total", "m-8b") == 0
    for family in ("traceproxy_time_to_first_token_seconds", "traceproxy_inter_token_latency_seconds"):
        assert_cumulative_per_model(result, family)


def test_pings_before_the_first_token_and_during_a_stall_are_heartbeats(scripted_upstream, start_proxy):
    # 0.3 s of pings before the first token, then 0.4 s of pings between two tokens.
    parts = [_sse_head() + _chunk(ROLE), _chunk(b": ping\n\n"), _chunk(b": ping\n\n"), _chunk(TOKEN),
             _chunk(b": ping\n\n"), _chunk(EMPTY), _chunk(b": keepalive\n\n"), _chunk(TOKEN),
             _chunk(FINISH) + _chunk(DONE) + b"0\r\n\r\n"]
    proxy = start_proxy(scripted_upstream(answers_in_parts(*parts, pause=0.1)).url)
    assert _post(proxy.port, "/v1/chat/completions", b'{"model": "m", "stream": true}').complete
    assert wait_until(lambda: _model_value(scrape(proxy), "traceproxy_stream_heartbeats_total", "m") is not None)
    result = scrape(proxy)
    assert _model_value(result, "traceproxy_stream_heartbeats_total", "m") == 6  # role, 4 pings, an empty delta
    assert _model_value(result, "traceproxy_generation_tokens_total", "m") == 3  # no usage: 2 tokens and the finish
    assert _model_value(result, "traceproxy_prompt_tokens_total", "m") == 0
    # The first token, not the first byte or a ping: 0.3 s in.
    assert result.value("traceproxy_time_to_first_token_seconds_bucket", model="m", le="0.25") == 0
    assert result.value("traceproxy_time_to_first_token_seconds_bucket", model="m", le="1.0") == 1
    # Two gaps: the 0.4 s one between the tokens stands alone, above the finish's 0.1 s.
    assert result.value("traceproxy_inter_token_latency_seconds_count", model="m") == 2
    assert result.value("traceproxy_inter_token_latency_seconds_bucket", model="m", le="0.3") == 1
    assert result.value("traceproxy_inter_token_latency_seconds_bucket", model="m", le="0.6") == 2


def test_the_stream_evidence_on_the_span_through_the_exporter(scripted_upstream, start_proxy):
    parts = [_sse_head() + _chunk(ROLE), _chunk(b": ping\n\n"), _chunk(TOKEN), _chunk(EMPTY), _chunk(TOKEN),
             _chunk(FINISH) + _chunk(DONE) + b"0\r\n\r\n"]
    upstream = scripted_upstream(answers_in_parts(*parts, pause=0.05))
    with OtlpHttpReceiver() as receiver:
        proxy = start_proxy(upstream.url, **{"tracing.exporter": "otlp", "tracing.otlp_endpoint": receiver.endpoint,
                                             "tracing.otlp_protocol": "http/protobuf"})
        assert _post(proxy.port, "/v1/chat/completions", b'{"model": "m", "stream": true}').complete
        spans = receiver.wait_for_spans(2, timeout=15)
    attrs = next(s for s in spans if s.span.kind == 2).attributes
    assert attrs[sc.HEARTBEATS] == 3 and attrs[sc.OUTPUT_EVENTS] == 3
    assert attrs[sc.TIME_TO_FIRST_TOKEN] >= 0.05  # the first token, after the role and a ping
    assert attrs[sc.TOKEN_MAX_GAP] >= 0.05 and attrs[sc.GEN_AI_RESPONSE_FINISH_REASONS] == ["stop"]
    assert attrs[sc.GEN_AI_USAGE_OUTPUT_TOKENS] == 3 and attrs[sc.USAGE_SOURCE] == "counted"
    assert attrs[sc.GEN_AI_PROVIDER_NAME] == attrs[sc.GEN_AI_SYSTEM] == "openai"


def test_per_model_histograms_carry_exemplars_in_openmetrics(fast_upstream, start_proxy):
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    proxy = start_proxy(fast_upstream().url)
    trace_id = 0xFEEDFACE000000000000000000000001
    assert _post(proxy.port, "/v1/chat/completions", b'{"model": "m", "stream": true, "max_tokens": 3}',
                 [("traceparent", f"00-{trace_id:032x}-{0x1122334455667788:016x}-01"), ("x-fake-tps", "500")]
                 ).complete
    url = f"http://127.0.0.1:{proxy.admin_port}/metrics"

    def exemplars() -> dict:
        request = urllib.request.Request(url, headers={"Accept": OPENMETRICS_ACCEPT})
        with urllib.request.urlopen(request, timeout=5) as resp:
            text = resp.read().decode()
        found: dict = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.exemplar is not None:
                    found.setdefault(family.name, []).append((sample.labels, sample.exemplar))
        return found

    assert wait_until(lambda: "traceproxy_inter_token_latency_seconds" in exemplars())
    found = exemplars()
    for family in ("traceproxy_time_to_first_token_seconds", "traceproxy_inter_token_latency_seconds",
                   "traceproxy_e2e_request_latency_seconds"):
        assert found.get(family), family
        for labels, exemplar in found[family]:
            assert labels["model"] == "m" and int(exemplar.labels["trace_id"], 16) == trace_id


def test_the_openai_sdk_streaming_a_long_conversation_is_counted_under_its_model(fast_upstream, start_proxy):
    import openai

    proxy = start_proxy(fast_upstream().url)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{proxy.port}/v1", api_key="x", max_retries=0, timeout=10)
    # The SDK writes the model after the messages, past the start of the body the proxy keeps.
    messages = [{"role": "user", "content": "words " * 50} for _ in range(60)]
    stream = client.chat.completions.create(model="m-sdk", messages=messages, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True})
    assert len([chunk for chunk in stream if chunk.choices and chunk.choices[0].delta.content]) == 4
    client.close()
    count = "traceproxy_time_to_first_token_seconds_count"
    assert wait_until(lambda: _model_value(scrape(proxy), count, "m-sdk") == 1)
    result = scrape(proxy)
    assert _model_value(result, "traceproxy_generation_tokens_total", "m-sdk") == 4  # the engine's usage
    assert _model_value(result, "traceproxy_prompt_tokens_total", "m-sdk") == 8
    assert _model_value(result, "traceproxy_inter_token_latency_seconds_count", "m-sdk") == 4
