"""GenAI span attributes as the conventions currently released name them: the provider
(detected or configured), the older names beside the new unless
OTEL_SEMCONV_STABILITY_OPT_IN asks for the latest only, the conversation id, and an
event stream's first token, heartbeats, longest token gap and usage source; through
the real exporter process to a real OTLP receiver."""

from __future__ import annotations

import json

import pytest

from traceproxy.config import ConfigError, default_settings
from traceproxy.observe import semconv as sc
from traceproxy.observe.genai_spans import GenAIEvidence, SpanOptions, genai_attributes, latest_opted_in
from traceproxy.observe.spans import spans_for
from traceproxy.observe.tracing import TracingObserver

from .otlp_receiver import OtlpHttpReceiver
from .support import ListSink, RawClient, answers_in_parts, wait_until

MS = 1_000_000
CHAT = json.dumps({"model": "m-7b", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).encode()
VLLM_ANSWER = json.dumps({"id": "cmpl-1", "object": "chat.completion", "model": "m-7b", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": None, "finish_reason": "stop",
     "stop_reason": None}], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}).encode()
SGLANG_ANSWER = json.dumps({"id": "c-1", "object": "chat.completion", "model": "m-7b", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop",
     "matched_stop": 2}], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}).encode()


def _json_answer(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def _summary(start_proxy, upstream_url: str, path: str, body: bytes, headers=()):
    """The request summary the tracing observer makes of one request through a real proxy."""
    sink = ListSink()
    proxy = start_proxy(upstream_url, observers=[TracingObserver(sink, ("127.0.0.1", 8000), ("127.0.0.1", 1), 1.0)])
    client = RawClient(proxy.port)
    assert client.roundtrip("POST", path, headers=list(headers), body=body).status == 200
    client.close()
    assert wait_until(lambda: sink.items)
    return sink.items[0]


def _attributes(summary, options: SpanOptions = SpanOptions()) -> dict:
    path = summary.target.partition("?")[0]
    return genai_attributes(path, summary, 0, options)


@pytest.mark.parametrize("answer, provider", [(VLLM_ANSWER, "vllm"), (SGLANG_ANSWER, "sglang")],
                         ids=["vllm", "sglang"])
def test_the_provider_is_detected_from_the_engines_own_fields(answer, provider, scripted_upstream, start_proxy):
    summary = _summary(start_proxy, scripted_upstream(answers_in_parts(_json_answer(answer))).url,
                       "/v1/chat/completions", CHAT)
    attrs = _attributes(summary)
    assert attrs[sc.GEN_AI_PROVIDER_NAME] == provider
    assert attrs[sc.GEN_AI_REQUEST_MODEL] == attrs[sc.GEN_AI_RESPONSE_MODEL] == "m-7b"
    assert (attrs[sc.GEN_AI_USAGE_INPUT_TOKENS], attrs[sc.GEN_AI_USAGE_OUTPUT_TOKENS]) == (3, 1)
    assert attrs[sc.USAGE_SOURCE] == "usage" and attrs[sc.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)


def test_openai_when_nothing_says_otherwise_sglang_for_generate_and_the_configured_one_first(fast_upstream,
                                                                                             start_proxy):
    upstream = fast_upstream().url
    chat = _summary(start_proxy, upstream, "/v1/chat/completions", CHAT)
    assert _attributes(chat)[sc.GEN_AI_PROVIDER_NAME] == "openai"
    generate = _summary(start_proxy, upstream, "/generate", b'{"text": "hi", "sampling_params": {}}')
    assert _attributes(generate)[sc.GEN_AI_PROVIDER_NAME] == "sglang"
    assert _attributes(chat, SpanOptions(provider="vllm"))[sc.GEN_AI_PROVIDER_NAME] == "vllm"


def test_the_older_name_is_emitted_beside_the_new_unless_the_latest_is_opted_in(fast_upstream, start_proxy):
    summary = _summary(start_proxy, fast_upstream().url, "/v1/chat/completions", CHAT)
    default = _attributes(summary)
    assert default[sc.GEN_AI_PROVIDER_NAME] == default[sc.GEN_AI_SYSTEM] == "openai"
    latest = _attributes(summary, SpanOptions(latest=True))
    assert latest[sc.GEN_AI_PROVIDER_NAME] == "openai" and sc.GEN_AI_SYSTEM not in latest
    assert latest_opted_in({"OTEL_SEMCONV_STABILITY_OPT_IN": "http, gen_ai_latest_experimental"})
    assert not latest_opted_in({"OTEL_SEMCONV_STABILITY_OPT_IN": "http/dup"}) and not latest_opted_in({})


def test_an_event_streams_tokens_heartbeats_and_conversation_on_the_span(fast_upstream, start_proxy):
    summary = _summary(start_proxy, fast_upstream().url, "/v1/chat/completions", CHAT)
    # What the proxy copies of a stream: 9 events, 3 with output, 4 heartbeats, the first
    # token 250 ms in, the longest wait between two 1.5 s, no usage from the engine.
    found = GenAIEvidence(9, 3, 4, summary.start_ns + 250 * MS, 1_500 * MS, "m-7b-0613", None, None,
                          ("length",), "conv-42")
    attrs = _attributes(summary._replace(genai=tuple(found)))
    assert attrs[sc.TIME_TO_FIRST_TOKEN] == 0.25 and attrs[sc.TOKEN_MAX_GAP] == 1.5
    assert attrs[sc.HEARTBEATS] == 4 and attrs[sc.OUTPUT_EVENTS] == 3
    assert attrs[sc.GEN_AI_USAGE_OUTPUT_TOKENS] == 3 and attrs[sc.USAGE_SOURCE] == "counted"
    assert attrs[sc.GEN_AI_RESPONSE_MODEL] == "m-7b-0613" and attrs[sc.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
    assert attrs[sc.GEN_AI_CONVERSATION_ID] == "conv-42"
    with_usage = _attributes(summary._replace(genai=tuple(found._replace(prompt_tokens=11, completion_tokens=2))))
    assert (with_usage[sc.GEN_AI_USAGE_INPUT_TOKENS], with_usage[sc.GEN_AI_USAGE_OUTPUT_TOKENS]) == (11, 2)
    assert with_usage[sc.USAGE_SOURCE] == "usage"
    # Not an event stream, but a conversation id: only that.
    plain = _attributes(summary._replace(genai=(-1, 0, 0, 0, 0, None, None, None, (), "conv-7")))
    assert plain[sc.GEN_AI_CONVERSATION_ID] == "conv-7" and sc.HEARTBEATS not in plain


def test_a_conversation_id_header_must_be_one_header_name():
    settings = default_settings()
    assert settings.tracing.conversation_id_header == "" and settings.tracing.genai_provider == ""
    assert settings.replace(**{"tracing.conversation_id_header": "X-Session-Id"}
                            ).tracing.conversation_id_header == "x-session-id"
    for bad in ("x session", "a,b"):
        with pytest.raises(ConfigError, match="tracing.conversation_id_header"):
            settings.replace(**{"tracing.conversation_id_header": bad})


def test_the_exporter_process_sends_the_configured_provider_and_honours_the_opt_in(monkeypatch, fast_upstream,
                                                                                    start_proxy):
    monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", "gen_ai_latest_experimental")  # the exporter inherits it
    with OtlpHttpReceiver() as receiver:
        proxy = start_proxy(fast_upstream().url, **{"tracing.exporter": "otlp",
                                                    "tracing.otlp_endpoint": receiver.endpoint,
                                                    "tracing.otlp_protocol": "http/protobuf",
                                                    "tracing.genai_provider": "vllm"})
        assert RawClient(proxy.port).roundtrip("POST", "/v1/chat/completions", body=CHAT).status == 200
        spans = receiver.wait_for_spans(2, timeout=15)
    server = next(s for s in spans if s.span.kind == 2)
    assert server.attributes[sc.GEN_AI_PROVIDER_NAME] == "vllm" and sc.GEN_AI_SYSTEM not in server.attributes
    assert server.attributes[sc.GEN_AI_USAGE_OUTPUT_TOKENS] == 4 and server.attributes[sc.USAGE_SOURCE] == "usage"


def test_spans_for_keeps_the_genai_attributes_on_the_server_span(fast_upstream, start_proxy):
    summary = _summary(start_proxy, fast_upstream().url, "/v1/chat/completions", CHAT)
    server = spans_for(summary)[0]
    assert server.attributes[sc.GEN_AI_OPERATION_NAME] == "chat"
    assert server.attributes[sc.GEN_AI_PROVIDER_NAME] == "openai"
