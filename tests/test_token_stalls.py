"""An event stream is judged on its tokens, end to end (issue 23).

A scripted upstream streams a ``text/event-stream`` response with heartbeats in it
(SSE comments, empty or role-only deltas, usage-only events, a repeated /generate
event) and the test checks, while the request is still streaming, what the watchdog,
/debug/inflight, /metrics and the log make of it, then how it ended. Thresholds of a
few hundred milliseconds; every upstream pings at most MAX_PINGS times, and stops
when the test has seen what it waits for (``release``)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import openai
import pytest

from .support import RawClient, admin_get, ended, wait_until

FAST = {"stall.first_byte": 0.3, "stall.stream_gap": 0.3}
MAX_PINGS = 100
PING_EVERY = 0.05

SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def delta(fields: str, finish: str = "null") -> bytes:
    return (b'data: {"id":"c1","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":%s,'
            b'"finish_reason":%s}]}\n\n' % (fields.encode(), finish.encode()))


CONTENT = delta('{"content":"Hello"}')
MORE = delta('{"content":" world"}')
FINISH = delta("{}", '"stop"')
DONE = b"data: [DONE]\n\n"
HEARTBEATS = {
    "comment": b": ping\n\n",
    "empty-delta": delta("{}"),
    "role-only-delta": delta('{"role":"assistant"}'),
    "usage-only": b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n',
    "blank-data": b"data: \n\n",
}
TOOL_CALL = delta('{"tool_calls":[{"index":0,"function":{"arguments":"{\\"city\\": "}}]}')
REASONING = delta('{"reasoning_content":"Let me think"}')


def generate(text: str, tokens: int, finish: str = "null") -> bytes:
    """An SGLang /generate stream event: the whole text so far, and its token count."""
    return (b'data: {"text":"%s","meta_info":{"id":"r1","prompt_tokens":4,"completion_tokens":%d,'
            b'"finish_reason":%s}}\n\n' % (text.encode(), tokens, finish.encode()))


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class PingingUpstream:
    """Sends the event-stream head and ``before``, then ``ping`` every PING_EVERY s until
    ``release`` is set (at most MAX_PINGS), then ``after`` and the end of the body; with
    ``after`` None it pings on until the proxy closes the connection."""

    def __init__(self, before=(), after=(), ping: bytes = HEARTBEATS["comment"], head: bytes = SSE_HEAD) -> None:
        self.before, self.after, self.ping, self.head = before, after, ping, head
        self.release = threading.Event()
        self.closed = threading.Event()
        self.pings_sent = 0

    async def __call__(self, reader, writer, upstream) -> None:
        try:
            await reader.read_request()
            writer.write(self.head + b"".join(chunk(event) for event in self.before))
            await writer.drain()
            for _ in range(MAX_PINGS):
                if self.release.is_set() and self.after is not None:
                    break
                await asyncio.sleep(PING_EVERY)
                writer.write(chunk(self.ping))
                await writer.drain()
                self.pings_sent += 1
            if self.after is not None:
                writer.write(b"".join(chunk(event) for event in self.after) + b"0\r\n\r\n")
                await writer.drain()
            await reader.read(1)
        finally:
            self.closed.set()


def paced(*events: bytes, every: float = PING_EVERY):
    """A handler that streams ``events`` one every ``every`` seconds, then ends the body."""

    async def handler(reader, writer, upstream) -> None:
        await reader.read_request()
        writer.write(SSE_HEAD)
        for event in events:
            await asyncio.sleep(every)
            writer.write(chunk(event))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read(1)

    return handler


def stalled_with(proxy, code: str):
    """The in-flight record that has a stall ``code``, or None."""
    return next((r for r in list(proxy.ctx.in_flight.values()) if any(e.code == code for e in r.stalls)), None)


def inflight_entry(proxy) -> dict:
    return json.loads(admin_get(proxy, "/debug/inflight"))["requests"][0]


def access_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ----------------------------------------------------------------------------------
# Heartbeats never reset the stall clock
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["comment", "empty-delta", "blank-data"])
def test_pings_before_the_first_token_are_a_first_byte_stall(kind, scripted_upstream, start_proxy):
    upstream = PingingUpstream(after=(CONTENT, FINISH, DONE), ping=HEARTBEATS[kind])
    proxy = start_proxy(scripted_upstream(upstream).url, **FAST)
    done = ended(proxy)
    client = RawClient(proxy.port)
    client.request("POST", "/v1/chat/completions", body=b'{"stream":true}')
    assert wait_until(lambda: stalled_with(proxy, "FBS"), timeout=5), "pings hid the first-byte stall"
    entry = inflight_entry(proxy)
    assert entry["phase"] == "streaming_response" and entry["chunks"] >= 1
    assert entry["verdict"]["outcome"] == "FBS" and entry["verdict"]["blame"] == "engine"
    assert entry["verdict"]["stalled"] is True
    upstream.release.set()
    response = client.response()
    assert response.status == 200 and response.complete and response.body.endswith(DONE)
    assert wait_until(lambda: done)
    record = done[0]
    assert record.outcome.code == "OK"
    stall = record.stalls[0]
    assert stall.code == "FBS" and stall.resolved_ns >= record.first_token_ns  # no ping ended it
    assert record.stream_events.heartbeats >= 3 and record.stream_events.output_events == 2
    client.close()


@pytest.mark.parametrize("kind", ["comment", "empty-delta", "role-only-delta", "usage-only"])
def test_one_token_then_pings_is_a_mid_stream_stall_seen_everywhere(kind, scripted_upstream, start_proxy, tmp_path,
                                                                  caplog):
    caplog.set_level(logging.WARNING, logger="traceproxy.watchdog")
    log = tmp_path / "access.log"
    upstream = PingingUpstream(before=(CONTENT,), after=(MORE, FINISH, DONE), ping=HEARTBEATS[kind])
    proxy = start_proxy(scripted_upstream(upstream).url, **{**FAST, "access_log.path": str(log)})
    client = RawClient(proxy.port)
    client.request("POST", "/v1/chat/completions", headers=[("x-request-id", "pings-1")], body=b'{"stream":true}')
    assert wait_until(lambda: stalled_with(proxy, "MSS"), timeout=5), "pings hid the mid-stream stall"
    record = stalled_with(proxy, "MSS")
    entry = inflight_entry(proxy)
    assert entry["verdict"]["outcome"] == "MSS" and entry["verdict"]["blame"] == "engine"
    assert entry["verdict"]["stalled"] is True
    # Stalled since its token, whatever came after it.
    assert record.stalls[0].since_ns == record.first_token_ns == record.last_token_ns
    assert 'traceproxy_stalls_total{outcome="MSS",blame="engine"} 1' in admin_get(proxy, "/metrics")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("stall MSS"))
    assert "blame engine" in line and "pings-1" in line
    upstream.release.set()
    response = client.response()
    assert response.complete and response.body.endswith(DONE)
    assert wait_until(lambda: access_lines(log), timeout=5)
    [logged] = access_lines(log)
    assert logged["request_id"] == "pings-1" and logged["outcome"] == "OK"
    assert [s["outcome"] for s in logged["stalls"]] == ["MSS"] and logged["stalls"][0]["resolved_after"] > 0.3
    client.close()


@pytest.mark.parametrize("token,code", [(True, "MSS"), (False, "FBS")], ids=["after-a-token", "no-token"])
def test_abort_ends_a_stream_of_pings(token, code, scripted_upstream, start_proxy):
    upstream = PingingUpstream(before=(CONTENT,) if token else (), after=None)
    proxy = start_proxy(scripted_upstream(upstream).url, **{**FAST, "stall.action": "abort"})
    done = ended(proxy)
    client = RawClient(proxy.port)
    client.request("POST", "/v1/chat/completions", body=b'{"stream":true}')
    response = client.response()
    assert response.status == 200 and not response.complete  # cut short, not ended as if whole
    assert wait_until(lambda: done, timeout=5)
    assert done[0].outcome.code == code and done[0].outcome.blame.value == "engine"
    assert "aborted by the watchdog" in done[0].error
    assert upstream.closed.wait(2), "the engine must see its connection close"
    assert upstream.pings_sent < MAX_PINGS, "ended by the pings running out, not by the stall"
    client.close()


# ----------------------------------------------------------------------------------
# What counts as a token
# ----------------------------------------------------------------------------------
OUTPUT_ONLY_STREAMS = {
    "tool-call-arguments": [TOOL_CALL] * 12 + [FINISH, DONE],
    "reasoning": [REASONING] * 12 + [CONTENT, FINISH, DONE],
    "generate": [generate("a" * n, n) for n in range(1, 13)] + [generate("a" * 12, 12, '{"type":"stop"}')],
}


@pytest.mark.parametrize("kind", sorted(OUTPUT_ONLY_STREAMS))
def test_tool_calls_reasoning_and_generate_text_are_tokens(kind, scripted_upstream, start_proxy):
    # Each event alternates with a heartbeat, one every PING_EVERY: a stream judged
    # on these tokens stays well inside its gap, one that took them for heartbeats
    # would stall.
    events = [part for event in OUTPUT_ONLY_STREAMS[kind] for part in (event, HEARTBEATS["comment"])]
    proxy = start_proxy(scripted_upstream(paced(*events)).url, **FAST)
    done = ended(proxy)
    response = RawClient(proxy.port).roundtrip("POST", "/generate" if kind == "generate" else "/v1/chat/completions",
                                               body=b'{"stream":true}')
    assert response.complete and wait_until(lambda: done)
    record = done[0]
    assert record.outcome.code == "OK" and record.stalls == []
    assert record.stream_events.output_events >= 12 and record.stream_events.heartbeats == len(events) // 2


def test_a_generate_stream_repeating_its_last_event_is_a_mid_stream_stall(scripted_upstream, start_proxy):
    # SGLang's /generate events carry the whole text so far: the same event again is no new token.
    upstream = PingingUpstream(before=(generate("a", 1), generate("ab", 2)),
                               after=(generate("abc", 3, '{"type":"stop"}'),), ping=generate("ab", 2))
    proxy = start_proxy(scripted_upstream(upstream).url, **FAST)
    done = ended(proxy)
    client = RawClient(proxy.port)
    client.request("POST", "/generate", body=b'{"text":"hi","stream":true}')
    assert wait_until(lambda: stalled_with(proxy, "MSS"), timeout=5)
    upstream.release.set()
    assert client.response().complete and wait_until(lambda: done)
    assert done[0].outcome.code == "OK" and done[0].stalls[0].code == "MSS"
    client.close()


# ----------------------------------------------------------------------------------
# Any other response keeps byte judgement
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("head", [
    b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: gzip\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n",
], ids=["not-an-event-stream", "coded-event-stream"])
def test_a_response_whose_events_cannot_be_read_is_judged_on_its_bytes(head, scripted_upstream, start_proxy):
    upstream = PingingUpstream(before=(b"x\n",), after=(b"y\n",), head=head)
    proxy = start_proxy(scripted_upstream(upstream).url, **FAST)
    done = ended(proxy)
    client = RawClient(proxy.port)
    client.request("POST", "/v1/chat/completions", body=b"{}")
    time.sleep(0.8)  # well past stream_gap, with a byte every PING_EVERY
    upstream.release.set()
    assert client.response().complete and wait_until(lambda: done)
    assert done[0].outcome.code == "OK" and done[0].stalls == [] and done[0].stream_events is None
    client.close()


# ----------------------------------------------------------------------------------
# A real client
# ----------------------------------------------------------------------------------
def test_the_openai_sdk_behind_a_pinging_upstream_gets_its_tokens_while_the_stall_is_seen(scripted_upstream,
                                                                                           start_proxy):
    # Pings between tokens, as gateways add them, then only pings for a while.
    upstream = PingingUpstream(before=(delta('{"role":"assistant","content":""}'), CONTENT, HEARTBEATS["comment"],
                                       HEARTBEATS["empty-delta"]),
                               after=(MORE, HEARTBEATS["comment"], FINISH, DONE))
    proxy = start_proxy(scripted_upstream(upstream).url, **FAST)
    done = ended(proxy)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{proxy.port}/v1", api_key="x", max_retries=0, timeout=10)
    got: list = []

    def chat() -> None:
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                stream=True)
        got.extend(c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content)

    sdk = threading.Thread(target=chat, daemon=True)
    sdk.start()
    try:
        assert wait_until(lambda: stalled_with(proxy, "MSS"), timeout=5), "the SDK's stream of pings was not a stall"
        assert inflight_entry(proxy)["verdict"]["stalled"] is True
    finally:
        upstream.release.set()
        sdk.join(10)
    assert got == ["Hello", " world"]
    assert wait_until(lambda: done)
    record = done[0]
    assert record.outcome.code == "OK" and [s.code for s in record.stalls] == ["MSS"]
    assert record.stream_events.output_events == 3 and record.stream_events.heartbeats >= 4
    client.close()
