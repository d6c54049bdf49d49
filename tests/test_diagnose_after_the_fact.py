"""``traceproxy diagnose`` on a request that has ended: what the proxy named live at its
stall (the stall span's engine facts) survives into the report, and the timeline's gaps
run from row to row."""

from __future__ import annotations

from traceproxy.diagnose import Event, Span, _timeline_lines, find_requests, request_lines

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
