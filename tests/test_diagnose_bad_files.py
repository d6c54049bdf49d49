"""``traceproxy diagnose`` on span files it did not expect: a time out of range, an
attribute of another type than the proxy writes, a line nested past the JSON parser, a
file that is not a span file at all. Each is handled or said in a line, never a
traceback; and a miss in a file with no span in it says so."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

import traceproxy
from traceproxy.diagnose import Event, Span, find_requests, request_lines, run
from traceproxy.observe import semconv as sc

from .test_diagnose_after_the_fact import (AT_STALL, ATTEMPT, MS, SERVER, STALL, STALL_FACTS, T0, TRACE,
                                           _client_left_before_any_stall, _otlp_document)

NOT_A_SPAN_FILE = "no line of it is an OTLP span document: is it the span file?"
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(traceproxy.__file__)))


def _diagnose(ident: str, spans) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = run(ident, str(spans), out=out, err=err, environ={})
    return status, out.getvalue(), err.getvalue()


def _write(path, *documents) -> str:
    path.write_text("".join((d if isinstance(d, str) else json.dumps(d)) + "\n" for d in documents))
    return str(path)


def _span_of(document: dict, name: str, service: str = "traceproxy") -> dict:
    [resource] = [r for r in document["resourceSpans"]
                  if r["resource"]["attributes"][0]["value"]["stringValue"] == service]
    return next(s for s in resource["scopeSpans"][0]["spans"] if s["name"].startswith(name) and s["kind"] == 2)


def _left() -> dict:
    """A valid document: request hang-1, which its client left (DC)."""
    return _otlp_document(_client_left_before_any_stall())


# ----------------------------------------------------------------------------------
# Times: fixed64 nanoseconds since the epoch
# ----------------------------------------------------------------------------------
UNREADABLE_TIMES = ["9" * 30, "-99999999999999999999", str(2**64), "-1", "soon", 1.5, True, None]


def _attempt_of(document: dict) -> dict:
    return next(s for s in document["resourceSpans"][0]["scopeSpans"][0]["spans"] if s["kind"] == 3)


def _engine_span(document: dict, name: str) -> dict:
    return next(s for s in document["resourceSpans"][1]["scopeSpans"][0]["spans"] if s["name"] == name)


def _timeline(out: str) -> list[str]:
    lines = out.splitlines()
    first = next(index for index, line in enumerate(lines) if line.startswith("  timeline ("))
    return lines[first + 2:next(index for index in range(first + 1, len(lines))
                                if not lines[index].startswith("    "))]


@pytest.mark.parametrize("written", UNREADABLE_TIMES)
def test_a_span_whose_time_cannot_be_read_is_kept_its_time_unknown(tmp_path, written):
    for field, heading in (("startTimeUnixNano", "timeline (start time unknown, took -):"),
                           ("endTimeUnixNano", "timeline (start 2023-11-14 22:13:20.000000 UTC, took -):")):
        document = _left()
        _span_of(document, "POST")[field] = written
        status, out, err = _diagnose("hang-1", _write(tmp_path / "spans.jsonl", document))
        assert status == 0 and "request hang-1" in out and "outcome DC" in out, (field, err)
        assert heading in out, (field, out)
        assert "could not be read" not in out + err, out  # kept, so nothing was skipped


def test_an_attempt_whose_end_cannot_be_read_keeps_its_line_its_marks_and_the_spans_below_it(tmp_path):
    document = _left()
    _attempt_of(document)["endTimeUnixNano"] = "9" * 30
    status, out, err = _diagnose("hang-1", _write(tmp_path / "spans.jsonl", document))
    assert status == 0, err
    assert "  upstream attempt 1: no connection -> DC" in out, out
    assert "         +2.000 ms      +2.000 ms  first_upstream_tx_byte   [attempt 1]" in _timeline(out), out
    assert "  spans below the proxy (router, engines):" in out, out
    assert "      sglang: prefill_forward, 1.000 ms" in out, out


def test_an_engine_span_whose_end_cannot_be_read_is_listed_with_no_duration_and_its_end_last(tmp_path):
    document = _left()
    _engine_span(document, "prefill_forward")["endTimeUnixNano"] = "soon"
    status, out, err = _diagnose("hang-1", _write(tmp_path / "spans.jsonl", document))
    assert status == 0, err
    assert "      sglang: prefill_forward, -" in out, out
    assert _timeline(out)[-1] == "      time unknown              -  prefill_forward ended   [engine prefill, sglang]"


def test_the_largest_time_fixed64_holds_is_still_a_time(tmp_path):
    document = _left()
    _span_of(document, "POST")["endTimeUnixNano"] = str(2**64 - 1)
    status, out, err = _diagnose("hang-1", _write(tmp_path / "spans.jsonl", document))
    assert status == 0 and "outcome DC" in out and "took 16746744073.710 s" in out, err


def test_a_time_written_as_a_float_holding_a_whole_number_is_read(tmp_path):
    # A JSON number is a double to many writers: 1.7e18 is the whole number it holds.
    document = _left()
    server = _span_of(document, "POST")
    server["startTimeUnixNano"] = float(T0)
    server["events"][-1]["timeUnixNano"] = float(T0 + 10_002 * MS)
    status, out, err = _diagnose("hang-1", _write(tmp_path / "spans.jsonl", document))
    assert status == 0, err
    assert "timeline (start 2023-11-14 22:13:20.000000 UTC, took 10.002 s):" in out, out
    assert "         +10.002 s       +9.995 s  downstream_closed   <- longest wait" in _timeline(out), out


def test_one_span_that_cannot_be_read_leaves_the_other_spans_of_its_line(tmp_path):
    # A line is a batch of many requests' spans: a second request's SERVER span in the same
    # line, with a trace id that is no string, costs that span alone, and is no word in the
    # first request's report (it names neither its id nor its trace).
    document = _left()
    broken = dict(_span_of(document, "POST"), spanId="9" * 16, traceId=12345,
                  attributes=[{"key": sc.REQUEST_ID, "value": {"stringValue": "broken-1"}}])
    document["resourceSpans"][0]["scopeSpans"][0]["spans"].append(broken)
    spans = _write(tmp_path / "spans.jsonl", document)
    status, out, err = _diagnose("hang-1", spans)
    assert status == 0 and "request hang-1" in out and "outcome DC" in out, err
    assert "could not be read" not in out, out
    status, _, err = _diagnose("broken-1", spans)
    assert status == 1 and "\n  1 span naming it could not be read" in err, err
    assert NOT_A_SPAN_FILE not in err, err  # its other spans are spans


@pytest.mark.parametrize("written", UNREADABLE_TIMES)
def test_an_event_whose_time_cannot_be_read_is_kept_last_in_the_timeline_its_time_unknown(tmp_path, written):
    document = _left()
    server = _span_of(document, "POST")
    server["events"].insert(1, {"name": "last_downstream_rx_byte", "timeUnixNano": written})
    status, out, err = _diagnose("hang-1", _write(tmp_path / "spans.jsonl", document))
    assert status == 0 and "outcome DC" in out and "took 10.002 s" in out, err
    rows = _timeline(out)
    assert rows[-1] == "      time unknown              -  last_downstream_rx_byte", out
    assert "         +10.002 s       +9.995 s  downstream_closed   <- longest wait" in rows, out


def test_requests_of_one_trace_are_listed_those_of_unknown_start_last():
    # Sorted by start, an unknown start is no number to compare with.
    spans = [Span(TRACE, server_id, "", "POST /generate", "server", start, T0 + 5 * MS,
                  {sc.REQUEST_ID: request_id, sc.OUTCOME: "OK"}, [Event("first_downstream_rx_byte", start)])
             for server_id, request_id, start in (("a" * 16, "late-1", None), ("b" * 16, "early-1", T0))]
    assert [found.request_id for found in find_requests(spans, TRACE)] == ["early-1", "late-1"]
    stall = Span(TRACE, STALL, "c" * 16, "stall FBS", "internal", None, None, {sc.REQUEST_ID: "fly-1", **STALL_FACTS})
    [found] = find_requests([stall], "fly-1")
    text = "\n".join(request_lines(found))
    assert "from its first stall's wait, time unknown" in text and "detected after 2.001 s" in text, text
    assert "      time unknown              -  stall detected: FBS   [stall span]" in text, text


def test_a_time_no_date_can_be_made_of_is_shown_as_its_number():
    # Jaeger's answers are not range-checked as the span file's times are (microseconds, any size).
    huge = 10**30
    server = Span(TRACE, SERVER, "", "POST /generate", "server", huge, huge + 5 * MS,
                  {sc.REQUEST_ID: "far-1", sc.OUTCOME: "OK"}, [Event("first_downstream_rx_byte", huge)])
    [found] = find_requests([server], "far-1")
    text = "\n".join(request_lines(found))
    assert f"start {huge} ns since the epoch (not a date), took 5.000 ms" in text, text


# ----------------------------------------------------------------------------------
# What cannot be read is said, found or not
# ----------------------------------------------------------------------------------
SKIPPED = ("could not be read (a line that is not an OTLP span document: torn, foreign; a span or event whose id or "
           "name is not a string): skipped")


def test_what_naming_the_request_could_not_be_read_is_said_under_its_report(tmp_path):
    # Both scans count: a torn line naming the request id and its trace (counted once), a
    # torn line naming its trace alone, and an event of its attempt with a name that is
    # not a string (its span, and its other marks, kept).
    document = _left()
    _attempt_of(document)["events"].append({"name": 7, "timeUnixNano": str(T0)})
    spans = _write(tmp_path / "spans.jsonl", f'{{"torn": "hang-1", "trace": "{TRACE}"', document,
                   f'{{"resourceSpans": [{{"traceId": "{TRACE}"', '{"torn": "another-request"')
    status, out, err = _diagnose("hang-1", spans)
    assert status == 0 and "first_upstream_tx_byte   [attempt 1]" in out, err
    assert out.splitlines()[-1] == f"2 lines and 1 event naming 'hang-1' or its trace {SKIPPED}", out


def test_the_command_says_a_miss_in_a_line_not_a_traceback(tmp_path):
    document = _left()
    _span_of(document, "POST")["traceId"] = ["not", "an", "id"]
    spans = _write(tmp_path / "spans.jsonl", document)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "traceproxy", "diagnose", "hang-1", "--spans", spans],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith("traceproxy diagnose: no request with trace id or request id 'hang-1'"), lines
    assert lines[1] == f"  1 span naming it {SKIPPED}", lines


def test_a_miss_in_a_file_of_span_documents_whose_spans_cannot_be_read_does_not_ask_if_it_is_one(tmp_path):
    document = _left()
    for resource in document["resourceSpans"]:
        for span in resource["scopeSpans"][0]["spans"]:
            span["traceId"] = 7
    status, out, err = _diagnose("hang-1", _write(tmp_path / "spans.jsonl", document))
    assert status == 1 and out == "", out
    assert NOT_A_SPAN_FILE not in err and f"\n  1 span naming it {SKIPPED}\n" in err, err


# ----------------------------------------------------------------------------------
# Attributes of another type than the proxy writes
# ----------------------------------------------------------------------------------
def _full() -> list[Span]:
    """A request with every attribute the report formats as a number: resent once, with a
    stall that resolved and one still open when it ended, and its stall span."""
    stalled = {sc.STALL_OUTCOME: "SU", sc.STALL_PHASE: "streaming_response", sc.STALL_WAITED: 1.0, sc.BLAME: "engine"}
    server = Span(TRACE, SERVER, "", "POST /v1/chat/completions", "server", T0, T0 + 5_000 * MS,
                  {sc.REQUEST_ID: "full-1", sc.OUTCOME: "SU", sc.BLAME: "engine", sc.CLIENT_IDLE_GAP: 0.5,
                   sc.CHUNK_MAX_GAP: 1.5, sc.GEN_AI_REQUEST_STREAM: True, sc.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK: 0.2},
                  [Event("first_downstream_rx_byte", T0), Event("stall", T0 + 100 * MS, dict(stalled)),
                   Event("stall_resolved", T0 + 200 * MS, {sc.STALL_OUTCOME: "SU", sc.STALL_DURATION: 0.1}),
                   Event("stall", T0 + 300 * MS, dict(stalled))])
    attempts = [Span(TRACE, f"{ATTEMPT[:-1]}{resend}", SERVER, "POST", "client", T0 + MS, T0 + 4_000 * MS,
                     {sc.HTTP_REQUEST_RESEND_COUNT: resend, sc.UPSTREAM_CONNECTION_ID: 3,
                      sc.UPSTREAM_CONNECTION_REUSED: True, sc.UPSTREAM_CONNECTION_IDLE_AGE: 0.3,
                      sc.UPSTREAM_CONNECTION_REQUEST_NUMBER: 2}, [Event("first_upstream_tx_byte", T0 + 2 * MS)])
                for resend in (0, 1)]
    stall = Span(TRACE, STALL, SERVER, "stall SU", "internal", T0 + 2 * MS, T0 + 300 * MS,
                 {sc.REQUEST_ID: "full-1", **stalled, **AT_STALL})
    return [server, *attempts, stall]


def _with(spans: list[Span], key: str, value: dict, where: str) -> dict:
    """The document of ``spans`` with ``key`` written as the OTLP/JSON ``value`` on the spans
    or events ``where`` names: server, attempt, stall (span), event (the server's events
    that carry the key)."""
    document = _otlp_document(spans)
    for span in document["resourceSpans"][0]["scopeSpans"][0]["spans"]:
        kind = {2: "server", 3: "attempt", 1: "stall"}[span["kind"]]
        holders = ([e["attributes"] for e in span["events"] if any(a["key"] == key for a in e["attributes"])]
                   if where == "event" and kind == "server" else [span["attributes"]] if kind == where else [])
        for attributes in holders:
            attributes[:] = [a for a in attributes if a["key"] != key] + [{"key": key, "value": value}]
    return document


# Every attribute the report counts with, and where its report shows it ({} for the value);
# the stall span's wait is shown for a request still in flight (no SERVER span), so that
# one is read from the stall span alone.
NUMBERS = {(sc.CLIENT_IDLE_GAP, "server"): "request - on it, idle {} before it",
           (sc.CHUNK_MAX_GAP, "server"): "upstream chunks, largest gap {}\n",
           (sc.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, "server"): "genai: stream, first chunk after {}\n",
           (sc.UPSTREAM_CONNECTION_IDLE_AGE, "attempt"): "connection 3 reused, idle {}, request 2 on it",
           (sc.HTTP_REQUEST_RESEND_COUNT, "attempt"): "upstream attempt (resend {}): connection 3",
           (sc.STALL_WAITED, "event"): "SU in streaming_response: detected after {}, blame engine",
           (sc.STALL_DURATION, "event"): "; resolved after {}\n",
           (sc.STALL_WAITED, "stall"): "SU (-) in streaming_response: detected after {}, blame engine"}
NOT_SCALARS = {"array": {"arrayValue": {"values": [{"stringValue": "x"}]}},
               "map": {"kvlistValue": {"values": [{"key": "x", "value": {"intValue": "1"}}]}}}
NOT_NUMBERS = {"string": {"stringValue": "x"}, "int not an int": {"intValue": "x"},
               "string of a number": {"stringValue": "2.5"}, **NOT_SCALARS}
# Each as the report shows it: as it is written, a string never read as a number.
AS_WRITTEN = {"string": "x", "int not an int": "x", "string of a number": "2.5", "array": "['x']",
              "map": "{'x': 1}"}


def _report_with(tmp_path, key: str, value: dict, where: str) -> str:
    spans = _full() if where != "stall" else _full()[-1:]
    status, out, err = _diagnose("full-1", _write(tmp_path / "spans.jsonl", _with(spans, key, value, where)))
    assert status == 0 and "request full-1" in out, err
    return out


@pytest.mark.parametrize("key,where", NUMBERS, ids=[f"{k}@{w}" for k, w in NUMBERS])
@pytest.mark.parametrize("kind", list(NOT_NUMBERS))
def test_an_attribute_of_another_type_is_shown_as_written_not_a_traceback(tmp_path, key, where, kind):
    out = _report_with(tmp_path, key, NOT_NUMBERS[kind], where)
    assert NUMBERS[key, where].format(AS_WRITTEN[kind]) in out, out


@pytest.mark.parametrize("kind", list(NOT_SCALARS))
def test_a_stall_code_that_is_not_a_string_is_shown_as_written_and_still_paired(tmp_path, kind):
    # Stall events are paired with their resolutions by their code: the first stall's is
    # resolved, the second still open when the request ended.
    out = _report_with(tmp_path, sc.STALL_OUTCOME, NOT_SCALARS[kind], "event")
    code = AS_WRITTEN[kind]
    assert f"    {code} in streaming_response: detected after 1.000 s, blame engine; resolved after 100.000 ms\n" \
        in out, out
    assert f"    {code} in streaming_response: detected after 1.000 s, blame engine; not resolved (the request " \
        "ended stalled)\n" in out, out


def test_a_duration_that_is_not_a_number_is_printed_as_it_is_written(tmp_path):
    document = _with(_full(), sc.CHUNK_MAX_GAP, {"stringValue": "x"}, "server")
    status, out, err = _diagnose("full-1", _write(tmp_path / "spans.jsonl", document))
    assert status == 0 and "upstream chunks, largest gap x" in out, err
    document = _with(_full(), sc.UPSTREAM_CONNECTION_IDLE_AGE, {"doubleValue": "Infinity"}, "attempt")
    status, out, err = _diagnose("full-1", _write(tmp_path / "spans.jsonl", document))
    assert status == 0 and "connection 3 reused, idle inf, request 2 on it" in out, out


def test_a_resend_count_that_is_not_a_whole_number_is_named_as_written(tmp_path):
    document = _with(_full(), sc.HTTP_REQUEST_RESEND_COUNT, {"stringValue": "x"}, "attempt")
    status, out, err = _diagnose("full-1", _write(tmp_path / "spans.jsonl", document))
    assert status == 0 and "upstream attempt (resend x): connection 3" in out, out


def test_a_request_age_that_is_no_finite_number_leaves_the_start_unknown(tmp_path):
    # Still in flight: only the stall span, whose age would date the request's first byte.
    stall = Span(TRACE, STALL, SERVER, "stall FBS", "internal", T0 + 2 * MS, T0 + 2_001 * MS,
                 {sc.REQUEST_ID: "fly-1", **STALL_FACTS})
    for written in ({"doubleValue": "Infinity"}, {"doubleValue": 1e300}, {"stringValue": "2.5"}):
        document = _with([stall], sc.STALL_REQUEST_AGE, written, "stall")
        status, out, err = _diagnose("fly-1", _write(tmp_path / "spans.jsonl", document))
        assert status == 0 and "its stall spans do not say when the request began" in out, (written, out)


# ----------------------------------------------------------------------------------
# Lines that are not span documents, and files that are not span files
# ----------------------------------------------------------------------------------
def test_a_line_nested_past_the_parser_is_skipped(tmp_path):
    deep = "[" * 200_000 + '"hang-1"'
    status, out, err = _diagnose("hang-1", _write(tmp_path / "spans.jsonl", deep, _left()))
    assert status == 0 and "request hang-1" in out, err
    status, _, err = _diagnose("hang-1", _write(tmp_path / "deep.jsonl", deep))
    assert status == 1 and NOT_A_SPAN_FILE in err, err


@pytest.mark.parametrize("content", [
    b'127.0.0.1 - - [01/Jan/2025:00:00:00 +0000] "POST /v1/chat/completions?rid=hang-1 HTTP/1.1" 200 12\n',
    b'{"trace_id": "4bf92f3577b34da6a3ce929d0e0e4736", "request_id": "hang-1", "outcome": "DC"}\n',
    bytes(range(256)) * 4 + b"hang-1" + bytes(range(256)),
    b"\n\n",
], ids=["access log", "traceproxy access log", "binary", "blank lines"])
def test_a_miss_in_a_file_with_no_span_in_it_asks_whether_it_is_the_span_file(tmp_path, content):
    spans = tmp_path / "spans.jsonl"
    spans.write_bytes(content)
    status, out, err = _diagnose("hang-1", spans)
    assert status == 1 and out == "", out
    lines = err.splitlines()
    assert lines[0] == (f"traceproxy diagnose: no request with trace id or request id 'hang-1' in {spans} (--spans); "
                        + NOT_A_SPAN_FILE), err
    assert "--spans PATH" in err and "sampled out" not in err, err
    # The line naming it, which could not be read, is counted here too.
    assert (lines[1] == f"  1 line naming it {SKIPPED}") == (b"hang-1" in content), err


def test_a_miss_in_a_span_file_or_an_empty_one_does_not_ask(tmp_path):
    for name, content in (("spans.jsonl", json.dumps(_left()) + "\n"), ("empty.jsonl", "")):
        spans = tmp_path / name
        spans.write_text(content)
        status, _, err = _diagnose("no-such-request", spans)
        assert status == 1 and "no request with trace id or request id 'no-such-request'" in err, err
        assert NOT_A_SPAN_FILE not in err and "could not be read" not in err, err
        assert "sampled out ([tracing] healthy_sample_ratio)" in err, err
