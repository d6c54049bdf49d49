"""``traceproxy repro``: the harness that hangs, made to say where.

Live tests run the harness against a real proxy (in front of the fast upstream,
an upstream that never answers the second request on a connection, one that goes
silent mid-stream) and against a "faulty proxy" that accepts and never answers.
The formatting and the in-flight lookup are pure and tested as such.
"""

from __future__ import annotations

import ast
import asyncio
import json
import shlex
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from traceproxy.cli import main
from traceproxy.repro import ReproResult, TargetUnreachable, TurnRecord, UsageError, run_repro
from traceproxy.repro.harness import FAILED, HUNG, OK, Conversation, Numbering, Plan, parse_stream, trace_id_of
from traceproxy.repro.inflight import IN_FLIGHT, LEFT_PROXY, NOT_REACHED, UNKNOWN, Diagnosis, locate
from traceproxy.repro.report import (INDENT, NOT_REACHED_TEXT, failed_lines, hung_lines, result_document,
                                     summary_lines, verdict_key, verdict_text)

from .support import wait_until

REPRO = Path(__file__).resolve().parents[1] / "traceproxy" / "repro"


def _sse_response(text: str = "hi") -> bytes:
    chunk = json.dumps({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})
    body = f"data: {chunk}\n\ndata: [DONE]\n\n".encode()
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%s"
            % (len(body), body))


async def answer_first_then_hang(reader, writer, upstream) -> None:
    """Answers the first request on each upstream connection; the second one never."""
    await reader.read_request()
    writer.write(_sse_response())
    await writer.drain()
    await reader.read_request()
    await asyncio.wait_for(reader.read(), 10)  # silent until the proxy closes the connection


async def stall_mid_stream(reader, writer, upstream) -> None:
    """Starts a chunked SSE response, sends one event, then goes silent."""
    await reader.read_request()
    event = b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "x"}}]}).encode() + b"\n\n"
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                 + b"%x\r\n%s\r\n" % (len(event), event))
    await writer.drain()
    await asyncio.wait_for(reader.read(), 10)


class BlackHole:
    """A "faulty proxy": accepts TCP connections and never answers (bounded in time and count)."""

    def __init__(self, lifetime: float = 30.0, max_connections: int = 64) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._deadline = time.monotonic() + lifetime
        self._max = max_connections
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self._deadline and len(self.accepted) < self._max:
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            self.accepted.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for conn in self.accepted:
            conn.close()
        self.sock.close()


@pytest.fixture
def black_hole():
    hole = BlackHole()
    yield hole
    hole.close()


# ----------------------------------------------------------------------------------
# Live
# ----------------------------------------------------------------------------------
def test_all_turns_ok_in_both_modes(start_proxy, fast_upstream, capsys):
    proxy = start_proxy(fast_upstream().url)
    url, admin = f"http://127.0.0.1:{proxy.port}", f"127.0.0.1:{proxy.admin_port}"

    code = main(["repro", "--url", url, "--admin", admin, "--conversations", "2", "--turns", "3",
                 "--turn-timeout", "5", "--mode", "both"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "all 12 turns ok" in out
    assert "HUNG" not in out and "FAIL" not in out

    result = run_repro(url, admin, conversations=2, turns=3, turn_timeout=5.0, mode="both")
    assert result.exit_code == 0 and len(result.records) == 12
    for mode in ("reused", "fresh"):
        for conversation in (1, 2):
            turns = sorted((r for r in result.records if r.mode == mode and r.conversation == conversation),
                           key=lambda r: r.turn)
            assert [r.turn for r in turns] == [1, 2, 3]
            assert [r.context_messages for r in turns] == [2, 4, 6]  # the context grows
            assert all(r.echoed_request_id == r.request_id and len(r.trace_id) == 32 for r in turns)
            assert all(r.done_seen and r.status == 200 for r in turns)
            if mode == "reused":
                assert len({r.connection for r in turns}) == 1
                assert [r.connection_use for r in turns] == [1, 2, 3]
            else:
                assert len({r.connection for r in turns}) == 3
                assert [r.connection_use for r in turns] == [1, 1, 1]


def test_hang_behind_the_proxy_is_an_engine_first_byte_stall(start_proxy, scripted_upstream):
    upstream = scripted_upstream(answer_first_then_hang)
    proxy = start_proxy(upstream.url, **{"stall.first_byte": 0.3})

    result = run_repro(f"http://127.0.0.1:{proxy.port}", f"127.0.0.1:{proxy.admin_port}",
                       conversations=2, turns=3, turn_timeout=1.5, mode="both")

    assert result.exit_code == 1
    assert result.hung and not result.failed
    for record in result.hung:
        found = record.diagnosis
        assert found.kind == IN_FLIGHT
        assert (found.phase, found.outcome, found.blame, found.stalled) == (
            "awaiting_upstream_headers", "FBS", "engine", True)
        assert found.waiting_for_s >= 1.0
        assert found.upstream_reused is True
        assert len(found.trace_id) == 32  # known from the proxy although no response head came back
        assert record.status is None and record.trace_id is None
        text = "\n".join(hung_lines(record))
        assert "stuck in phase awaiting_upstream_headers, waiting" in text
        assert "blame engine (outcome FBS)" in text
        assert f"request id {record.request_id}" in text
        assert f"use {record.connection_use} of it" in text
    # A conversation stops at its hung turn; the summary says how many never ran.
    summary = "\n".join(summary_lines(result))
    assert "hung: stuck in phase awaiting_upstream_headers, blame engine (outcome FBS)" in summary
    assert "not run" in summary


def test_a_hung_turns_diagnose_hint_names_the_proxys_span_file_and_works_from_any_folder(
        start_proxy, scripted_upstream, tmp_path, monkeypatch, capsys):
    upstream = scripted_upstream(answer_first_then_hang)
    span_file = tmp_path / "proxy side" / "spans.jsonl"  # a space: the hint must quote it
    proxy = start_proxy(upstream.url, **{"stall.first_byte": 0.3, "tracing.exporter": "file",
                                         "tracing.file_path": str(span_file)})

    result = run_repro(f"http://127.0.0.1:{proxy.port}", f"127.0.0.1:{proxy.admin_port}",
                       conversations=1, turns=2, turn_timeout=1.5, mode="reused")

    [record] = result.hung
    hint = next(line for line in hung_lines(record) if "next:" in line).split("next:", 1)[1].strip()
    assert hint == f"traceproxy diagnose {record.request_id} --spans {shlex.quote(str(span_file))}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # not where the proxy was started
    capsys.readouterr()
    assert wait_until(lambda: main(shlex.split(hint)[1:]) == 0 and record.request_id in capsys.readouterr().out,
                      timeout=5)


def test_a_hung_turn_says_where_the_engines_have_it_when_the_proxy_knows():
    stage = {"component": "decode", "role": "decode", "stage": "decode_forward", "state": "open",
             "worker": {"service": "sglang", "host": "1a2b3c4d", "pid": 4242}, "since_s": 2.1, "source": "spans"}
    hung = TurnRecord("reused", 1, 2, "rid-1", connection=1, connection_use=2, result=HUNG,
                      diagnosis=locate([{**ENTRY, "engine_stage": stage}], "rid-1", answered=False))
    assert f"{INDENT}engine: decode decode_forward on sglang pid 4242 for 2.1 s (from spans)" in hung_lines(hung)
    by_gauges = {"component": "kv_transfer", "stage": "", "worker": None, "since_s": None, "source": "gauges"}
    hung.diagnosis = locate([{**ENTRY, "engine_stage": by_gauges}], "rid-1", answered=False)
    assert f"{INDENT}engine: kv_transfer (from gauges)" in hung_lines(hung)
    hung.diagnosis = locate([ENTRY], "rid-1", answered=False)  # no engine spans or gauges: no line
    assert not any("engine:" in line for line in hung_lines(hung))


def test_a_failed_turns_hint_names_the_span_file_too_and_without_one_has_no_spans_option():
    failed = TurnRecord("fresh", 1, 1, "rid-f", result=FAILED, status=502, trace_id="ab" * 16,
                        error="HTTP 502: upstream down", span_file="/var/lib/proxy data/spans.jsonl")
    assert f"{INDENT}next:  traceproxy diagnose {'ab' * 16} --spans '/var/lib/proxy data/spans.jsonl'" in \
        failed_lines(failed)
    hung = TurnRecord("reused", 1, 2, "rid-1", connection=1, connection_use=2, result=HUNG,
                      diagnosis=locate([ENTRY], "rid-1", answered=False))
    assert f"{INDENT}next:   traceproxy diagnose rid-1" in hung_lines(hung)


def test_hang_in_front_of_the_proxy_never_reached_it(start_proxy, fast_upstream, black_hole, capsys):
    proxy = start_proxy(fast_upstream().url)

    code = main(["repro", "--url", f"http://127.0.0.1:{black_hole.port}", "--admin",
                 f"127.0.0.1:{proxy.admin_port}", "--conversations", "1", "--turns", "2", "--turn-timeout", "1"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert out.count("HUNG  ") == 2  # turn 1 of each mode; each conversation stops there
    assert out.count(f"proxy:  {NOT_REACHED_TEXT}") == 2
    assert "trace id unknown (no response head)" in out
    assert "no response head (0 bytes back)" in out
    assert "2 turn(s) hung, 0 failed" in out


def test_mid_stream_silence_has_the_trace_id_and_an_engine_verdict(start_proxy, scripted_upstream):
    upstream = scripted_upstream(stall_mid_stream)
    proxy = start_proxy(upstream.url, **{"stall.stream_gap": 0.3})

    result = run_repro(f"http://127.0.0.1:{proxy.port}", f"127.0.0.1:{proxy.admin_port}",
                       conversations=1, turns=2, turn_timeout=1.0, mode="reused")

    [record] = result.records
    assert record.result == HUNG and record.status == 200 and record.events == 1
    assert len(record.trace_id) == 32 and record.trace_id == record.diagnosis.trace_id
    assert (record.diagnosis.phase, record.diagnosis.outcome, record.diagnosis.blame) == (
        "streaming_response", "MSS", "engine")
    text = "\n".join(hung_lines(record))
    assert "HTTP 200 head after" in text and "no end of stream" in text
    assert f"trace id {record.trace_id}" in text


def test_json_output(start_proxy, fast_upstream, capsys):
    proxy = start_proxy(fast_upstream().url)
    code = main(["repro", "--url", f"http://127.0.0.1:{proxy.port}", "-c", "1", "-r", "2", "--mode", "fresh",
                 "--json"])
    document = json.loads(capsys.readouterr().out)
    assert code == 0 and document["exit_code"] == 0
    assert document["summary"] == {"fresh": {"ok": 2, "hung": 0, "failed": 0}}
    assert [r["turn"] for r in document["records"]] == [1, 2]


def test_an_error_response_is_a_failed_turn(start_proxy, dead_upstream):
    proxy = start_proxy(dead_upstream)  # the upstream is down: 502 UF
    result = run_repro(f"http://127.0.0.1:{proxy.port}", None, conversations=1, turns=2, turn_timeout=5.0,
                       mode="reused")
    [record] = result.records
    assert record.result == FAILED and record.status == 502 and record.error.startswith("HTTP 502")
    assert len(record.trace_id) == 32
    assert result.exit_code == 1


def test_unreachable_target_and_usage_errors_exit_2(start_proxy, fast_upstream, capsys, dead_upstream):
    assert main(["repro", "--url", dead_upstream]) == 2
    assert "cannot connect" in capsys.readouterr().err

    proxy = start_proxy(fast_upstream().url)
    url = f"http://127.0.0.1:{proxy.port}"
    assert main(["repro", "--url", url, "--admin", dead_upstream.removeprefix("http://")]) == 2
    assert "admin listener" in capsys.readouterr().err
    assert main(["repro", "--url", url, "--admin", f"127.0.0.1:{proxy.port}"]) == 2  # not the admin port
    assert main(["repro", "--url", "https://127.0.0.1:1"]) == 2
    for bad in ("http://[::1", "http://[zz]:80", "http://127.0.0.1:0", "http://127.0.0.1:abc", "http://a b:1"):
        assert main(["repro", "--url", bad]) == 2, bad
    assert main(["repro", "--url", url, "--conversations", "0"]) == 2
    assert main(["repro", "--url", url, "--header", "no colon"]) == 2
    capsys.readouterr()
    # A run that never starts prints no plan: the error is all there is.
    assert main(["repro", "--url", url, "--turn-timeout", "-1"]) == 2
    refused = capsys.readouterr()
    assert refused.out == "" and "turn timeout must be above 0" in refused.err
    # What h11 cannot send is refused before any turn, not a traceback inside one.
    assert main(["repro", "--url", url, "--path", "/a b"]) == 2
    assert "Illegal target characters: '/a b'" in capsys.readouterr().err
    assert main(["repro", "--url", url, "--json", "--header", "X A: b"]) == 2
    assert "Illegal header name" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["repro", "--url", url, "--mode", "sometimes"])
    assert exc.value.code == 2
    with pytest.raises(UsageError):
        run_repro(url + "/v1", None)
    with pytest.raises(TargetUnreachable):
        run_repro(dead_upstream, None)


@pytest.mark.parametrize("header", ["Content-Length: 5", "Transfer-Encoding: chunked", "connection: close",
                                    "X-Request-Id: mine"])
def test_a_header_repro_sets_itself_is_a_usage_error_before_any_turn(header, capsys, dead_upstream):
    # A second Content-Length made h11 raise inside every turn's thread; a Connection
    # header would undo --mode.
    assert main(["repro", "--url", dead_upstream, "--header", header]) == 2
    said = capsys.readouterr()
    assert said.out == "" and said.err.startswith(f"traceproxy repro: cannot send the header {header.split(':')[0]}: ")
    assert "Traceback" not in said.err


def test_a_given_host_passes_the_check_before_the_turns(dead_upstream, capsys):
    # It replaces repro's own Host, so the request has one: the run goes on to connect.
    assert main(["repro", "--url", dead_upstream, "--header", "Host: api.example"]) == 2
    assert "cannot connect" in capsys.readouterr().err


def test_an_empty_host_is_a_usage_error(dead_upstream, capsys):
    assert main(["repro", "--url", dead_upstream, "--header", "Host:"]) == 2
    assert "a Host header needs a value" in capsys.readouterr().err


def test_a_given_host_replaces_repros_own():
    plan = Plan("127.0.0.1", 9, "/v1/chat/completions", None, 1, 1.0, "m", 4, 0.0, (("Host", "api.example"),),
                "abc123", Numbering(), None, threading.Event())
    request = Conversation(plan, "fresh", 1)._request("rid", 10)
    assert [value for name, value in request.headers if name == b"host"] == [b"api.example"]


# ----------------------------------------------------------------------------------
# Pure
# ----------------------------------------------------------------------------------
ENTRY = {"request_id": "rid-1", "trace_id": "ab" * 16, "phase": "awaiting_upstream_headers",
         "client_connection": 7, "client_request_sequence": 2, "upstream_connection": 3, "upstream_reused": True,
         "attempts": 1, "verdict": {"outcome": "FBS", "name": "first_byte_stall", "blame": "engine",
                                    "waiting_for_s": 2.5, "stall_after_s": 0.3, "stalled": True}}


def test_locate_reads_the_inflight_list():
    found = locate([{"request_id": "other"}, ENTRY], "rid-1", answered=False)
    assert (found.kind, found.phase, found.outcome, found.blame, found.proxy_connection, found.proxy_sequence) == (
        IN_FLIGHT, "awaiting_upstream_headers", "FBS", "engine", 7, 2)
    assert locate([ENTRY], "rid-2", answered=False).kind == NOT_REACHED
    assert locate([ENTRY], "rid-2", answered=True).kind == LEFT_PROXY
    assert locate([], "rid-1", answered=False).kind == NOT_REACHED


def test_verdict_texts():
    found = locate([ENTRY], "rid-1", answered=False)
    assert verdict_text(found) == "stuck in phase awaiting_upstream_headers, waiting 2.5 s, blame engine (outcome FBS)"
    assert verdict_key(found) == "stuck in phase awaiting_upstream_headers, blame engine (outcome FBS)"
    assert verdict_text(Diagnosis(NOT_REACHED)) == "never reached the proxy (the hang is in front of it)"
    assert "lost after the proxy" in verdict_text(Diagnosis(LEFT_PROXY))
    assert verdict_text(Diagnosis(UNKNOWN, "no --admin given")) == "unknown: no --admin given"


def test_summary_and_document_from_records():
    hung = TurnRecord("reused", 1, 2, "rid-1", connection=1, connection_use=2, local_port=5555, result=HUNG,
                      elapsed_s=1.5, diagnosis=locate([ENTRY], "rid-1", answered=False))
    records = [TurnRecord("reused", 1, 1, "rid-0", connection=1, connection_use=1, result=OK, status=200),
               hung,
               TurnRecord("fresh", 1, 1, "rid-f", connection=2, connection_use=1, result=FAILED, status=502,
                          error="HTTP 502: upstream down")]
    result = ReproResult("http://x:1", "x:2", ("reused", "fresh"), 1, 3, 1.5, records, 2.0)
    lines = summary_lines(result)
    assert lines[1].split() == ["mode", "turns", "ok", "hung", "failed", "not", "run"]
    assert lines[2].split() == ["reused", "3", "1", "1", "0", "1"]
    assert lines[3].split() == ["fresh", "3", "0", "0", "1", "2"]
    assert any("1 x hung: stuck in phase awaiting_upstream_headers" in line for line in lines)
    assert any("1 x failed: HTTP 502: upstream down" in line for line in lines)
    assert lines[-1] == "1 turn(s) hung, 1 failed"
    text = "\n".join(hung_lines(hung))
    assert "reused conversation 1, turn 2 on connection #1 (use 2 of it, local port 5555)" in text
    assert "proxy client connection 7, request 2 on it; upstream connection 3 (reused)" in text
    assert "next:   traceproxy diagnose rid-1" in text
    document = result_document(result)
    assert document["exit_code"] == 1
    assert document["records"][1]["verdict"].startswith("stuck in phase awaiting_upstream_headers")
    json.dumps(document)


def test_stream_and_traceresponse_parsing():
    body = (b'data: {"choices":[{"delta":{"content":"he"}}]}\n\n'
            b'data: {"choices":[{"delta":{"content":"llo"}}]}\n\ndata: {"usage":{}}\n\ndata: [DONE]\n\n')
    assert parse_stream(body) == (4, True, "hello")
    assert parse_stream(b"data: {broken\n\n") == (1, False, "")
    assert trace_id_of("00-" + "ab" * 16 + "-" + "cd" * 8 + "-01") == "ab" * 16
    assert trace_id_of(None) is None and trace_id_of("garbage") is None


def test_repro_imports_only_h11_the_lifecycle_and_the_standard_library():
    for path in REPRO.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1, f"{path.name} reaches outside traceproxy.repro"
                continue
            names = ([node.module] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                root = name.split(".")[0]
                ok = root in ("__future__", "h11") or root in sys.stdlib_module_names or name.startswith(
                    "traceproxy.lifecycle")
                assert ok, f"{path.name} imports {name}"


def test_faulty_proxy_mode_hangs_reused_connections_only_and_the_harness_says_where(fast_upstream, start_proxy,
                                                                                    loop_thread):
    """The original story: a client-side proxy that stops forwarding on reused
    keep-alive connections. Fresh connections stay healthy; the hang is in front of
    traceproxy, and the harness says so."""
    from traceproxy.repro.harness import run_repro
    from traceproxy.sim.faultyproxy import FaultyProxy

    proxy = start_proxy(fast_upstream().url)
    faulty = loop_thread.run(FaultyProxy(f"http://127.0.0.1:{proxy.port}", hang_after=1, seed=3).start())
    try:
        result = run_repro(faulty.url, f"127.0.0.1:{proxy.admin_port}", conversations=2, turns=3,
                           turn_timeout=1.5, mode="both")
    finally:
        loop_thread.run(faulty.stop())
    reused = [r for r in result.records if r.mode == "reused"]
    fresh = [r for r in result.records if r.mode == "fresh"]
    assert fresh and all(r.result == "ok" for r in fresh)
    hung = [r for r in reused if r.result == "hung"]
    assert hung and all(r.connection_use >= 2 for r in hung)
    assert all(r.diagnosis is not None and r.diagnosis.kind == "not_reached" for r in hung)
    assert result.exit_code == 1
