"""``traceproxy diagnose ID``: a request's timeline from the span file, or from Jaeger.

The span-file tests run real requests through a proxy with the file exporter,
stop it so the exporter flushes, and run the command in a subprocess. The Jaeger
test serves a Jaeger-shaped JSON from a tiny fake query API on loopback.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

import traceproxy
from traceproxy.app import ProxyServer
from traceproxy.config import default_settings
from traceproxy.diagnose import (RequestSpans, Span, file_spans, find_requests, jaeger_spans, request_lines, run,
                                 wall_clock)
from traceproxy.lifecycle.hooks import Fanout
from traceproxy.sim.fast import FastUpstream

from .support import RawClient, ScriptedUpstream, never_answers, wait_until

# Causally ordered marks: each cannot happen before the one before it. (The request body
# streams upstream while it arrives, so last_downstream_rx_byte has no fixed place.)
MARKS_IN_ORDER = ["first_downstream_rx_byte", "last_downstream_rx_header_byte", "pool_acquired",
                  "first_upstream_tx_byte", "last_upstream_tx_byte", "first_upstream_rx_byte",
                  "last_upstream_rx_header_byte", "first_upstream_rx_body_byte", "last_upstream_rx_byte",
                  "last_downstream_tx_byte"]
CHAT = json.dumps({"model": "m", "stream": True, "max_tokens": 4,
                   "messages": [{"role": "user", "content": "hi"}]}).encode()


SPANS_ENV = "TRACEPROXY_TRACING_FILE_PATH"  # the variable serve reads for [tracing] file_path
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(traceproxy.__file__)))


def diagnose(*args: str, cwd=None, spans_env: str | None = None) -> subprocess.CompletedProcess:
    """The command in a subprocess, from ``cwd``, with ``spans_env`` as the span-file variable (unset: None)."""
    env = {k: v for k, v in os.environ.items() if k != SPANS_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    if spans_env is not None:
        env[SPANS_ENV] = spans_env
    return subprocess.run([sys.executable, "-m", "traceproxy", "diagnose", *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd, env=env)



def _settings(upstream_url: str, spans, **overrides):
    return default_settings().replace(**{
        "listen": "127.0.0.1:0", "admin": "127.0.0.1:0", "upstream": upstream_url, "access_log.path": "",
        "tracing.exporter": "file", "tracing.file_path": str(spans), **overrides})


@pytest.fixture(scope="module")
def traced(loop_thread, tmp_path_factory):
    """Three streaming turns on one keep-alive connection, the third with a slow first token
    (a first-byte stall); then the proxy is stopped so every span is in the file."""
    spans = tmp_path_factory.mktemp("diagnose") / "spans.jsonl"
    up = loop_thread.run(FastUpstream().start())
    proxy = ProxyServer(_settings(up.url, spans, **{"stall.first_byte": 0.2}), Fanout([]))
    loop_thread.run(proxy.start())
    client = RawClient(proxy.port)
    responses = []
    for turn in range(3):
        headers = [("Content-Type", "application/json"), ("x-fake-ttft-ms", "600" if turn == 2 else "0")]
        responses.append(client.roundtrip("POST", "/v1/chat/completions", headers, CHAT))
    client.close()
    loop_thread.run(proxy.shutdown(grace=0))
    loop_thread.run(up.stop())
    assert all(r.status == 200 and r.complete for r in responses)
    yield spans, responses


def _trace_id(response) -> str:
    return response.headers["traceresponse"].split("-")[1]


def _timeline(out: str) -> list[tuple[float, str]]:
    """(ms from start, the mark's first word) per timeline row."""
    rows = []
    for line in out[out.index("timeline"):].splitlines()[2:]:
        fields = line.split()
        if len(fields) < 5 or not fields[0].startswith("+"):
            break
        rows.append((float(fields[0][1:]) * (1000 if fields[1] == "s" else 1), fields[4]))
    return rows


def _assert_marks_in_order(out: str) -> None:
    rows = _timeline(out)
    assert [t for t, _ in rows] == sorted(t for t, _ in rows), out
    names = [name for _, name in rows]
    assert set(MARKS_IN_ORDER) <= set(names) and "last_downstream_rx_byte" in names, out
    positions = [names.index(mark) for mark in MARKS_IN_ORDER]
    assert positions == sorted(positions), out


def test_by_trace_id(traced):
    spans, responses = traced
    second = responses[1]
    done = diagnose(_trace_id(second), "--spans", str(spans))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith(f"request {second.headers['x-request-id']}   trace {_trace_id(second)}")
    assert "POST /v1/chat/completions -> HTTP 200   outcome OK (ok), blame -" in out
    _assert_marks_in_order(out)
    assert "from start" in out and "gap" in out
    # the keep-alive ledger: the second request on the client connection, after an idle gap,
    # on the upstream connection the first request opened
    assert "request 2 on it, idle " in out
    assert re.search(r"upstream attempt 1: connection \d+ reused, idle [\d.]+ m?s, request 2 on it -> OK", out)
    assert "bytes: request body %d" % len(CHAT) in out
    assert "stalls: none" in out


def test_a_reader_that_leaves_early_ends_it_quietly_not_with_a_traceback(traced):
    """`traceproxy diagnose ID | head -1`: the pipe's reader is gone before it writes."""
    spans, responses = traced
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))}
    reader, writer = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "traceproxy", "diagnose", _trace_id(responses[1]), "--spans",
                             str(spans)], stdout=writer, stderr=subprocess.PIPE, text=True, env=env)
    os.close(writer)
    os.close(reader)  # long before the interpreter has started and written its first line
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (141, ""), err


def test_by_request_id_with_a_stall(traced):
    spans, responses = traced
    third = responses[2]
    done = diagnose(third.headers["x-request-id"], "--spans", str(spans))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"trace {_trace_id(third)}" in out
    assert "request 3 on it" in out
    # the fast upstream sends its headers at once and the first token 0.6 s later
    assert "stall FBS (streaming_response)" in out  # the stall event on the timeline
    # (whether "resolved after" is in the span depends on the watchdog noticing before the request ends)
    assert "FBS in streaming_response: detected after" in out and "blame engine; " in out
    _assert_marks_in_order(out)


def test_unknown_id_exits_1_and_a_missing_file_2(traced, tmp_path):
    spans, _ = traced
    done = diagnose("no-such-request", "--spans", str(spans))
    assert done.returncode == 1 and "no request" in done.stderr
    assert diagnose("0" * 31 + "1", "--spans", str(spans)).returncode == 1
    missing = diagnose("anything", "--spans", str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 2 and "no span file" in missing.stderr
    folder = diagnose("anything", "--spans", str(tmp_path))  # the folder, not the file in it
    assert folder.returncode == 2 and f"{tmp_path} (--spans) is a folder: give the span file in it" in folder.stderr


def test_run_from_another_folder_it_names_the_absolute_path_it_looked_in_and_how_to_point_it(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = diagnose("some-request", cwd=elsewhere)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    # serve writes traceproxy-data/spans.jsonl relative to its own folder: this one looked in its own
    assert f"no span file at {elsewhere / 'traceproxy-data' / 'spans.jsonl'} (the default" in done.stderr
    assert "--spans PATH" in done.stderr and f"{SPANS_ENV}=PATH" in done.stderr and "--jaeger URL" in done.stderr


def test_the_variable_serve_reads_points_it_at_the_file_and_a_miss_names_the_file(traced, tmp_path):
    spans, responses = traced
    wanted = responses[0].headers["x-request-id"]
    found = diagnose(wanted, cwd=tmp_path, spans_env=str(spans))
    assert found.returncode == 0 and f"request {wanted}" in found.stdout, found.stderr
    missed = diagnose("no-such-request", cwd=tmp_path, spans_env=str(spans))
    assert missed.returncode == 1
    assert f"no request with trace id or request id 'no-such-request' in {spans} (env {SPANS_ENV})" in missed.stderr
    assert "--spans PATH" in missed.stderr and "--jaeger URL" in missed.stderr
    # --spans wins over the variable; a relative one is taken from the current folder, and said so
    (tmp_path / "empty.jsonl").write_text("")
    relative = diagnose(wanted, "--spans", "empty.jsonl", cwd=tmp_path, spans_env=str(spans))
    assert relative.returncode == 1
    assert f"in {tmp_path / 'empty.jsonl'} (--spans empty.jsonl, from the current folder)" in relative.stderr
    blank = diagnose(wanted, "--spans", " ", cwd=tmp_path, spans_env=str(spans))
    assert blank.returncode == 2 and "--spans takes the span file's path" in blank.stderr


def test_lines_of_the_wrong_shape_are_skipped_not_a_traceback(traced, tmp_path):
    spans, responses = traced
    wanted = responses[0].headers["x-request-id"]
    mixed = tmp_path / "mixed.jsonl"
    foreign = [json.dumps({"resourceSpans": wanted}), json.dumps(
        {"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": 5, "name": wanted}]}]}]}), json.dumps([wanted])]
    mixed.write_text("\n".join(foreign) + "\n" + spans.read_text())
    done = diagnose(wanted, "--spans", str(mixed))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    # What was skipped is said under the report: the request may have been in it.
    assert done.stdout.splitlines()[-1].startswith(f"2 lines and 1 span naming {wanted!r} or its trace could not be "
                                                   "read"), done.stdout
    only_foreign = tmp_path / "foreign.jsonl"
    only_foreign.write_text("\n".join(foreign) + "\n")
    done = diagnose(wanted, "--spans", str(only_foreign))
    assert done.returncode == 1 and "no request" in done.stderr and "Traceback" not in done.stderr
    # A span document whose span cannot be read is a span file all the same: no question whether it is one.
    assert "is it the span file?" not in done.stderr and "\n  2 lines and 1 span naming it could not be read" \
        in done.stderr, done.stderr


def test_a_request_still_hung_shows_its_stall_span(loop_thread, tmp_path):
    async def never_answer(reader, writer, upstream):
        await reader.read_request()
        await asyncio.wait_for(reader.read(), 10)  # silent until the proxy closes the connection

    spans = tmp_path / "spans.jsonl"
    up = loop_thread.run(ScriptedUpstream(never_answer).start())
    proxy = ProxyServer(_settings(up.url, spans, **{"stall.first_byte": 0.2}), Fanout([]))
    loop_thread.run(proxy.start())
    client = RawClient(proxy.port)
    try:
        client.request("POST", "/v1/chat/completions", [("Content-Type", "application/json"),
                                                        ("x-request-id", "hung-turn-7")], CHAT)
        assert wait_until(lambda: spans.exists() and "hung-turn-7" in spans.read_text(), timeout=10)
        out, err = io.StringIO(), io.StringIO()
        assert run("hung-turn-7", str(spans), out=out, err=err) == 0, err.getvalue()
        text = out.getvalue()
        assert "not finished when the spans were written" in text
        assert "FBS (first_byte_stall) in awaiting_upstream_headers" in text and "blame engine" in text
        assert re.search(r"client connection \d+, request 1 on it", text)
    finally:
        client.close()
        loop_thread.run(proxy.shutdown(grace=0))
        loop_thread.run(up.stop())


def _timeline_start(text: str) -> float:
    """The wall-clock start on the timeline's heading, as a unix time."""
    stamp = re.search(r"timeline \((?:start |from its first stall's wait, )([\d-]+ [\d:.]+) UTC", text).group(1)
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()


def test_a_request_still_hung_shows_when_it_began_not_when_its_wait_did(loop_thread, tmp_path):
    # The body comes 0.3 s after the head, then the engine never answers: the stall's
    # wait (FBS) begins with the body, and is detected 0.2 s later. The request began
    # with its head.
    spans = tmp_path / "spans.jsonl"
    up = loop_thread.run(ScriptedUpstream(never_answers).start())
    proxy = ProxyServer(_settings(up.url, spans, **{"stall.first_byte": 0.2, "stall.client_body": 5}), Fanout([]))
    loop_thread.run(proxy.start())
    client = RawClient(proxy.port)
    try:
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: test.local\r\nContent-Type: application/json\r\n"
                b"x-request-id: hung-turn-8\r\nContent-Length: %d\r\n\r\n" % len(CHAT))
        before_head = time.time()
        client.sock.sendall(head)
        time.sleep(0.3)
        before_body = time.time()
        client.sock.sendall(CHAT)
        assert wait_until(lambda: spans.exists() and "hung-turn-8" in spans.read_text(), timeout=10)
        out, err = io.StringIO(), io.StringIO()
        assert run("hung-turn-8", str(spans), out=out, err=err) == 0, err.getvalue()
        text = out.getvalue()
        assert "not finished when the spans were written" in text and "still in flight" in text, text
        # 5 ms: the proxy's wall clock is its monotonic one plus an offset read at its start
        assert before_head - 0.005 <= _timeline_start(text) < before_body, text
        rows = _timeline(text)
        assert rows[0] == (0.0, "first_downstream_rx_byte"), text
    finally:
        client.close()
        loop_thread.run(proxy.shutdown(grace=0))
        loop_thread.run(up.stop())


def _in_flight(stall_start_ns: int, detected_ns: int, **attributes) -> RequestSpans:
    stall = Span(TRACE, "5" * 16, SERVER, "stall FBS awaiting_upstream_headers", "internal", stall_start_ns,
                 detected_ns, {"traceproxy.request_id": "r", "traceproxy.stall.outcome": "FBS",
                               "traceproxy.stall.phase": "awaiting_upstream_headers", "traceproxy.blame": "engine",
                               "traceproxy.stall.waited_s": (detected_ns - stall_start_ns) / 1e9, **attributes})
    [found] = find_requests([stall], "r")
    return found


def test_a_request_in_flight_starts_at_its_first_byte_as_its_stall_span_dates_it():
    s = 1_000_000_000
    found = _in_flight(T0 * 1000 + 3 * s, T0 * 1000 + 5 * s, **{"traceproxy.stall.request_age_s": 4.5})
    text = "\n".join(request_lines(found))
    assert found.start_ns == T0 * 1000 + s // 2
    assert f"timeline (start {wall_clock(T0 * 1000 + s // 2)}, still in flight 4.500 s later):" in text, text
    assert _timeline(text) == [(0.0, "first_downstream_rx_byte"), (2500.0, "stall"), (4500.0, "stall")], text
    assert "+2.500 s  stall FBS wait began (awaiting_upstream_headers)   [stall span]" in text
    assert "+2.000 s  stall detected: FBS   [stall span]" in text  # the gap from the row above


def test_a_request_in_flight_without_its_age_starts_where_its_stall_wait_did_and_says_so():
    s = 1_000_000_000
    found = _in_flight(T0 * 1000 + 3 * s, T0 * 1000 + 5 * s)
    text = "\n".join(request_lines(found))
    assert (f"timeline (from its first stall's wait, {wall_clock(T0 * 1000 + 3 * s)}: its stall spans do not say "
            "when the request began):") in text, text
    assert _timeline(text) == [(0.0, "stall"), (2000.0, "stall")], text
    assert "first_downstream_rx_byte" not in text


# ----------------------------------------------------------------------------------
# Jaeger
# ----------------------------------------------------------------------------------
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SERVER, FIRST, RESEND, ENGINE = "00f067aa0ba902b7", "1111111111111111", "2222222222222222", "3333333333333333"
T0 = 1_700_000_000_000_000  # µs


def _tag(key, value):
    kind = "bool" if isinstance(value, bool) else "int64" if isinstance(value, int) else \
        "float64" if isinstance(value, float) else "string"
    return {"key": key, "type": kind, "value": value}


def _log(offset_us, event, **fields):
    return {"timestamp": T0 + offset_us, "fields": [_tag("event", event)] + [_tag(k, v) for k, v in fields.items()]}


def _span(span_id, parent, name, start, duration, tags, logs=(), process="p1"):
    refs = [{"refType": "CHILD_OF", "traceID": TRACE, "spanID": parent}] if parent else []
    return {"traceID": TRACE, "spanID": span_id, "references": refs, "operationName": name, "startTime": T0 + start,
            "duration": duration, "tags": [_tag(k, v) for k, v in tags.items()], "logs": list(logs),
            "processID": process}


JAEGER_TRACE = {"data": [{"traceID": TRACE, "processes": {"p1": {"serviceName": "traceproxy"},
                                                          "p2": {"serviceName": "sglang-decode"}}, "spans": [
    _span(SERVER, "", "POST /v1/chat/completions", 0, 2_000_000, {
        "span.kind": "server", "traceproxy.request_id": "req-42", "traceproxy.outcome": "OK",
        "traceproxy.outcome.name": "ok", "traceproxy.blame": "-", "http.response.status_code": 200,
        "traceproxy.client.connection.id": 9, "traceproxy.client.connection.request_sequence": 4,
        "traceproxy.client.connection.idle_gap_s": 6.5, "http.request.body.size": 321,
        "http.response.body.size": 4096,
        # Jaeger keeps an OTLP string array as the JSON text of the array
        "gen_ai.response.finish_reasons": '["stop","length"]'}, [
        _log(0, "first_downstream_rx_byte"), _log(100, "last_downstream_rx_header_byte"),
        _log(150, "last_downstream_rx_byte"), _log(1_200_000, "first_downstream_tx_byte"),
        _log(800_000, "stall", **{"traceproxy.stall.outcome": "FBS", "traceproxy.stall.phase":
                                  "awaiting_upstream_headers", "traceproxy.blame": "engine",
                                  "traceproxy.stall.waited_s": 0.5}),
        _log(1_200_000, "stall_resolved", **{"traceproxy.stall.outcome": "FBS", "traceproxy.stall.duration_s": 0.9}),
        _log(2_000_000, "last_downstream_tx_byte")]),
    _span(FIRST, SERVER, "POST /v1/chat/completions", 200, 100, {
        "span.kind": "client", "traceproxy.upstream.connection.id": 3, "traceproxy.upstream.connection.reused": True,
        "traceproxy.upstream.connection.idle_age_s": 4.2, "traceproxy.upstream.connection.request_number": 7,
        "traceproxy.outcome": "UC", "otel.status_code": "ERROR", "otel.status_description": "stale connection"},
        [_log(200, "pool_acquired"), _log(250, "first_upstream_tx_byte")]),
    _span(RESEND, SERVER, "POST /v1/chat/completions", 300, 1_700_000, {
        "span.kind": "client", "http.request.resend_count": 1, "traceproxy.upstream.connection.id": 4,
        "traceproxy.upstream.connection.reused": False, "traceproxy.upstream.connection.request_number": 1,
        "traceproxy.outcome": "OK"},
        [_log(300, "pool_acquired"), _log(1_150_000, "last_upstream_rx_header_byte"),
         _log(1_900_000, "last_upstream_rx_byte")]),
    _span(ENGINE, RESEND, "decode", 400, 1_500_000, {"span.kind": "server"}, process="p2"),
]}]}


class FakeJaeger(BaseHTTPRequestHandler):
    queries: list[dict] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        parts = urlsplit(self.path)
        if parts.path == f"/api/traces/{TRACE}":
            self._json(200, JAEGER_TRACE)
        elif parts.path == "/api/traces":
            query = parse_qs(parts.query)
            FakeJaeger.queries.append(query)
            tags = json.loads(query["tags"][0])
            found = query["service"] == ["traceproxy"] and tags == {"traceproxy.request_id": "req-42"}
            self._json(200, JAEGER_TRACE if found else {"data": []})
        else:
            self._json(404, {"data": None, "errors": [{"code": 404, "msg": "trace not found"}]})

    def _json(self, status, document):
        body = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def jaeger():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeJaeger)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)


def _jaeger_run(url: str, ident: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run(ident, jaeger=url, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_jaeger_by_trace_id_maps_to_the_same_timeline(jaeger):
    code, out, err = _jaeger_run(jaeger, TRACE)
    assert code == 0, err
    assert out.startswith(f"request req-42   trace {TRACE}")
    assert "outcome OK (ok), blame -" in out
    assert "client connection 9, request 4 on it, idle 6.500 s before it" in out
    assert "upstream attempt 1: connection 3 reused, idle 4.200 s, request 7 on it -> UC (stale connection)" in out
    assert "upstream attempt 2 (resend 1): connection 4 new, request 1 on it -> OK" in out
    assert "FBS in awaiting_upstream_headers: detected after 500.000 ms, blame engine; resolved after 900.000 ms" \
        in out
    assert "sglang-decode: decode, 1.500 s" in out
    assert "genai: finish stop, length" in out
    rows = _timeline(out)
    assert [name for _, name in rows] == [
        "first_downstream_rx_byte", "last_downstream_rx_header_byte", "last_downstream_rx_byte", "pool_acquired",
        "first_upstream_tx_byte", "pool_acquired", "stall", "last_upstream_rx_header_byte",
        "first_downstream_tx_byte", "stall", "last_upstream_rx_byte", "last_downstream_tx_byte"]
    assert [t for t, _ in rows][-3:] == [1200.0, 1900.0, 2000.0]  # µs from Jaeger, ms from the start
    assert "+800.000 ms" in out and "+1.150 s" in out and "+799.700 ms" in out  # from start, gap
    assert "[attempt 2 (resend 1)]" in out
    # The wait for the response head, cut in two by the stall detected part way through it:
    # its first part, up to the detection, is the longest stretch with nothing seen.
    assert out.count("<- longest wait") == 1
    assert "+800.000 ms    +799.700 ms  stall FBS (awaiting_upstream_headers)   <- longest wait" in out


def test_jaeger_by_request_id_searches_the_tag(jaeger):
    FakeJaeger.queries.clear()
    code, out, _ = _jaeger_run(jaeger, "req-42")
    assert code == 0 and f"trace {TRACE}" in out
    [query] = FakeJaeger.queries
    assert query["service"] == ["traceproxy"] and "start" in query and "end" in query


def test_jaeger_not_found_and_unreachable(jaeger):
    code, _, err = _jaeger_run(jaeger, "req-nope")
    assert code == 1 and "no request" in err
    code, _, _ = _jaeger_run(jaeger, "f" * 32)  # 404 on the trace, nothing on the tag search
    assert code == 1
    code, _, err = _jaeger_run("http://127.0.0.1:9", "req-42")
    assert code == 2 and "cannot reach Jaeger" in err
    for not_a_url in ("notaurl", "http://[::1", "http://127.0.0.1:abc", "http://a b:1", "http://127.0.0.1:1/ x"):
        code, _, err = _jaeger_run(not_a_url, "req-42")
        assert code == 2 and "http(s) URL" in err and "Traceback" not in err, (not_a_url, err)


def test_each_stall_shows_its_own_resolution_and_the_last_open_one_is_the_hang():
    from traceproxy.diagnose import Event, Span, _stalls_from_events

    def stall(at, code="MSS"):
        return Event("stall", at, {"traceproxy.stall.outcome": code, "traceproxy.stall.phase": "streaming_response",
                                   "traceproxy.stall.waited_s": 0.5, "traceproxy.blame": "engine"})

    def resolved(at, duration, code="MSS"):
        return Event("stall_resolved", at, {"traceproxy.stall.outcome": code, "traceproxy.stall.duration_s": duration})

    server = Span(TRACE, SERVER, "", "GET /sse", "server", 0, 10, {"traceproxy.outcome": "DC"},
                  [stall(1), resolved(2, 0.801), stall(3), resolved(4, 0.9), stall(5)])
    lines = _stalls_from_events(server)
    assert len(lines) == 3
    assert "resolved after 801" in lines[0] and "resolved after 900" in lines[1]
    assert lines[2].endswith("not resolved (the request ended stalled)")


def test_jaeger_spans_mapping():
    spans = {s.span_id: s for s in jaeger_spans(JAEGER_TRACE)}
    server = spans[SERVER]
    assert (server.kind, server.service, server.start_ns, server.end_ns) == (
        "server", "traceproxy", T0 * 1000, (T0 + 2_000_000) * 1000)
    assert server.attributes["traceproxy.client.connection.id"] == 9
    assert spans[FIRST].status == "error" and spans[FIRST].status_message == "stale connection"
    assert spans[RESEND].parent_id == SERVER
    [found] = find_requests(list(spans.values()), "req-42")
    assert [a.span_id for a in found.attempts] == [FIRST, RESEND]
    assert [s.span_id for s in found.downstream] == [ENGINE]


def test_a_client_that_left_a_stalled_request_points_at_the_stall():
    from traceproxy.diagnose import Event, Span, _outcome_lines

    stall = {"traceproxy.stall.outcome": "FBS", "traceproxy.stall.phase": "awaiting_upstream_headers",
             "traceproxy.blame": "engine"}
    server = Span(TRACE, SERVER, "", "POST /v1/chat/completions", "server", 0, 10,
                  {"traceproxy.outcome": "DC", "traceproxy.outcome.name": "client disconnected",
                   "traceproxy.blame": "client"},
                  [Event("stall", 5, stall)])
    text = "\n".join(_outcome_lines(server))
    assert "outcome DC" in text and "stalled: FBS in awaiting_upstream_headers, blame engine" in text
    server.events.append(Event("stall_resolved", 8, {"traceproxy.stall.outcome": "FBS"}))
    assert "stalled" not in "\n".join(_outcome_lines(server))  # it had resolved: no hang to point at


def test_a_request_found_by_either_of_its_ids_has_its_server_and_stall_spans():
    # Stalled mid-head, the request was given an id for its stall span; its head then
    # brought the client's own, which its SERVER span carries.
    from traceproxy.diagnose import Span

    server = Span(TRACE, SERVER, "", "POST /v1/chat/completions", "server", 0, 10,
                  {"traceproxy.request_id": "client-id", "traceproxy.outcome": "OK"}, [])
    stall = Span(TRACE, "5" * 16, SERVER, "stall DHS", "internal", 2, 3,
                 {"traceproxy.request_id": "generated-id", "traceproxy.stall.outcome": "DHS"}, [])
    for ident in ("generated-id", "client-id"):
        [found] = find_requests([server, stall], ident)
        assert found.server is server and found.stalls == [stall], ident


def test_each_gap_runs_from_the_row_above_and_the_longest_wait_is_the_longest_gap():
    from traceproxy.diagnose import Event, Span, _timeline_lines

    ms = 1_000_000

    def stall(at, code, phase):
        return Event("stall", at, {"traceproxy.stall.outcome": code, "traceproxy.stall.phase": phase})

    # 2.45 s waiting for a pooled connection (the proxy), then 2.8 s for the first
    # byte (the engine); each wait has a stall event part way through it, which is a row
    # of its own: the gaps add up to the time from the start.
    events = [Event("first_downstream_rx_byte", 0, {}), Event("pool_queued", 0, {}),
              stall(500 * ms, "PWS", "awaiting_upstream_connection"), Event("pool_acquired", 2450 * ms, {}),
              stall(3950 * ms, "FBS", "awaiting_upstream_headers"), Event("first_upstream_rx_byte", 5250 * ms, {})]
    server = Span(TRACE, SERVER, "", "POST /v1/chat/completions", "server", 0, 5300 * ms,
                  {"traceproxy.request_id": "r", "traceproxy.outcome": "OK"}, events)
    found = find_requests([server], "r")[0]
    rows = [line.split() for line in _timeline_lines(found)[2:]]
    assert [" ".join(row[2:4]) for row in rows] == ["+0.000 ms", "+0.000 ms", "+500.000 ms", "+1.950 s",
                                                    "+1.500 s", "+1.300 s"], rows
    [marked] = [line for line in _timeline_lines(found) if "<- longest wait" in line]
    assert "pool_acquired" in marked and "+1.950 s" in marked, marked


def test_an_attempt_whose_connect_failed_shows_no_connection():
    from traceproxy.diagnose import Span, _attempt_lines

    failed = Span("t", "a1", "s", "POST /v1/chat/completions", "client", 0, 1,
                  attributes={"traceproxy.outcome": "UF"}, status="error", status_message="connect refused")
    assert _attempt_lines(failed) == ["  upstream attempt 1: no connection -> UF (connect refused)"]


def test_a_route_the_span_name_leaves_out_is_still_shown_by_its_path():
    from traceproxy.diagnose import Span, _outcome_lines

    server = Span("t", "s", "", "GET", "server", 0, 1, attributes={
        "http.request.method": "GET", "url.path": "/internal/flush_cache", "http.response.status_code": 200,
        "traceproxy.outcome": "OK", "traceproxy.outcome.name": "ok", "traceproxy.blame": "-"})
    assert _outcome_lines(server)[0].startswith("  GET /internal/flush_cache -> HTTP 200   outcome OK")


# ----------------------------------------------------------------------------------
# Spans below the proxy, and the join key
# ----------------------------------------------------------------------------------
def _otlp_line(service: str, *spans: dict) -> str:
    return json.dumps({"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": service}}]},
        "scopeSpans": [{"spans": list(spans)}]}]})


def _otlp_span(span_id: str, parent: str, name: str, kind: int, start_ms: int, end_ms: int, **attributes) -> dict:
    return {"traceId": TRACE, "spanId": span_id, "parentSpanId": parent, "name": name, "kind": kind,
            "startTimeUnixNano": str(T0 * 1000 + start_ms * 1_000_000),
            "endTimeUnixNano": str(T0 * 1000 + end_ms * 1_000_000),
            "attributes": [{"key": k, "value": {"stringValue": v}} for k, v in attributes.items()]}


def test_spans_below_the_proxy_are_found_at_any_depth_under_a_router_span(tmp_path):
    # smg with --enable-trace: its INTERNAL http_request span is the child of the proxy's
    # CLIENT span, and the engines' spans are children of smg's (and have their own).
    client_root, smg, prefill, decode, decode_step = ("c" * 16, "5" * 16, "6" * 16, "7" * 16, "8" * 16)
    spans = tmp_path / "spans.jsonl"
    spans.write_text("\n".join([
        _otlp_line("harness", _otlp_span(client_root, "", "agent turn", 1, 0, 900)),
        _otlp_line("traceproxy",
                   _otlp_span(SERVER, client_root, "POST /v1/chat/completions", 2, 1, 800,
                              **{"traceproxy.request_id": "req-smg", "traceproxy.outcome": "OK"}),
                   _otlp_span(FIRST, SERVER, "POST /v1/chat/completions", 3, 2, 790)),
        _otlp_line("smg", _otlp_span(smg, FIRST, "http_request", 1, 3, 780)),
        _otlp_line("sglang-prefill", _otlp_span(prefill, smg, "prefill", 2, 4, 100)),
        _otlp_line("sglang-decode", _otlp_span(decode, smg, "decode", 2, 5, 770),
                   _otlp_span(decode_step, decode, "generate", 1, 110, 760)),
    ]) + "\n")
    out, err = io.StringIO(), io.StringIO()
    assert run("req-smg", str(spans), out=out, err=err) == 0, err.getvalue()
    text = out.getvalue()
    below = [line for line in text[text.index("spans below the proxy"):].splitlines()[1:]
             if line.startswith("    ")]
    # Each under its parent, one level deeper; the client's own span above the proxy is not below it.
    assert below == ["    smg: http_request, 777.000 ms",
                     "      sglang-prefill: prefill, 96.000 ms",
                     "      sglang-decode: decode, 765.000 ms",
                     "        sglang-decode: generate, 650.000 ms"], text
    [found] = find_requests(file_spans(spans, "req-smg"), "req-smg")
    assert [s.span_id for s in found.downstream] == [smg, prefill, decode, decode_step]


def test_spans_whose_parents_loop_are_each_listed_once():
    a, b = "a" * 16, "b" * 16
    server = Span(TRACE, SERVER, "", "POST /generate", "server", 0, 10, {"traceproxy.request_id": "r"})
    attempt = Span(TRACE, FIRST, SERVER, "POST /generate", "client", 1, 9)
    # a under the attempt, b under a; a second record of a says its parent is b (a broken exporter).
    looped = [Span(TRACE, a, FIRST, "x", "internal", 2, 8), Span(TRACE, b, a, "y", "internal", 3, 7),
              Span(TRACE, a, b, "x", "internal", 2, 8)]
    [found] = find_requests([server, attempt, *looped], "r")
    assert [s.span_id for s in found.downstream] == [a, b]


def test_the_trace_id_is_named_as_the_key_to_the_engines_logs():
    server = Span(TRACE, SERVER, "", "POST /v1/chat/completions", "server", 0, 10,
                  {"traceproxy.request_id": "req-7", "traceproxy.outcome": "OK"})
    [found] = find_requests([server], "req-7")
    text = "\n".join(request_lines(found))
    [line] = [line for line in text.splitlines() if "engine logs" in line]
    assert TRACE in line and "vllm-router" in line and "x-request-id" in line, line


# ----------------------------------------------------------------------------------
# The engines' own stage spans (SGLang --enable-trace), merged into the timeline
# ----------------------------------------------------------------------------------
def _send_spans(proxy, spans) -> None:
    """As an engine's OTLP/HTTP exporter: one keep-alive connection to the proxy's receiver."""
    from .sglang_spans import payload

    connection = _send_spans.connections.setdefault(
        proxy.engine_side.receiver.http_port,
        __import__("http.client").client.HTTPConnection("127.0.0.1", proxy.engine_side.receiver.http_port, timeout=5))
    connection.request("POST", "/v1/traces", payload(spans), {"Content-Type": "application/x-protobuf"})
    answer = connection.getresponse()
    answer.read()
    assert answer.status == 200


_send_spans.connections = {}


def test_a_hung_request_shows_the_engine_stages_that_ended_and_the_one_it_is_in(loop_thread, tmp_path):
    from .sglang_spans import Request

    spans = tmp_path / "spans.jsonl"
    up = loop_thread.run(ScriptedUpstream(never_answers).start())
    proxy = ProxyServer(_settings(up.url, spans, **{"stall.first_byte": 1.5,
                                                    "engines.otlp_receiver": "127.0.0.1:0"}), Fanout([]))
    loop_thread.run(proxy.start())
    client = RawClient(proxy.port)
    try:
        client.request("POST", "/v1/chat/completions", [("Content-Type", "application/json"),
                                                        ("x-request-id", "hung-in-kv")], CHAT)
        assert wait_until(lambda: up.received and b"traceparent" in bytes(up.received[-1]))
        trace_id = int(re.search(rb"traceparent: 00-([0-9a-f]{32})", bytes(up.received[-1])).group(1), 16)
        done = Request(trace_id + 1, "prefill", pid=314)  # a request that finished taught the worker
        _send_spans(proxy, done.stages(5) + done.finish())
        _send_spans(proxy, Request(trace_id, "prefill").stages(4) + Request(trace_id, "decode").stages(2))
        assert wait_until(lambda: spans.exists() and "stall FBS" in spans.read_text(), timeout=10)
        out, err = io.StringIO(), io.StringIO()
        assert run("hung-in-kv", str(spans), out=out, err=err) == 0, err.getvalue()
        text = out.getvalue()
        # Its own spans do not name the worker yet (its thread span ends with the request); the
        # stall span does, as the live join learned it from the worker's finished requests.
        assert ("engines: when these spans were written the request was in kv_transfer (prefill "
                "prefill_transfer_kv_cache, sglang; from spans)") in text, text
        for name in ("prefill_prepare", "prefill_bootstrap", "prefill_waiting", "prefill_forward"):
            assert f"{name} ended   [engine prefill, sglang]" in text, text
        assert "decode_bootstrap ended   [engine decode, sglang]" in text
        assert "blame engine (kv_transfer: prefill prefill_transfer_kv_cache, sglang pid 314; from spans) at" in text
    finally:
        client.close()
        loop_thread.run(proxy.shutdown(grace=0))
        loop_thread.run(up.stop())


def test_engine_stages_from_jaeger_join_the_timeline_each_a_row_with_its_gap():
    # The decode worker's stages as Jaeger keeps them, under its thread span, under the resend.
    thread = "4444444444444444"
    engine = [
        _span(thread, ENGINE, "Decode Scheduler [TP 0] (host:01234567 | pid:77)", 400, 1_500_000,
              {"span.kind": "internal", "thread_label": "Decode Scheduler", "host_id": "0123456789", "pid": 77},
              process="p2"),
        *[_span(f"55555555555555{n:02d}", thread, name, 400 + n * 10, 100_000 + n * 200_000, {}, process="p2")
          for n, name in enumerate(("decode_prepare", "decode_bootstrap", "decode_transferred", "decode_waiting",
                                    "decode_forward"))],
    ]
    document = {"data": [{**JAEGER_TRACE["data"][0], "spans": JAEGER_TRACE["data"][0]["spans"] + engine}]}
    [found] = find_requests(jaeger_spans(document), "req-42")
    text = "\n".join(request_lines(found))
    assert ("engines: every worker finished; the last stage that ended: decode (decode decode_forward ended, "
            "sglang-decode host 01234567 pid 77; from spans)") in text, text
    assert "decode_transferred ended   [engine decode, sglang-decode]" in text
    # An engine stage's end is a row like a mark: the next row's gap runs from it.
    rows = [line for line in text.splitlines() if line.startswith("    ") and line.split()[0].startswith("+")]
    after = rows.index(next(r for r in rows if "decode_transferred ended" in r)) + 1
    assert "decode_waiting ended" in rows[after] and "+200.010 ms  decode_waiting" in rows[after], rows
    assert text.count("<- longest wait") == 1


def test_without_engine_spans_the_report_is_unchanged(traced):
    spans, responses = traced
    out, err = io.StringIO(), io.StringIO()
    assert run(_trace_id(responses[0]), str(spans), out=out, err=err) == 0
    assert "engines:" not in out.getvalue() and "[engine " not in out.getvalue()
