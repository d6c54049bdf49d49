"""``traceproxy bench``: a tiny end-to-end run in a subprocess, plus its measuring parts.

No timing or throughput thresholds: the bench reports figures, these tests check it
ran, that both sides did work, and that keep-alive rounds through the proxy are clean.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from traceproxy.bench.client import Conn, Recorder
from traceproxy.bench.procs import Children
from traceproxy.bench.scenarios import BY_NAME, RequestSpec, scaled, select
from traceproxy.bench.session import split
from traceproxy.bench.stats import Samples, percentile

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT = 55


def _run_bench(args: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, "-m", "traceproxy.bench", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the bench stops its own children on SIGTERM
        out, err = proc.communicate(timeout=15)
        pytest.fail(f"bench did not finish within {RUN_TIMEOUT} s:\n{err.decode()[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), err.decode())


def test_bench_smoke_run_end_to_end(tmp_path):
    report_path = tmp_path / "bench.json"
    result = _run_bench(["--quick", "--scale", "0.05", "--scenarios", "S1,S5", "--json", str(report_path)])
    assert result.returncode == 0, result.stderr[-2000:]

    rows = [line for line in result.stdout.splitlines() if line.startswith("| S")]
    assert {row.split("|")[1].strip() for row in rows} == {"S1", "S5"}
    assert any("req/s" in row for row in rows if row.startswith("| S1"))
    assert any("ok / errors / hangs" in row for row in rows if row.startswith("| S5"))

    summary = json.loads(report_path.read_text())["summary"]
    for name in ("S1", "S5"):
        for target in ("direct", "proxy"):
            assert summary[name][target]["ok"] > 0, (name, target)
    assert summary["S5"]["proxy"]["errors"] == 0
    assert summary["S5"]["proxy"]["hangs"] == 0


def test_bench_rejects_unknown_scenario():
    result = _run_bench(["--scenarios", "S9"])
    assert result.returncode == 2
    assert "unknown scenario S9" in result.stderr


# --- the measuring parts -------------------------------------------------------------------


class _FakeTransport:
    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def get_extra_info(self, name, default=None):
        return default

    def close(self) -> None:
        self.closed = True

    abort = close

    def is_closing(self) -> bool:
        return self.closed


def _sse_response(tokens: int) -> bytes:
    events = [b'data: {"choices": [], "ts": %d}\n\n' % (1_000_000 + i) for i in range(tokens)]
    events += [b'data: {"usage": {}}\n\n', b"data: [DONE]\n\n"]
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" + body


@pytest.mark.parametrize("detail", [True, False])
@pytest.mark.parametrize("piece", [1, 7, 1 << 20])
def test_sse_events_are_counted_across_any_read_boundaries(detail, piece):
    async def scenario():
        rec = Recorder()
        conn = Conn(rec, detail)
        conn.connection_made(_FakeTransport())
        waiter = conn.request(b"GET / HTTP/1.1\r\n\r\n", True, 5 + 2, timeout=5)
        wire = _sse_response(5)
        for i in range(0, len(wire), piece):
            conn.data_received(wire[i:i + piece])
        return await waiter, rec

    error, rec = asyncio.run(scenario())
    assert error is None
    assert (rec.ok, rec.streams, rec.events, dict(rec.errors)) == (1, 1, 7, {})
    if detail:
        assert len(rec.ttft.values) == 1 and len(rec.gaps.values) == 4 and len(rec.delivery.values) == 5


def test_a_stream_cut_before_done_is_an_error():
    async def scenario():
        rec = Recorder()
        conn = Conn(rec, True)
        conn.connection_made(_FakeTransport())
        waiter = conn.request(b"GET / HTTP/1.1\r\n\r\n", True, 4, timeout=5)
        wire = _sse_response(2)
        conn.data_received(wire[: wire.index(b"data: [DONE]")])
        conn.connection_lost(None)
        return await waiter, rec

    error, rec = asyncio.run(scenario())
    assert error == "closed" and rec.ok == 0 and rec.errors["closed"] == 1


def test_upload_body_is_exactly_the_requested_size_and_valid_json():
    spec = RequestSpec(tokens=4, body_bytes=1 << 20)
    body = spec.body()
    assert len(body) == 1 << 20
    assert json.loads(body)["max_tokens"] == 4
    wire = spec.encode("127.0.0.1:1")
    assert b"Content-Length: 1048576\r\n" in wire and wire.endswith(body)


def test_scaling_keeps_scenarios_meaningful():
    tiny = scaled(BY_NAME["S5"], 0.001)
    assert tiny.connections >= 2 and tiny.rounds >= 2
    assert scaled(BY_NAME["S1"], 0.001).duration > 0
    assert [s.name for s in select("s5,S1", 1)] == ["S5", "S1"]
    with pytest.raises(ValueError):
        select("S1,S7", 1)


def test_split_and_percentiles():
    assert split(5, 2) == [(0, 3), (3, 2)]
    assert split(1, 4) == [(0, 1)]
    assert percentile([], 50) is None
    assert percentile(list(range(1, 101)), 99) == 99
    samples = Samples(cap=10)
    for i in range(1000):
        samples.add(i)
    assert len(samples.values) == 10 and samples.seen == 1000


def test_children_are_stopped_by_process_group_even_on_error(tmp_path):
    with pytest.raises(RuntimeError):
        with Children(tmp_path) as children:
            child = children.start("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
            pid = child.pid
            raise RuntimeError("boom")
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
