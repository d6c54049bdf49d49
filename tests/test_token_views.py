"""What the views show of an event stream's tokens (issue 23): /debug/inflight's
``tokens``, the stall line's ``tokens:`` part, the stall span's attributes, the access
log's ``tokens`` and top's TOKEN/HB column; a response that is not an event stream
shows none of it. And the conversation id (``tracing.conversation_id_header``) on the
span, in /debug/inflight and in the access log, sent by the real openai SDK.

Thresholds of a few hundred milliseconds; every upstream pings a bounded number of
times (``test_token_stalls.PingingUpstream``)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading

import openai
import pytest

from traceproxy import top
from traceproxy.diagnose import file_spans
from traceproxy.lifecycle.token_progress import TokenProgress
from traceproxy.observe import semconv as sc
from traceproxy.observe.token_view import stall_words

from .support import RawClient, admin_get, wait_until
from .test_token_stalls import CONTENT, DONE, FAST, FINISH, MORE, PingingUpstream, chunk, stalled_with

SERVER = "server"


def inflight_requests(proxy) -> list[dict]:
    return json.loads(admin_get(proxy, "/debug/inflight"))["requests"]


def access_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def stall_line(caplog, code: str) -> str:
    return next(r.getMessage() for r in caplog.records if r.getMessage().startswith(f"stall {code}"))


def spans_of(path, request_id: str) -> list:
    return file_spans(path, request_id) if path.exists() else []


def stall_span(path, request_id: str, code: str):
    return next((s for s in spans_of(path, request_id) if s.name.startswith(f"stall {code}")), None)


def _observed(tmp_path, **more) -> dict:
    return {**FAST, "access_log.path": str(tmp_path / "access.log"), "tracing.exporter": "file",
            "tracing.file_path": str(tmp_path / "spans.jsonl"), **more}


# ----------------------------------------------------------------------------------
# An event stream: its tokens everywhere
# ----------------------------------------------------------------------------------
def test_a_token_then_pings_shows_the_time_since_the_token_and_the_heartbeats_everywhere(
        scripted_upstream, start_proxy, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="traceproxy.watchdog")
    upstream = PingingUpstream(before=(CONTENT,), after=(MORE, FINISH, DONE))
    proxy = start_proxy(scripted_upstream(upstream).url, **_observed(tmp_path))
    client = RawClient(proxy.port)
    client.request("POST", "/v1/chat/completions", headers=[("x-request-id", "tok-1")], body=b'{"stream":true}')
    assert wait_until(lambda: stalled_with(proxy, "MSS"), timeout=5)
    # Pings keep coming: the time since the token grows, and so do the heartbeats.
    assert wait_until(lambda: inflight_requests(proxy)[0]["tokens"]["heartbeats"] >= 8, timeout=5)
    tokens = inflight_requests(proxy)[0]["tokens"]
    assert tokens["output_events"] == 1 and tokens["since_head_without_token_s"] is None
    # One token: no gap between two yet (null, not a 0 that reads as tokens back to back).
    assert tokens["since_last_token_s"] >= 0.3 and tokens["max_token_gap_s"] is None
    assert 0 <= tokens["time_to_first_token_s"] < tokens["since_last_token_s"] + 1
    line = stall_line(caplog, "MSS")
    assert re.search(r" tokens: 1 output event, the last \d+\.\d s ago, \d+ heartbeats", line), line
    span = None

    def found_span():
        nonlocal span
        span = stall_span(tmp_path / "spans.jsonl", "tok-1", "MSS")
        return span is not None

    assert wait_until(found_span, timeout=10)
    assert span.attributes[sc.OUTPUT_EVENTS] == 1 and span.attributes[sc.HEARTBEATS] >= 1
    assert span.attributes[sc.SINCE_LAST_TOKEN] >= 0.3 and sc.SINCE_HEAD_WITHOUT_TOKEN not in span.attributes
    upstream.release.set()
    assert client.response().complete
    assert wait_until(lambda: access_lines(tmp_path / "access.log"), timeout=5)
    [logged] = access_lines(tmp_path / "access.log")
    # The whole stream: three output events (two tokens and the finish), the pings between.
    assert logged["tokens"]["output_events"] == 3 and logged["tokens"]["heartbeats"] >= 8
    assert logged["tokens"]["max_token_gap"] >= 0.3
    assert 0 < logged["tokens"]["time_to_first_token"] < logged["request_time"]
    assert "conversation_id" not in logged  # no header configured
    client.close()


def test_pings_before_any_token_show_the_time_since_the_response_head(scripted_upstream, start_proxy, tmp_path,
                                                                      caplog):
    caplog.set_level(logging.WARNING, logger="traceproxy.watchdog")
    upstream = PingingUpstream(after=(CONTENT, FINISH, DONE))
    proxy = start_proxy(scripted_upstream(upstream).url, **_observed(tmp_path))
    client = RawClient(proxy.port)
    client.request("POST", "/v1/chat/completions", headers=[("x-request-id", "tok-2")], body=b'{"stream":true}')
    assert wait_until(lambda: stalled_with(proxy, "FBS"), timeout=5)
    tokens = inflight_requests(proxy)[0]["tokens"]
    assert tokens["output_events"] == 0 and tokens["heartbeats"] >= 1
    assert tokens["since_last_token_s"] is None and tokens["time_to_first_token_s"] is None
    assert tokens["since_head_without_token_s"] >= 0.3
    line = stall_line(caplog, "FBS")
    assert re.search(r" tokens: none, \d+\.\d s since the response head, \d+ heartbeats", line), line
    assert wait_until(lambda: stall_span(tmp_path / "spans.jsonl", "tok-2", "FBS"), timeout=10)
    attrs = stall_span(tmp_path / "spans.jsonl", "tok-2", "FBS").attributes
    assert attrs[sc.OUTPUT_EVENTS] == 0 and attrs[sc.SINCE_HEAD_WITHOUT_TOKEN] >= 0.3
    assert sc.SINCE_LAST_TOKEN not in attrs
    upstream.release.set()
    assert client.response().complete
    assert wait_until(lambda: access_lines(tmp_path / "access.log"), timeout=5)
    [logged] = access_lines(tmp_path / "access.log")
    assert logged["tokens"]["output_events"] == 2 and logged["tokens"]["time_to_first_token"] >= 0.3
    client.close()


def server_span(path, request_id: str):
    return next((s for s in spans_of(path, request_id) if sc.OUTPUT_EVENTS in s.attributes
                 and not s.name.startswith("stall ")), None)


def test_a_stream_with_one_token_has_no_token_gap_anywhere(scripted_upstream, start_proxy, tmp_path):
    # One token, pings, then the end: the longest gap between two tokens is not known
    # (null, left off the span), rather than a 0 that says the tokens came back to back.
    upstream = PingingUpstream(before=(CONTENT,), after=(DONE,))
    proxy = start_proxy(scripted_upstream(upstream).url, **_observed(tmp_path))
    client = RawClient(proxy.port)
    client.request("POST", "/v1/chat/completions", headers=[("x-request-id", "one-tok")], body=b'{"stream":true}')
    assert wait_until(lambda: stalled_with(proxy, "MSS"), timeout=5)
    assert inflight_requests(proxy)[0]["tokens"]["max_token_gap_s"] is None
    upstream.release.set()
    assert client.response().complete
    assert wait_until(lambda: access_lines(tmp_path / "access.log"), timeout=5)
    [logged] = access_lines(tmp_path / "access.log")
    assert logged["tokens"]["output_events"] == 1 and logged["tokens"]["heartbeats"] >= 1
    assert logged["tokens"]["max_token_gap"] is None and logged["tokens"]["time_to_first_token"] > 0
    assert wait_until(lambda: server_span(tmp_path / "spans.jsonl", "one-tok"), timeout=10)
    attrs = server_span(tmp_path / "spans.jsonl", "one-tok").attributes
    assert attrs[sc.OUTPUT_EVENTS] == 1 and sc.TIME_TO_FIRST_TOKEN in attrs
    assert sc.TOKEN_MAX_GAP not in attrs
    client.close()


@pytest.mark.parametrize(("output_events", "heartbeats", "words"), [
    (1, 1, "1 output event, the last 2.1 s ago, 1 heartbeat"),
    (2, 0, "2 output events, the last 2.1 s ago, 0 heartbeats"),
    (0, 1, "none, 2.1 s since the response head, 1 heartbeat"),
])
def test_the_stall_lines_tokens_part_counts_in_words(output_events, heartbeats, words):
    progress = TokenProgress(output_events, heartbeats, output_events > 0, 1_000_000_000, None, None)
    assert stall_words(progress, 3_100_000_000) == words


class SilentMidBody:
    """A JSON response (not an event stream) that sends its first part, then nothing until released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    async def __call__(self, reader, writer, upstream) -> None:
        await reader.read_request()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + chunk(b'{"choices":'))
        await writer.drain()
        for _ in range(200):
            if self.release.is_set():
                break
            await asyncio.sleep(0.02)
        writer.write(chunk(b"[]}") + b"0\r\n\r\n")
        await writer.drain()
        await reader.read(1)


def test_a_response_that_is_not_an_event_stream_shows_no_tokens(scripted_upstream, start_proxy, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="traceproxy.watchdog")
    upstream = SilentMidBody()
    proxy = start_proxy(scripted_upstream(upstream).url, **_observed(tmp_path))
    client = RawClient(proxy.port)
    client.request("POST", "/v1/chat/completions", headers=[("x-request-id", "bytes-1")], body=b"{}")
    assert wait_until(lambda: stalled_with(proxy, "MSS"), timeout=5)  # judged on its bytes
    assert "tokens" not in inflight_requests(proxy)[0]
    assert " tokens:" not in stall_line(caplog, "MSS")
    assert wait_until(lambda: stall_span(tmp_path / "spans.jsonl", "bytes-1", "MSS"), timeout=10)
    attrs = stall_span(tmp_path / "spans.jsonl", "bytes-1", "MSS").attributes
    assert sc.HEARTBEATS not in attrs and sc.SINCE_LAST_TOKEN not in attrs
    upstream.release.set()
    assert client.response().complete
    assert wait_until(lambda: access_lines(tmp_path / "access.log"), timeout=5)
    assert "tokens" not in access_lines(tmp_path / "access.log")[0]
    client.close()


# ----------------------------------------------------------------------------------
# top
# ----------------------------------------------------------------------------------
def _entry(tokens: dict | None, request_id: str) -> dict:
    entry = {"request_id": request_id, "method": "POST", "path": "/v1/chat/completions",
             "phase": "streaming_response", "age_s": 3.0, "chunks": 9, "client_connection": 1,
             "client_request_sequence": 1, "upstream_connection": 2, "upstream_reused": False,
             "bytes": {"response_out": 900},
             "verdict": {"outcome": "MSS", "blame": "engine", "waiting_for_s": 2.1, "stall_after_s": 30.0,
                         "stalled": False}}
    if tokens is not None:
        entry["tokens"] = tokens
    return entry


SINCE_TOKEN = {"output_events": 4, "heartbeats": 14, "since_last_token_s": 2.1, "since_head_without_token_s": None}
NO_TOKEN_YET = {"output_events": 0, "heartbeats": 3, "since_last_token_s": None, "since_head_without_token_s": 12.5}


def test_top_shows_the_time_since_the_last_token_or_the_head_and_the_heartbeats():
    assert top.token_cell(_entry(SINCE_TOKEN, "a")) == "2.1s 14hb"
    assert top.token_cell(_entry(NO_TOKEN_YET, "b")) == "head+12s 3hb"
    assert top.token_cell(_entry(None, "c")) == "-"
    lines = top.render_table([_entry(SINCE_TOKEN, "req-sse"), _entry(None, "req-json")], 200, use_color=False)
    assert "TOKEN/HB" in lines[0]
    assert "2.1s 14hb" in next(line for line in lines if "req-sse" in line)
    # With no event stream in flight, no column.
    assert "TOKEN/HB" not in top.render_table([_entry(None, "req-json")], 200, use_color=False)[0]


HEARTBEATS_ONLY_FBS = {"output_events": 0, "heartbeats": 18, "since_last_token_s": None,
                       "since_head_without_token_s": 2.6}
HEX_REQUEST_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def _token_stalls() -> list[dict]:
    fbs = {**_entry(HEARTBEATS_ONLY_FBS, "hb-none2"),
           "verdict": {"outcome": "FBS", "blame": "engine", "waiting_for_s": 2.6, "stall_after_s": 1.0,
                       "stalled": True}}
    mss = {**_entry(SINCE_TOKEN, HEX_REQUEST_ID),
           "verdict": {"outcome": "MSS", "blame": "engine", "waiting_for_s": 2.1, "stall_after_s": 1.0,
                       "stalled": True}}
    return [fbs, mss]


def test_top_keeps_the_token_column_at_80_columns():
    # Piped, top --once renders 80 columns: the waits an event stream is judged on stay,
    # the path goes and the request id is cut instead.
    entries = _token_stalls()
    lines = top.render_table(entries, 80, use_color=False)
    assert all(len(line) <= 80 for line in lines)
    assert "TOKEN/HB" in lines[0] and "REQUEST ID" in lines[0]
    assert "head+2.6s 18hb" in next(line for line in lines if "hb-none2" in line)
    assert "2.1s 14hb" in next(line for line in lines if HEX_REQUEST_ID[:3] in line and HEX_REQUEST_ID[-3:] in line)
    assert "hidden" not in lines[-1]
    # Narrower still, the token column goes, the rest stays within the width, and a line says so.
    narrow = top.render_table(entries, 60, use_color=False)
    assert "TOKEN/HB" not in narrow[0] and all(len(line) <= 60 for line in narrow)
    assert narrow[-1].startswith("(TOKEN/HB hidden: widen to ") and narrow[-1].endswith(" columns)"), narrow


def test_at_80_columns_the_engine_column_outranks_the_token_column():
    # A PD stall's component is the first thing to look at: with an engine stage in flight,
    # ENGINE keeps its place (cut to the component and the start of the stage) and TOKEN/HB
    # goes, with a line under the table that says so and how wide a terminal shows it.
    entries = _token_stalls() + [{**_entry(None, "req-json"), "engine_stage": {
        "component": "kv_transfer", "stage": "prefill_transfer_kv_cache", "source": "spans"}}]
    lines = top.render_table(entries, 80, use_color=False)
    assert all(len(line) <= 80 for line in lines)
    assert "ENGINE" in lines[0] and "REQUEST ID" in lines[0] and "TOKEN/HB" not in lines[0]
    assert "kv_transfer " in next(line for line in lines if "req-json" in line)
    [note] = [line for line in lines if "hidden" in line]
    assert note == lines[-1] and note.startswith("(TOKEN/HB hidden: widen to "), lines
    needed = int(note.split("widen to ")[1].split()[0])
    assert 80 < needed and "TOKEN/HB" in top.render_table(entries, needed, use_color=False)[0]
    assert "TOKEN/HB" not in top.render_table(entries, needed - 1, use_color=False)[0]
    # Narrower still, both go, and the line names both.
    narrow = top.render_table(entries, 60, use_color=False)
    assert narrow[-1].startswith("(ENGINE, TOKEN/HB hidden: widen to "), narrow


# ----------------------------------------------------------------------------------
# The conversation id
# ----------------------------------------------------------------------------------
def test_the_openai_sdks_conversation_header_is_on_the_span_and_in_the_access_log(fast_upstream, start_proxy,
                                                                                 tmp_path):
    proxy = start_proxy(fast_upstream().url, **_observed(tmp_path, **{
        "tracing.conversation_id_header": "X-Conversation-Id"}))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{proxy.port}/v1", api_key="x", max_retries=0, timeout=10)
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                            stream=True, extra_headers={"X-Conversation-Id": "thread-42",
                                                                        "X-Request-Id": "conv-1"})
    assert [c for c in stream]
    client.close()
    spans_path = tmp_path / "spans.jsonl"
    assert wait_until(lambda: any(s.kind == SERVER for s in spans_of(spans_path, "conv-1")), timeout=10)
    [server] = [s for s in spans_of(spans_path, "conv-1") if s.kind == SERVER]
    assert server.attributes[sc.GEN_AI_CONVERSATION_ID] == "thread-42"
    assert wait_until(lambda: access_lines(tmp_path / "access.log"), timeout=5)
    [logged] = access_lines(tmp_path / "access.log")
    assert logged["conversation_id"] == "thread-42" and logged["tokens"]["output_events"] >= 3


@pytest.mark.parametrize("configured", [True, False], ids=["configured", "not-configured"])
def test_a_conversation_id_in_flight_is_kept_to_its_first_256_characters(configured, scripted_upstream,
                                                                         start_proxy, tmp_path, caplog):
    upstream = PingingUpstream(before=(CONTENT,), after=(FINISH, DONE))
    header = {"tracing.conversation_id_header": "x-session-id"} if configured else {}
    proxy = start_proxy(scripted_upstream(upstream).url, **_observed(tmp_path, **header))
    client = RawClient(proxy.port)
    long_id = "s" * 250 + "é" * 10  # latin-1 on the wire, as the request id is read
    client.request("POST", "/v1/chat/completions",
                   headers=[("x-request-id", "conv-2"), ("X-Session-Id", long_id.encode("latin-1"))],
                   body=b'{"stream":true}')
    assert wait_until(lambda: stalled_with(proxy, "MSS"), timeout=5)
    entry = inflight_requests(proxy)[0]
    if configured:
        assert entry["conversation_id"] == long_id[:256]
        assert wait_until(lambda: stall_span(tmp_path / "spans.jsonl", "conv-2", "MSS"), timeout=10)
        attrs = stall_span(tmp_path / "spans.jsonl", "conv-2", "MSS").attributes
        assert attrs[sc.GEN_AI_CONVERSATION_ID] == long_id[:256]
    else:
        assert "conversation_id" not in entry
    upstream.release.set()
    assert client.response().complete
    client.close()


@pytest.mark.parametrize("lines,expected", [
    ([(b"X-Session-Id", b"  abc \t")], "abc"),
    ([(b"x-session-id", b""), (b"X-SESSION-ID", b"second")], "second"),  # an empty line is no id
    ([(b"X-Session-Idx", b"other")], ""),
    ([(b"X-Session-Id", b"a" * 300)], "a" * 256),
    # Named in Connection: hop-by-hop by the client's say, so neither forwarded nor read.
    ([(b"X-Session-Id", b"abc"), (b"Connection", b"x-session-id")], ""),
], ids=["stripped", "first-non-empty", "another-header", "cut-at-256", "hop-by-hop"])
def test_the_conversation_id_is_read_from_the_forwarded_headers(lines, expected):
    from traceproxy.proxy.headers import parse_request_headers

    parts = parse_request_headers([(b"Host", b"h"), *lines], conversation_id_name=b"x-session-id")
    assert parts.conversation_id == expected
