"""What the harness prints: results in, lines of text (or one JSON document) out.

Pure functions only, so every line is testable without sockets. The CLI prints
``turn_lines`` as turns end (hung and failed ones always, ok ones with
``--verbose``) and ``summary_lines`` at the end.
"""

from __future__ import annotations

import shlex
from collections import Counter
from dataclasses import asdict

from .harness import FAILED, HUNG, OK, ReproResult, TurnRecord
from .inflight import IN_FLIGHT, LEFT_PROXY, NOT_REACHED, Diagnosis

NOT_REACHED_TEXT = "never reached the proxy (the hang is in front of it)"
LEFT_PROXY_TEXT = ("not in flight at the proxy, which had answered (what is missing was lost "
                   "after the proxy, between it and the client)")
INDENT = "      "


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s" if value < 1 else f"{value:.1f} s"


# ----------------------------------------------------------------------------------
# The proxy's verdict
# ----------------------------------------------------------------------------------
def verdict_text(diagnosis: Diagnosis | None) -> str:
    """One sentence: where the proxy says the request is."""
    if diagnosis is None:
        return "-"
    if diagnosis.kind == NOT_REACHED:
        return NOT_REACHED_TEXT
    if diagnosis.kind == LEFT_PROXY:
        return LEFT_PROXY_TEXT
    if diagnosis.kind != IN_FLIGHT:
        return f"unknown: {diagnosis.detail}"
    if diagnosis.outcome is None:
        return f"in flight in phase {diagnosis.phase}, no verdict"
    return (f"stuck in phase {diagnosis.phase}, waiting {seconds(diagnosis.waiting_for_s)}, "
            f"blame {diagnosis.blame} (outcome {diagnosis.outcome})")


def verdict_key(diagnosis: Diagnosis | None) -> str:
    """``verdict_text`` without the seconds, so equal verdicts group in the summary."""
    if diagnosis is not None and diagnosis.kind == IN_FLIGHT and diagnosis.outcome is not None:
        return f"stuck in phase {diagnosis.phase}, blame {diagnosis.blame} (outcome {diagnosis.outcome})"
    return verdict_text(diagnosis)


def ledger_text(diagnosis: Diagnosis) -> str:
    """How the proxy sees the request's connections."""
    parts = [f"proxy client connection {diagnosis.proxy_connection}, request {diagnosis.proxy_sequence} on it"]
    if diagnosis.upstream_connection is not None:
        reuse = "reused" if diagnosis.upstream_reused else "new"
        parts.append(f"upstream connection {diagnosis.upstream_connection} ({reuse})")
    else:
        parts.append("no upstream connection yet")
    if diagnosis.attempts and diagnosis.attempts > 1:
        parts.append(f"{diagnosis.attempts} upstream attempts")
    return "; ".join(parts)


def engine_text(stage: dict) -> str:
    """Where the engines have the request, from the proxy's ``engine_stage``:
    ``decode decode_forward on sglang pid 4242 for 2.1 s (from spans)``."""
    words = " ".join(str(stage[key]) for key in ("component", "stage") if stage.get(key)) or "somewhere"
    worker = stage.get("worker") or {}
    if isinstance(worker, dict) and (worker.get("service") or worker.get("pid") is not None):
        pid = worker.get("pid")
        words += f" on {worker.get('service') or '?'}" + (f" pid {pid}" if pid is not None else "")
    if stage.get("state") == "ended":
        words += ", ended"
    if stage.get("since_s") is not None:
        words += f" for {seconds(stage['since_s'])}"
    if stage.get("source"):
        words += f" (from {stage['source']})"
    return words


# ----------------------------------------------------------------------------------
# One turn
# ----------------------------------------------------------------------------------
def turn_title(record: TurnRecord) -> str:
    where = f"{record.mode} conversation {record.conversation}, turn {record.turn}"
    if not record.connection:
        return f"{where}, no connection"
    return (f"{where} on connection #{record.connection} "
            f"(use {record.connection_use} of it, local port {record.local_port})")


def client_side_text(record: TurnRecord) -> str:
    """What had come back when the harness gave up."""
    if record.status is None:
        return f"waited {seconds(record.elapsed_s)}: no response head ({record.response_bytes} bytes back)"
    silent = record.elapsed_s - record.last_byte_s if record.last_byte_s is not None else None
    return (f"waited {seconds(record.elapsed_s)}: HTTP {record.status} head after {seconds(record.head_s)}, "
            f"{record.events} stream events, {record.response_bytes} bytes, "
            f"nothing for the last {seconds(silent)}, no end of stream")


def ids_text(record: TurnRecord) -> str:
    trace = record.trace_id or (
        record.diagnosis.trace_id if record.diagnosis and record.diagnosis.trace_id else None)
    source = "" if record.trace_id or not trace else " (from the proxy's in-flight list)"
    trace_text = f"trace id {trace}{source}" if trace else "trace id unknown (no response head)"
    return f"request id {record.request_id}, {trace_text}"


def turn_lines(record: TurnRecord) -> list[str]:
    if record.result == OK:
        return [ok_line(record)]
    if record.result == HUNG:
        return hung_lines(record)
    return failed_lines(record)


def ok_line(record: TurnRecord) -> str:
    note = f"  [{record.note}]" if record.note else ""
    return (f"ok    {record.mode:<6} c{record.conversation} t{record.turn}  conn #{record.connection} "
            f"use {record.connection_use}  HTTP {record.status}  {record.events} events  "
            f"head {seconds(record.head_s)}  total {seconds(record.elapsed_s)}  "
            f"{record.context_messages} messages  {record.request_id}{note}")


def hung_lines(record: TurnRecord) -> list[str]:
    lines = [f"HUNG  {turn_title(record)}", f"{INDENT}{ids_text(record)}",
             f"{INDENT}client: {client_side_text(record)}"]
    if record.note:
        lines.append(f"{INDENT}{record.note}")
    lines.append(f"{INDENT}proxy:  {verdict_text(record.diagnosis)}")
    if record.diagnosis is not None and record.diagnosis.kind == IN_FLIGHT:
        lines.append(f"{INDENT}        {ledger_text(record.diagnosis)}")
        if record.diagnosis.engine_stage:
            lines.append(f"{INDENT}engine: {engine_text(record.diagnosis.engine_stage)}")
        lines.append(f"{INDENT}next:   {diagnose_command(record.request_id, record.span_file)}")
    return lines


def diagnose_command(request_id: str, span_file: str | None) -> str:
    """``traceproxy diagnose ID``, with ``--spans`` and the proxy's span file when it is
    known, so the command works from any folder."""
    spans = f" --spans {shlex.quote(span_file)}" if span_file else ""
    return f"traceproxy diagnose {request_id}{spans}"



def failed_lines(record: TurnRecord) -> list[str]:
    lines = [f"FAIL  {turn_title(record)}", f"{INDENT}{ids_text(record)}", f"{INDENT}error: {record.error}"]
    if record.note:
        lines.append(f"{INDENT}{record.note}")
    if record.status is not None:
        lines.append(f"{INDENT}next:  {diagnose_command(record.trace_id or record.request_id, record.span_file)}")
    return lines


# ----------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------
def plan_line(url: str, admin: str | None, conversations: int, turns: int, modes: tuple[str, ...],
              turn_timeout: float) -> str:
    return (f"repro: {conversations} conversation(s) x {turns} turn(s), mode {' + '.join(modes)}, "
            f"against {url}, admin {admin or '(none)'}, turn timeout {seconds(turn_timeout)}")


def summary_lines(result: ReproResult) -> list[str]:
    lines = [f"summary ({len(result.records)} turns in {seconds(result.elapsed_s)}):",
             f"  {'mode':<7} {'turns':>5} {'ok':>5} {'hung':>5} {'failed':>6} {'not run':>7}"]
    planned = result.conversations * result.turns
    for mode in result.modes:
        ran = sum(1 for r in result.records if r.mode == mode)
        lines.append(f"  {mode:<7} {planned:>5} {result.count(OK, mode):>5} {result.count(HUNG, mode):>5} "
                     f"{result.count(FAILED, mode):>6} {planned - ran:>7}")
    lines += verdict_lines(result)
    lines.append(conclusion(result))
    return lines


def verdict_lines(result: ReproResult) -> list[str]:
    counts = Counter((r.mode, _problem_key(r)) for r in result.records if r.result != OK)
    if not counts:
        return []
    lines = ["verdicts:"]
    for (mode, key), n in sorted(counts.items(), key=lambda item: (result.modes.index(item[0][0]), -item[1])):
        lines.append(f"  {mode:<7} {n:>3} x {key}")
    return lines


def _problem_key(record: TurnRecord) -> str:
    if record.result == HUNG:
        return f"hung: {verdict_key(record.diagnosis)}"
    return f"failed: {record.error[:100]}"


def conclusion(result: ReproResult) -> str:
    if result.exit_code == 0:
        return f"all {len(result.records)} turns ok"
    return f"{len(result.hung)} turn(s) hung, {len(result.failed)} failed"


def result_document(result: ReproResult) -> dict:
    """The whole run as JSON-ready data (``--json``)."""
    document = asdict(result)
    document["summary"] = {
        mode: {"ok": result.count(OK, mode), "hung": result.count(HUNG, mode), "failed": result.count(FAILED, mode)}
        for mode in result.modes
    }
    for record, data in zip(result.records, document["records"]):
        data["verdict"] = verdict_text(record.diagnosis) if record.result == HUNG else None
    document["exit_code"] = result.exit_code
    return document
