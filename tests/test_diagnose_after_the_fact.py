"""``traceproxy diagnose`` on a request that has ended: what the proxy named live at its
stall (the stall span's engine facts) survives into the report, and the timeline's gaps
run from row to row."""

from __future__ import annotations

import io
import json

from traceproxy.diagnose import Event, Span, _timeline_lines, find_requests, request_lines, run
from traceproxy.observe import semconv as sc

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SERVER, ATTEMPT, STALL, THREAD = "00f067aa0ba902b7", "1111111111111111", "2222222222222222", "3333333333333333"
MS = 1_000_000
T0 = 1_700_000_000 * 1_000_000_000
AT_STALL = {"traceproxy.engine.component": "kv_transfer", "traceproxy.engine.role": "prefill",
            "traceproxy.engine.stage": "prefill_transfer_kv_cache", "traceproxy.engine.stage.state": "in",
            "traceproxy.engine.source": "spans", "traceproxy.engine.worker.service": "sglang",
            "traceproxy.engine.worker.host": "3d1219c7", "traceproxy.engine.worker.pid": 20283}
STALL_FACTS = {"traceproxy.stall.outcome": "FBS", "traceproxy.stall.phase": "awaiting_upstream_headers",
               "traceproxy.stall.waited_s": 2.001, "traceproxy.blame": "engine"}


def _hung_in_kv_transfer_then_the_client_left(prefill_stages=("prefill_prepare", "prefill_bootstrap",
                                                              "prefill_waiting", "prefill_forward")) -> list[Span]:
    """A PD request stalled in the KV transfer; its client left after 30 s (DC). The prefill
    worker's thread span has ended and its stage spans up to prefill_forward did; the KV
    transfer's span never ended, so it is not in the file."""
    server = Span(TRACE, SERVER, "", "POST /v1/chat/completions", "server", T0, T0 + 30_002 * MS,
                  {"traceproxy.request_id": "hung-diag-1", "traceproxy.outcome": "DC",
                   "traceproxy.outcome.name": "client disconnected", "traceproxy.blame": "client"},
                  [Event("first_downstream_rx_byte", T0), Event("last_downstream_rx_byte", T0 + 1 * MS),
                   Event("stall", T0 + 2_001 * MS, STALL_FACTS), Event("downstream_closed", T0 + 30_002 * MS)])
    attempt = Span(TRACE, ATTEMPT, SERVER, "POST /v1/chat/completions", "client", T0 + 1 * MS, T0 + 30_002 * MS,
                   {"traceproxy.outcome": "DC"}, [Event("first_upstream_tx_byte", T0 + 2 * MS)])
    stall = Span(TRACE, STALL, SERVER, "stall FBS", "internal", T0 + 2 * MS, T0 + 2_001 * MS,
                 {"traceproxy.request_id": "hung-diag-1", "traceproxy.outcome.name": "first_byte_stall",
                  **STALL_FACTS, **AT_STALL})
    thread = Span(TRACE, THREAD, ATTEMPT, "Prefill Scheduler [TP 0] (host:3d1219c7 | pid:20283)", "internal",
                  T0 + 3 * MS, T0 + 30_010 * MS,
                  {"thread_label": "Prefill Scheduler", "host_id": "3d1219c7aa", "pid": 20283, "tp_rank": 0},
                  service="sglang")
    stages = [Span(TRACE, f"44444444444444{n:02d}", THREAD, name, "internal", T0 + (3 + n) * MS,
                   T0 + (4 + n) * MS, {}, service="sglang") for n, name in enumerate(prefill_stages)]
    return [server, attempt, stall, thread, *stages]


def _report(spans) -> str:
    [found] = find_requests(spans, "hung-diag-1")
    return "\n".join(request_lines(found))


def test_after_the_client_left_the_stall_line_names_the_pd_stage_the_proxy_named_live():
    text = _report(_hung_in_kv_transfer_then_the_client_left())
    [stall_line] = [line for line in text.splitlines() if line.strip().startswith("FBS in awaiting_upstream_headers")]
    assert "blame engine (kv_transfer: prefill prefill_transfer_kv_cache, sglang pid 20283; from spans)" \
        in stall_line, text
    assert stall_line.endswith("not resolved (the request ended stalled)"), stall_line


def test_a_client_that_left_a_stalled_request_is_not_the_last_word():
    # The outcome is DC, blame client, as it ended; the next line says what hung, before
    # the error that explains the DC.
    spans = _hung_in_kv_transfer_then_the_client_left()
    spans[0].attributes[sc.ERROR_MESSAGE] = "client closed the connection"
    lines = _report(spans).splitlines()
    assert "outcome DC (client disconnected), blame client" in lines[1], lines
    assert lines[2] == ("  the client left while the request was stalled: FBS in awaiting_upstream_headers, "
                        "blame engine: that is the hang"), lines
    assert lines[3] == "  error: client closed the connection", lines


def test_a_request_that_ended_stalled_in_a_stage_whose_span_never_ended_is_not_called_finished():
    text = _report(_hung_in_kv_transfer_then_the_client_left())
    assert "every worker finished" not in text, text
    [engines] = [line for line in text.splitlines() if line.startswith("  engines:")]
    assert "kv_transfer (prefill prefill_transfer_kv_cache, sglang host 3d1219c7 pid 20283; from spans)" \
        in engines, engines
    assert "never ended" in engines and "prefill_forward" in engines, engines


def test_a_stall_whose_stage_did_end_keeps_the_spans_verdict():
    # The transfer's span ended after the stall (the request moved on, then the client left):
    # the spans know more than the stall did.
    spans = _hung_in_kv_transfer_then_the_client_left(("prefill_prepare", "prefill_bootstrap", "prefill_waiting",
                                                       "prefill_forward", "prefill_transfer_kv_cache"))
    [engines] = [line for line in _report(spans).splitlines() if line.startswith("  engines:")]
    assert "every worker finished; the last stage that ended: kv_transfer" in engines, engines


def _gaps(spans) -> list[tuple[str, str, str]]:
    [found] = find_requests(spans, "hung-diag-1")
    rows = []
    for line in _timeline_lines(found)[2:]:
        fields = line.split()
        rows.append((" ".join(fields[0:2]), " ".join(fields[2:4]), fields[4]))
    return rows


def test_each_gap_is_the_time_since_the_row_before_it_engine_stages_included():
    rows = _gaps(_hung_in_kv_transfer_then_the_client_left())
    names = [name for _, _, name in rows]
    forward, transfer_wait = names.index("prefill_forward"), names.index("stall")
    assert rows[forward][1] == "+1.000 ms", rows  # prefill_waiting ended 1 ms before it
    assert rows[transfer_wait][1] == "+1.994 s", rows
    closed = names.index("downstream_closed")
    assert rows[closed][1] == "+28.001 s", rows  # from the stall row at +2.001 s, not from a mark
    [longest] = [line for line in _timeline_lines(find_requests(_hung_in_kv_transfer_then_the_client_left(),
                                                                "hung-diag-1")[0]) if "<- longest wait" in line]
    assert "downstream_closed" in longest, longest


# --- no stall fired: the client left first (curl --max-time below the first-byte threshold) ---

PREFILL_THREAD, DECODE_THREAD = "5555555555555555", "6666666666666666"
AT_END = {"component": "kv_transfer", "role": "prefill", "stage": "prefill_transfer_kv_cache", "state": "in",
          "worker": {"service": "sglang", "host": "3d1219c7", "pid": 20283}, "since_s": 9.8, "source": "spans"}


def _client_left_before_any_stall(status: str = "error") -> list[Span]:
    """A PD request held in the KV transfer; its client left after 10 s (DC), before the
    first-byte threshold, so no stall fired. Then both engines aborted it: each worker's
    thread span ended (with ``status``), prefill's stages up to prefill_forward and decode's
    up to decode_bootstrap had ended; the transfer's spans never did."""
    server = Span(TRACE, SERVER, "", "POST /v1/chat/completions", "server", T0, T0 + 10_002 * MS,
                  {"traceproxy.request_id": "hang-1", "traceproxy.outcome": "DC",
                   "traceproxy.outcome.name": "client disconnected", "traceproxy.blame": "client"},
                  [Event("first_downstream_rx_byte", T0), Event("downstream_closed", T0 + 10_002 * MS)])
    attempt = Span(TRACE, ATTEMPT, SERVER, "POST /v1/chat/completions", "client", T0 + 1 * MS, T0 + 10_002 * MS,
                   {"traceproxy.outcome": "DC"}, [Event("first_upstream_tx_byte", T0 + 2 * MS)])
    threads = [Span(TRACE, PREFILL_THREAD, ATTEMPT, "Prefill Scheduler [TP 0] (host:3d1219c7 | pid:20283)",
                    "internal", T0 + 3 * MS, T0 + 10_010 * MS, {"thread_label": "Prefill Scheduler", "pid": 20283},
                    status=status, service="sglang"),
               Span(TRACE, DECODE_THREAD, ATTEMPT, "Decode Scheduler [TP 0] (host:9f00aa11 | pid:20284)",
                    "internal", T0 + 3 * MS, T0 + 10_011 * MS, {"thread_label": "Decode Scheduler", "pid": 20284},
                    status=status, service="sglang")]
    stages = [Span(TRACE, f"44444444444444{n:02d}", PREFILL_THREAD, name, "internal", T0 + (3 + n) * MS,
                   T0 + (4 + n) * MS, {}, service="sglang")
              for n, name in enumerate(("prefill_prepare", "prefill_bootstrap", "prefill_waiting", "prefill_forward"))]
    stages += [Span(TRACE, f"77777777777777{n:02d}", DECODE_THREAD, name, "internal", T0 + (3 + n) * MS,
                    T0 + (4 + n) * MS, {}, service="sglang")
               for n, name in enumerate(("decode_prepare", "decode_bootstrap"))]
    return [server, attempt, *threads, *stages]


def _engines_line(spans, access_log: dict | None = None) -> str:
    [found] = find_requests(spans, "hang-1")
    found.access_log = access_log
    [line] = [line for line in request_lines(found) if line.startswith("  engines:")]
    return line


def test_with_no_stall_the_engines_line_says_where_the_proxy_had_the_request_when_it_ended():
    line = _engines_line(_client_left_before_any_stall(), {"trace_id": TRACE, "outcome": "DC", "engine_stage": AT_END})
    assert line.startswith("  engines: when the request ended (DC) the engines had it in kv_transfer (prefill "
                           "prefill_transfer_kv_cache, sglang host 3d1219c7 pid 20283; from spans); afterwards "
                           "every worker ended (status error)"), line
    assert "finished" not in line.replace("not finished", ""), line


def test_from_spans_alone_workers_that_dropped_the_request_are_not_called_finished():
    # No access log to read: the spans still show the engines aborted it mid-stage.
    line = _engines_line(_client_left_before_any_stall())
    assert "every worker finished" not in line, line
    assert "every worker ended (status error)" in line, line
    # The stage each worker had it in, never claimed to have run: the decode worker may
    # still have been waiting for the transfer to start.
    assert "; dropped in: prefill_transfer_kv_cache (prefill), decode_transferred (decode); the last stage that " \
        "ended: " in line, line
    assert "never ended" not in line, line


def test_a_stage_ended_by_the_drop_itself_is_the_one_the_worker_dropped_the_request_in():
    # The prefill worker ends its open prefill_forward with the request when it drops it
    # (thread span ended with error status at that same moment): it never reached the
    # transfer. The decode worker's are listed after the prefill's, whatever the file's order.
    spans = _client_left_before_any_stall()
    forward = next(s for s in spans if s.name == "prefill_forward")
    forward.end_ns = next(s for s in spans if s.span_id == PREFILL_THREAD).end_ns
    spans.reverse()
    line = _engines_line(spans)
    assert "; dropped in: prefill_forward (prefill), decode_transferred (decode)" in line, line


def test_a_flat_stage_ending_with_its_worker_was_finished_not_cut():
    # Only a forward stage, which holds others, is ended by a drop; the transfer's end at
    # the thread's own moment is the transfer finishing.
    spans = _client_left_before_any_stall()
    thread = next(s for s in spans if s.span_id == PREFILL_THREAD)
    spans.append(Span(TRACE, "4444444444444499", PREFILL_THREAD, "prefill_transfer_kv_cache", "internal",
                      thread.end_ns - 1 * MS, thread.end_ns, {}, service="sglang"))
    line = _engines_line(spans)
    assert "(prefill)" not in line.split("; the last stage that ended")[0], line


def test_a_worker_that_ended_before_its_last_stage_did_dropped_the_request_whatever_its_status():
    line = _engines_line(_client_left_before_any_stall(status="unset"))
    assert "every worker finished" not in line and "(status error)" not in line, line
    assert "; dropped in: prefill_transfer_kv_cache (prefill)" in line, line


def test_the_server_spans_own_engine_facts_are_read_when_it_carries_them():
    spans = _client_left_before_any_stall()
    spans[0].attributes.update(AT_STALL)  # the same traceproxy.engine.* keys a stall span carries
    assert "when the request ended (DC) the engines had it in kv_transfer (prefill prefill_transfer_kv_cache" \
        in _engines_line(spans)


def _otlp_document(spans: list[Span]) -> dict:
    kinds = {"internal": 1, "server": 2, "client": 3}

    def value(v):
        if isinstance(v, bool):  # before int: a bool is an int in Python
            return {"boolValue": v}
        if isinstance(v, int):
            return {"intValue": str(v)}
        return {"doubleValue": v} if isinstance(v, float) else {"stringValue": str(v)}

    return {"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": service}}]},
        "scopeSpans": [{"spans": [{
            "traceId": s.trace_id, "spanId": s.span_id, "parentSpanId": s.parent_id, "name": s.name,
            "kind": kinds[s.kind], "startTimeUnixNano": str(s.start_ns), "endTimeUnixNano": str(s.end_ns),
            "attributes": [{"key": k, "value": value(v)} for k, v in s.attributes.items()],
            "events": [{"name": e.name, "timeUnixNano": str(e.time_ns),
                        "attributes": [{"key": k, "value": value(v)} for k, v in e.attributes.items()]}
                       for e in s.events],
            "status": {"code": 2} if s.status == "error" else {}}
            for s in spans if (s.service or "traceproxy") == service]}]}
        for service in ("traceproxy", "sglang")]}


def _files(tmp_path) -> tuple[str, str]:
    spans_path, log_path = tmp_path / "spans.jsonl", tmp_path / "access.log"
    spans_path.write_text(json.dumps(_otlp_document(_client_left_before_any_stall())) + "\n")
    log_path.write_text("\n".join([
        json.dumps({"trace_id": "0" * 32, "request_id": "other", "outcome": "OK"}),
        "{torn",
        json.dumps({"trace_id": TRACE, "request_id": "hang-1", "outcome": "DC", "engine_stage": AT_END})]) + "\n")
    return str(spans_path), str(log_path)


def test_diagnose_reads_the_access_log_named_by_flag_or_by_the_variable_serve_reads(tmp_path):
    spans_path, log_path = _files(tmp_path)
    for flag, environ in ((log_path, {}), (None, {"TRACEPROXY_ACCESS_LOG_PATH": log_path})):
        out, err = io.StringIO(), io.StringIO()
        assert run("hang-1", spans_path, out=out, err=err, environ=environ, access_log=flag) == 0, err.getvalue()
        assert "when the request ended (DC) the engines had it in kv_transfer" in out.getvalue(), out.getvalue()
    # serve's default access log is stdout: nothing to read, the spans alone speak.
    out = io.StringIO()
    assert run("hang-1", spans_path, out=out, err=io.StringIO(), environ={}) == 0
    assert "every worker ended (status error)" in out.getvalue() and "when the request ended" not in out.getvalue()


def test_an_access_log_named_but_missing_is_a_usage_error_naming_it(tmp_path):
    spans_path, _ = _files(tmp_path)
    err = io.StringIO()
    assert run("hang-1", spans_path, out=io.StringIO(), err=err, environ={},
               access_log=str(tmp_path / "nope.log")) == 2
    assert f"no access log at {tmp_path / 'nope.log'} (--access-log)" in err.getvalue(), err.getvalue()
