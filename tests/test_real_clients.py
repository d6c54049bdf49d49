"""Real HTTP clients work through the proxy, over keep-alive, without errors.

What this file proves, end to end against the built-in fast upstream:

* The official ``openai`` SDK streams a 20-turn chat (growing history) on one
  client: every stream assembles to exactly ``max_tokens`` content tokens with a
  final usage block, every request ends OK in the proxy, and the proxy carried the
  turns on one reused upstream connection even though the SDK itself drops its
  client connection after each stream (see the test).
* A proxy-generated failure (upstream port closed) reaches the SDK as a typed
  ``APIStatusError`` with status 502, ``error.code == "UF"`` and the
  ``x-traceproxy-outcome: UF`` header, so applications can branch on it.
* ``requests.Session``, ``httpx.Client`` and ``aiohttp.ClientSession`` each run 50
  rounds on one session, alternating SSE streaming and plain JSON chat: zero
  errors, every stream ends with ``data: [DONE]``, token counts and usage are
  right, one client connection, one upstream connection reused 49 times.
"""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import httpx
import openai
import pytest
import requests

from traceproxy.sim.fast import MODEL

from .support import wait_until

ROUNDS = 50
TURNS = 20
CLIENT_TIMEOUT = 10.0


class Recorder:
    """A lifecycle observer: what the proxy itself concluded about every request."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done: list[tuple[int, str, str | None, int]] = []  # (client conn id, outcome, error, attempts)

    def on_request_start(self, record) -> None:
        pass

    def on_mark(self, record, mark) -> None:
        pass

    def on_done(self, record) -> None:
        with self.lock:
            self.done.append((record.connection.id, record.outcome.code, record.error, len(record.attempts)))

    def outcomes(self) -> list[str]:
        with self.lock:
            return [code for _, code, _, _ in self.done]

    def failures(self) -> list[tuple]:
        with self.lock:
            return [d for d in self.done if d[1] != "OK"]

    def client_connections(self) -> set[int]:
        with self.lock:
            return {conn for conn, _, _, _ in self.done}


def observed_proxy(start_proxy, upstream_url: str, **overrides):
    proxy = start_proxy(upstream_url, **overrides)
    recorder = Recorder()
    proxy.fanout.add(recorder)
    return proxy, recorder


def tokens_for(round_no: int) -> int:
    return 3 + round_no % 11  # 3..13, varied so a cut or a merge changes the count


def check_sse(text: str, max_tokens: int) -> None:
    """An SSE chat stream: max_tokens content deltas, a usage event, then [DONE] last."""
    events = [e for e in text.split("\n\n") if e.strip()]
    assert events, "empty stream"
    assert events[-1].strip() == "data: [DONE]", f"stream does not end with [DONE]: {events[-1][:200]!r}"
    chunks = []
    for event in events[:-1]:
        assert event.startswith("data: "), f"not an SSE data event: {event[:200]!r}"
        chunks.append(json.loads(event[len("data: "):]))
    content = [c["choices"][0]["delta"].get("content") for c in chunks if c.get("choices")]
    content = [c for c in content if c]
    assert len(content) == max_tokens, f"{len(content)} content tokens, expected {max_tokens}"
    assert content == [f"tok{i} " for i in range(max_tokens)], "tokens out of order or altered"
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == max_tokens


def check_json(payload: dict, max_tokens: int) -> None:
    assert payload["object"] == "chat.completion"
    assert payload["choices"][0]["message"]["content"].split() == ["tok"] * max_tokens
    assert payload["usage"]["completion_tokens"] == max_tokens


def chat_body(round_no: int, stream: bool) -> dict:
    return {
        "model": MODEL,
        "stream": stream,
        "max_tokens": tokens_for(round_no),
        "messages": [{"role": "user", "content": f"round {round_no}"}],
    }


def assert_one_connection_each_side(proxy, recorder: Recorder, requests_sent: int) -> None:
    outcomes = recorder.outcomes()
    assert len(outcomes) == requests_sent, f"proxy saw {len(outcomes)} requests, client sent {requests_sent}"
    assert recorder.failures() == []
    assert len(recorder.client_connections()) == 1, "the client did not keep one keep-alive connection"
    stats = proxy.ctx.pool.stats
    assert stats["opened"] == 1, f"upstream connections were not reused: {dict(stats)}"
    assert stats["reused"] == requests_sent - 1, dict(stats)
    assert not proxy.ctx.in_flight


# ----------------------------------------------------------------------------------
# openai SDK
# ----------------------------------------------------------------------------------
def test_openai_sdk_streams_a_multi_turn_chat_on_one_client(fast_upstream, start_proxy):
    up = fast_upstream()
    proxy, recorder = observed_proxy(start_proxy, up.url)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{proxy.port}/v1", api_key="x",
                           max_retries=0, timeout=CLIENT_TIMEOUT)
    messages = [{"role": "system", "content": "You are a test."}]
    try:
        for turn in range(TURNS):
            max_tokens = tokens_for(turn)
            messages.append({"role": "user", "content": f"turn {turn}: say {max_tokens} tokens"})
            stream = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True},
            )
            pieces, usage, finish = [], None, None
            for chunk in stream:
                for choice in chunk.choices:
                    if choice.delta.content:
                        pieces.append(choice.delta.content)
                    finish = choice.finish_reason or finish
                if chunk.usage is not None:
                    usage = chunk.usage
            assert len(pieces) == max_tokens, f"turn {turn}: {len(pieces)} tokens, expected {max_tokens}"
            assert pieces == [f"tok{i} " for i in range(max_tokens)]
            assert finish == "length"
            assert usage is not None and usage.completion_tokens == max_tokens
            messages.append({"role": "assistant", "content": "".join(pieces)})
    finally:
        client.close()
    assert up.requests == TURNS
    assert len(recorder.outcomes()) == TURNS
    assert recorder.failures() == []
    # openai-python stops reading at ``data: [DONE]`` and closes the response before
    # the chunked terminator is parsed, so httpcore drops the client connection after
    # every stream (openai/openai-python#3440; same with no proxy in between). The
    # proxy must shield the engine from that churn: the upstream connection is kept
    # and reused across all turns, and every client close is a clean one.
    assert len(recorder.client_connections()) <= TURNS
    stats = proxy.ctx.pool.stats
    assert stats["opened"] <= 2, f"client connection churn leaked upstream: {dict(stats)}"
    assert stats["reused"] >= TURNS - 2, dict(stats)
    assert not proxy.ctx.in_flight
    assert wait_until(lambda: not proxy.ctx.connections), "proxy kept closed client connections"


def test_openai_sdk_sees_proxy_failure_as_typed_502_with_outcome(start_proxy, dead_upstream):
    proxy, recorder = observed_proxy(start_proxy, dead_upstream)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{proxy.port}/v1", api_key="x",
                           max_retries=0, timeout=CLIENT_TIMEOUT)
    try:
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as caught:
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=stream,
                )
            err = caught.value
            assert isinstance(err, openai.InternalServerError)
            assert err.status_code == 502
            assert err.code == "UF"
            assert isinstance(err.body, dict) and err.body["code"] == "UF"
            assert err.body["type"] == "upstream_connection_failure"
            assert "connect" in err.body["message"]
            assert err.response.headers["x-traceproxy-outcome"] == "UF"
    finally:
        client.close()
    # The proxy's own verdict matches what the SDK saw. (Whether the client connection
    # survives the 502 is timing-dependent: httpx writes the request head and body
    # separately, and a connect failure that beats the body is answered with
    # ``Connection: close``, so the number of client connections is not asserted.)
    assert recorder.outcomes() == ["UF", "UF"]
    assert proxy.ctx.pool.stats["connect_failed"] == 2
    assert not proxy.ctx.in_flight


# ----------------------------------------------------------------------------------
# requests, httpx, aiohttp
# ----------------------------------------------------------------------------------
def test_requests_session_alternating_stream_and_json(fast_upstream, start_proxy):
    up = fast_upstream()
    proxy, recorder = observed_proxy(start_proxy, up.url)
    url = f"http://127.0.0.1:{proxy.port}/v1/chat/completions"
    errors = []
    with requests.Session() as session:
        for i in range(ROUNDS):
            stream = i % 2 == 0
            try:
                with session.post(url, json=chat_body(i, stream), stream=stream, timeout=CLIENT_TIMEOUT) as resp:
                    assert resp.status_code == 200, resp.text[:300]
                    if stream:
                        assert resp.headers["content-type"].startswith("text/event-stream")
                        lines = [line.decode() for line in resp.iter_lines()]
                        check_sse("\n".join(lines) + "\n", tokens_for(i))
                    else:
                        check_json(resp.json(), tokens_for(i))
            except (requests.RequestException, AssertionError, ValueError) as exc:
                errors.append((i, repr(exc)))
                if len(errors) >= 5:
                    break
    assert errors == []
    assert_one_connection_each_side(proxy, recorder, ROUNDS)


def test_httpx_client_alternating_stream_and_json(fast_upstream, start_proxy):
    up = fast_upstream()
    proxy, recorder = observed_proxy(start_proxy, up.url)
    url = f"http://127.0.0.1:{proxy.port}/v1/chat/completions"
    errors = []
    with httpx.Client(timeout=CLIENT_TIMEOUT) as client:
        for i in range(ROUNDS):
            try:
                if i % 2 == 0:
                    with client.stream("POST", url, json=chat_body(i, True)) as resp:
                        assert resp.status_code == 200
                        assert resp.headers["content-type"].startswith("text/event-stream")
                        text = "".join(line + "\n" for line in resp.iter_lines())
                    check_sse(text, tokens_for(i))
                else:
                    resp = client.post(url, json=chat_body(i, False))
                    assert resp.status_code == 200, resp.text[:300]
                    check_json(resp.json(), tokens_for(i))
            except (httpx.HTTPError, AssertionError, ValueError) as exc:
                errors.append((i, repr(exc)))
                if len(errors) >= 5:
                    break
    assert errors == []
    assert_one_connection_each_side(proxy, recorder, ROUNDS)


def test_aiohttp_session_alternating_stream_and_json(fast_upstream, start_proxy):
    up = fast_upstream()
    proxy, recorder = observed_proxy(start_proxy, up.url)
    url = f"http://127.0.0.1:{proxy.port}/v1/chat/completions"

    async def rounds() -> list:
        errors = []
        timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for i in range(ROUNDS):
                stream = i % 2 == 0
                try:
                    async with session.post(url, json=chat_body(i, stream)) as resp:
                        assert resp.status == 200, await resp.text()
                        if stream:
                            assert resp.headers["content-type"].startswith("text/event-stream")
                            text = "".join([line.decode() async for line in resp.content])
                            check_sse(text, tokens_for(i))
                        else:
                            check_json(await resp.json(), tokens_for(i))
                except (aiohttp.ClientError, asyncio.TimeoutError, AssertionError, ValueError) as exc:
                    errors.append((i, repr(exc)))
                    if len(errors) >= 5:
                        break
        return errors

    assert asyncio.run(rounds()) == []
    assert_one_connection_each_side(proxy, recorder, ROUNDS)
