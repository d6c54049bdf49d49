"""The access log: one valid JSON line per request, nginx-style timings, the outcome
and blame, and the keep-alive ledger."""

from __future__ import annotations

import asyncio
import json
import socket

from .support import RawClient, admin_metric, raw_exchange, wait_until


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_one_json_line_per_request_with_timings_outcome_and_ledger(fast_upstream, start_proxy, tmp_path):
    log = tmp_path / "logs" / "access.log"
    proxy = start_proxy(fast_upstream().url, **{"access_log.path": str(log)})
    client = RawClient(proxy.port)
    for _ in range(2):
        client.roundtrip("POST", "/v1/chat/completions?x=\"q\"",
                         headers=[("x-request-id", 'id "with" quotes\\')], body=b'{"stream": true}')
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    failing = start_proxy(f"http://127.0.0.1:{dead}", **{"access_log.path": str(log)})
    RawClient(failing.port).roundtrip("GET", "/v1/models")
    assert wait_until(lambda: len(_lines(log)) == 3, timeout=5)  # flushed within the flush interval
    first, second, failed = _lines(log)
    assert first["request_id"] == 'id "with" quotes\\' and first["path"] == '/v1/chat/completions?x="q"'
    assert first["status"] == 200 and first["outcome"] == "OK" and first["blame"] == "-"
    assert first["client_request_sequence"] == 1 and second["client_request_sequence"] == 2
    assert first["upstream_reused"] is False and second["upstream_reused"] is True
    assert second["client_idle_gap"] >= 0 and second["upstream_connection_request"] == 2
    for name in ("upstream_connect_time", "upstream_header_time", "upstream_response_time", "time_to_first_byte",
                 "time_to_first_chunk", "request_time"):
        assert 0 <= first[name] <= first["request_time"] + 1e-6, name
    assert len(first["trace_id"]) == 32 and first["time"].endswith("Z") and first["chunks"] >= 1
    assert failed["status"] == 502 and failed["outcome"] == "UF" and failed["blame"] == "engine"
    assert "refused" in failed["error"] and failed["upstream_connection"] is None


def test_the_proxys_own_replies_count_their_body_and_first_byte(fast_upstream, start_proxy, tmp_path):
    # Like nginx's $body_bytes_sent for an error page: the JSON error body the proxy
    # wrote is what the client received, whether the upstream failed or the request
    # was refused before anything went upstream.
    log = tmp_path / "access.log"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    failing = start_proxy(f"http://127.0.0.1:{dead}", **{"access_log.path": str(log)})
    refused_by_upstream = RawClient(failing.port).roundtrip("GET", "/v1/models")
    proxy = start_proxy(fast_upstream().url, **{"access_log.path": str(log)})
    refused_here = raw_exchange(proxy.port, b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\n"
                                            b"Content-Length: 2\r\n\r\nxy")
    assert wait_until(lambda: len(_lines(log)) == 2, timeout=5)
    # two proxies, two exporter processes appending to one file: in either order
    upstream_failed, bad_request = sorted(_lines(log), key=lambda line: line["status"], reverse=True)
    assert upstream_failed["status"] == 502 and upstream_failed["response_bytes"] == len(refused_by_upstream.body) > 0
    assert refused_here.startswith(b"HTTP/1.1 400 ")
    assert bad_request["status"] == 400 and bad_request["outcome"] == "DPE"
    assert bad_request["response_bytes"] == len(refused_here.split(b"\r\n\r\n", 1)[1]) > 0
    assert 0 <= bad_request["time_to_first_byte"] <= bad_request["request_time"] + 1e-6


def test_a_pipelined_requests_connect_time_is_not_its_wait_for_its_turn(scripted_upstream, start_proxy, tmp_path):
    async def slow_then_fast(reader, writer, upstream):
        for delay in (0.6, 0):
            await reader.read_request()
            await asyncio.sleep(delay)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    log = tmp_path / "access.log"
    proxy = start_proxy(scripted_upstream(slow_then_fast).url, **{"access_log.path": str(log)})
    reply = raw_exchange(proxy.port, b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n"
                                     b"GET /behind HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    assert reply.count(b"HTTP/1.1 200 OK") == 2
    assert wait_until(lambda: len(_lines(log)) == 2, timeout=5)
    slow, behind = _lines(log)
    assert behind["path"] == "/behind" and behind["upstream_reused"] is True
    assert behind["request_time"] >= 0.5  # it waited for /slow
    assert behind["upstream_connect_time"] < 0.1  # a pooled connection, taken at once in its turn


# ---------------------------------------------------------------- a log that cannot be written
def _stderr_until(capfd, wanted, timeout=5.0):
    """The exporter process's stderr (inherited) until every ``wanted`` piece is in it."""
    seen = ""

    def found() -> bool:
        nonlocal seen
        seen += capfd.readouterr().err
        return all(piece in seen for piece in wanted)

    wait_until(found, timeout=timeout)
    return seen


def test_lines_that_cannot_be_written_are_counted_in_metrics_and_logged_once(fast_upstream, start_proxy, capfd):
    import os

    if not os.path.exists("/dev/full"):
        import pytest

        pytest.skip("no /dev/full to fail every write")
    proxy = start_proxy(fast_upstream().url, **{"access_log.path": "/dev/full"})
    client = RawClient(proxy.port)
    for _ in range(3):
        assert client.roundtrip("GET", "/v1/models").status == 200
    client.close()
    assert wait_until(lambda: admin_metric(proxy, "traceproxy_access_log_lines_lost_total") == 3, timeout=5)
    RawClient(proxy.port).roundtrip("GET", "/v1/models")
    assert wait_until(lambda: admin_metric(proxy, "traceproxy_access_log_lines_lost_total") == 4, timeout=5)
    stderr = _stderr_until(capfd, ["access log /dev/full: cannot write"])
    assert stderr.count("access log /dev/full: cannot write") == 1, stderr  # once, not once per batch
    assert "No space left on device" in stderr


TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C


def _finished_request(trace_id, **fields):
    """A finished request's record, as the proxy hands it to its observers; ``fields`` override."""
    from traceproxy.lifecycle.flags import Flag
    from traceproxy.lifecycle.marks import MARK
    from traceproxy.lifecycle.timeline import ClientConnectionRecord, RequestRecord

    connection = ClientConnectionRecord(peer="127.0.0.1:5", opened_ns=0, id=1)
    values = dict(connection=connection, sequence=1, idle_gap_ns=None, method="GET", target="/v1/models",
                  marks={MARK.FIRST_DOWNSTREAM_RX_BYTE: 1}, trace_id=trace_id, span_id=7, request_id="rid",
                  status=200, outcome=Flag.OK, end_ns=9, downstream_tx_body_bytes=2, upstream_rx_chunks=1)
    return RequestRecord(**{**values, **fields})


class _FailingThenWorking:
    """A file whose writes fail with ENOSPC while ``full``, after writing half of what they were given."""

    def __init__(self, path):
        self.real = open(path, "ab", buffering=0)
        self.full = False

    def fileno(self):
        return self.real.fileno()

    def write(self, data):
        import errno

        if self.full:
            self.real.write(bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.real.write(data)

    def close(self):
        self.real.close()


def _line_batch(*records, clock_offset_ns: int = 10**18) -> tuple[bytes, int]:
    """The lines of these finished requests as the proxy sends them to the exporter process."""
    from traceproxy.observe.accesslog import access_line

    return b"".join(access_line(record, clock_offset_ns) + b"\n" for record in records), len(records)


def test_a_log_that_fails_then_recovers_says_so_twice_and_keeps_whole_lines(tmp_path, caplog):
    import logging

    from traceproxy.observe.accesslog import AccessLogWriter

    path = tmp_path / "access.log"
    writer = AccessLogWriter(str(path))
    failing = _FailingThenWorking(path)
    writer._lines._file = failing
    finished = _finished_request(TRACE_ID)
    with caplog.at_level(logging.WARNING, logger="traceproxy.access_log"):
        writer.write_lines(*_line_batch(finished))
        failing.full = True
        for _ in range(3):
            writer.write_lines(*_line_batch(finished, finished))
        failing.full = False
        writer.write_lines(*_line_batch(finished))
        writer.write_lines(*_line_batch(finished))
    writer.close()
    assert writer.lines_lost == 6
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2, messages
    assert messages[0].startswith(f"access log {path}: cannot write (No space left on device)")
    assert messages[1] == f"access log {path}: writing works again; 6 lines were lost"
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(line)["trace_id"] == f"{TRACE_ID:032x}" for line in lines)


def test_the_log_to_stdout_writes_whole_lines_there():
    import os
    import subprocess
    import sys

    from traceproxy.observe.export_wire import AccessLines, ExportConfig, encode_frame, parse_stats_line

    config = ExportConfig(exporter="off", otlp_endpoint="", otlp_protocol="http/protobuf", file_path="",
                          service_name="t", access_log_path="-").to_json()
    stats_read, stats_write = os.pipe()
    child = subprocess.Popen([sys.executable, "-m", "traceproxy.observe.exporter_main", config, str(stats_write)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(stats_write,))
    os.close(stats_write)
    try:
        lines = AccessLines(*_line_batch(*[_finished_request(TRACE_ID)] * 2))
        out, _ = child.communicate(encode_frame([lines]), timeout=30)
    finally:
        child.kill()
    with os.fdopen(stats_read, "rb") as stats:
        last = stats.read().splitlines()[-1]
    assert child.returncode == 0
    lines = out.decode().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["trace_id"] == f"{TRACE_ID:032x}" for line in lines)
    assert parse_stats_line(last)["access_log_lost"] == 0


def test_a_lines_timings_are_seconds_to_the_microsecond_from_the_record(tmp_path):
    # Every timing from its two marks, the wall time from the monotonic start and the
    # clock offset, to the millisecond.
    from traceproxy.lifecycle.marks import MARK
    from traceproxy.lifecycle.timeline import Attempt, StallEntry, UpstreamConnectionRecord
    from traceproxy.observe.accesslog import AccessLogWriter

    start = 5_000_000_000_000
    marks = {MARK.FIRST_DOWNSTREAM_RX_BYTE: start, MARK.LAST_DOWNSTREAM_RX_HEADER_BYTE: start + 10_000,
             MARK.FIRST_DOWNSTREAM_TX_BYTE: start + 2_000_499}  # rounds down
    up = {MARK.POOL_ACQUIRED: start + 30_000, MARK.FIRST_UPSTREAM_TX_BYTE: start + 40_000,
          MARK.LAST_UPSTREAM_RX_HEADER_BYTE: start + 1_040_500}  # a half rounds up
    attempt = Attempt(index=0, marks=up, connection=UpstreamConnectionRecord(opened_ns=0, id=4), reused=True,
                      idle_age_ns=7_000_000, connection_request_number=2, started_ns=start + 20_000, status=200)
    fields = dict(marks=marks, end_ns=start + 3_000_000, idle_gap_ns=1_999_999_999, max_chunk_gap_ns=250_000_000,
                  stalls=[StallEntry("FBS", "first_byte", since_ns=start, detected_ns=start + 2_500_000)])
    attempted = _finished_request(TRACE_ID, attempts=[attempt], **fields)
    unattempted = _finished_request(TRACE_ID, **fields)
    clock_offset_ns = 1_764_000_000_123_999_999 - start
    path = tmp_path / "access.log"
    writer = AccessLogWriter(str(path))
    writer.write_lines(*_line_batch(attempted, unattempted, clock_offset_ns=clock_offset_ns))
    writer.close()
    text = path.read_text()
    assert text.endswith("\n") and text.count("\n") == 2
    line, unattempted = (json.loads(one) for one in text.splitlines())
    assert line["time"] == "2025-11-24T16:00:00.123Z"
    assert line["upstream_connect_time"] == 0.00001  # from when the attempt asked for a connection
    assert line["upstream_header_time"] == 0.001001
    assert line["upstream_response_time"] is None  # its last byte never came
    assert line["time_to_first_byte"] == 0.002 and line["time_to_first_chunk"] is None
    assert line["request_time"] == 0.003 and line["chunk_max_gap"] == 0.25
    assert line["client_idle_gap"] == 2.0 and line["upstream_idle_age"] == 0.007
    assert line["upstream_connection"] == 4 and line["upstream_connection_request"] == 2
    assert line["stalls"] == [{"outcome": "FBS", "phase": "first_byte", "waited": 0.0025, "resolved_after": None}]
    assert unattempted["upstream_connection"] is None and unattempted["upstream_connect_time"] is None
    assert unattempted["attempts"] == 0 and unattempted["outcome"] == "OK" and unattempted["blame"] == "-"
