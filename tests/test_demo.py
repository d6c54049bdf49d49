"""The README's first command runs to completion, every scenario gets the verdict it
should (engine, client, proxy, and in front of the proxy), the engine's stalls are named
by the PD component traceproxy named live, every code shown is explained, and the commands
it prints work against the stack it leaves running."""

from __future__ import annotations

import argparse
import os
import queue
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace

import psutil
import pytest

from traceproxy.demo import (BY_KEY, NOT_REACHED_TEXT, SCENARIOS, Row, Said, Where, codes_shown, engine_stage_lines,
                             example_trace_id, expectation, legend_lines, running_lines, stopped_lines)
from traceproxy.lifecycle.flags import BY_CODE, Blame, Flag
from traceproxy.sim.routers import ROUTER_NAMES, default_router, router_kind

# The demo with SIGINT restored: a non-interactive parent may have it ignored, and the
# demo's run before its table ends on the default Ctrl-C (--keep-running's wait takes
# SIGINT itself).
RUN_DEMO = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from traceproxy.cli import main; sys.exit(main(['demo']))")


def _traceproxy(command: str) -> list[str]:
    """A printed ``traceproxy ...`` command, run with this interpreter."""
    words = shlex.split(command)
    assert words[0] == "traceproxy", command
    return [sys.executable, "-m", "traceproxy", *words[1:]]


def _printed(stdout: str, prefix: str) -> list[str]:
    return [line.strip() for line in stdout.splitlines() if line.strip().startswith(prefix)]


def test_demo_runs_and_its_table_matches_and_explains_every_code(tmp_path):
    kind = default_router()  # the first installed, named with its version
    result = subprocess.run([sys.executable, "-m", "traceproxy", "demo"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    if kind is not None:
        assert any(line.startswith("router:") and f"{kind.name} {kind.version}" in line for line in lines), lines
    for scenario in SCENARIOS:
        row = next(line for line in lines if line.startswith(scenario.title))
        assert f"  {expectation(scenario, kind).text}  " in row and "  yes  " in row, row
    if kind is not None:
        assert_pd_stages_named(result.stdout, PD_STAGES)
    blamed = {scenario.expected.blame for scenario in SCENARIOS if scenario.expected is not None}
    assert {Blame.CLIENT, Blame.PROXY, Blame.ENGINE} <= blamed
    # One legend line per code shown, in the flag table's own words.
    for scenario in SCENARIOS:
        if scenario.expected is not None:
            outcome = scenario.expected
            assert any(line.strip().startswith(outcome.code) and outcome.meaning in line for line in lines), outcome
    assert (tmp_path / "traceproxy-data" / "spans.jsonl").stat().st_size > 0
    assert (tmp_path / "traceproxy-data" / "access.log").stat().st_size > 0
    # The lookup it prints works from another folder, after the stack is gone.
    (diagnose,) = _printed(result.stdout, "traceproxy diagnose ")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    looked_up = subprocess.run(_traceproxy(diagnose), cwd=elsewhere, capture_output=True, text=True, timeout=60)
    assert looked_up.returncode == 0, looked_up.stdout + looked_up.stderr
    assert shlex.split(diagnose)[2] in looked_up.stdout


# Where the demo's engine stalls hang, as traceproxy names them live: (component, the SGLang
# stages the holding worker may be in; behind vllm-router, which calls decode only once
# prefill answered, a handshake that never completes holds decode in decode_bootstrap).
PD_STAGES = {
    "prefill-stall": ("prefill", ("prefill prefill_forward",)),
    "decode-stall": ("decode", ("decode decode_forward",)),
    "bootstrap-stall": ("bootstrap", ("prefill prefill_bootstrap", "decode decode_bootstrap")),
    "kv-transfer-stall": ("kv_transfer", ("prefill prefill_transfer_kv_cache",)),
    "decode-waiting-stall": ("kv_transfer", ("decode decode_transferred",)),
}


def assert_pd_stages_named(stdout: str, keys) -> None:
    """Each engine stall's row names its component, and the list under the table its SGLang
    stage and worker (this host's simulated workers, from their spans)."""
    listed = stdout[stdout.index("where the engines held each stalled request"):].split("\n\n")[0]
    for key in keys:
        component, stages = PD_STAGES[key]
        title = BY_KEY[key].title
        assert f"  {component}  " in _table_row(stdout, title), _table_row(stdout, title)
        [line] = _printed(listed, f"{title}:")
        assert line.startswith(f"{title}: {component} (") and line.endswith("; from spans)"), line
        assert any(stage in line for stage in stages) and "sglang host " in line, line


# Per router, the scenarios whose engine side each router changes (prefill_stall: decode
# waiting in its transfer queue, or never called behind vllm-router; decode's reset: a
# cut stream, or smg's in-band error event; the PD stalls, whose faults ride in the
# request), the client leaving, and smg's routing by model (the harness's turns). The
# whole demo runs behind the default router above.
PD_SCENARIOS = ("bootstrap-stall", "kv-transfer-stall", "decode-waiting-stall")
SCENARIOS_PER_ROUTER = ("healthy", "prefill-stall", "decode-reset", "client-leaves", *PD_SCENARIOS)


def _table_row(stdout: str, title: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith(title))


@pytest.fixture(scope="module")
def demo_behind(tmp_path_factory):
    """``demo_behind(name)``: the demo's run of SCENARIOS_PER_ROUTER behind that router, once per module."""
    runs: dict[str, subprocess.CompletedProcess] = {}

    def run(name: str) -> subprocess.CompletedProcess:
        if not router_kind(name).installed:
            pytest.skip(f"{name} is not installed")
        if name not in runs:
            keys = [arg for key in SCENARIOS_PER_ROUTER for arg in ("--scenario", key)]
            runs[name] = subprocess.run([sys.executable, "-m", "traceproxy", "demo", "--router", name, *keys],
                                        cwd=tmp_path_factory.mktemp(name), capture_output=True, text=True,
                                        timeout=120)
        return runs[name]

    return run


@pytest.mark.parametrize("name", ROUTER_NAMES)
def test_the_demo_runs_behind_each_router_names_it_and_expects_what_it_does(demo_behind, name):
    kind = router_kind(name)
    result = demo_behind(name)
    out = result.stdout
    [router_line] = _printed(out, "router:")
    assert f"{name} {kind.version} at http://127.0.0.1:" in router_line, router_line
    [proxy_line] = _printed(out, "traceproxy:")
    assert f"{name} {kind.version} (PD mode)" in proxy_line, proxy_line
    rows = {key: _table_row(out, BY_KEY[key].title) for key in SCENARIOS_PER_ROUTER}
    for key, row in rows.items():
        assert f"  {expectation(BY_KEY[key], kind).text}  " in row, row
        assert "  yes  " in row, row  # smg's in-band error event included: an engine failure (USE)
    assert_pd_stages_named(out, ("prefill-stall", *PD_SCENARIOS))
    assert result.returncode == 0, out + result.stderr
    # Under the table, what this router made of the scenarios where routers differ.
    notes = out[out.index(f"behind {name} {kind.version}:"):]
    prefill = _printed(notes, BY_KEY["prefill-stall"].title)[0]
    assert ("decode is never called" in prefill) == kind.decode_waits_for_prefill, prefill
    reset = _printed(notes, BY_KEY["decode-reset"].title)[0]
    assert ("SSE error event" in reset) == kind.behaviour.reports_stream_errors_in_band, reset
    # The run offered again is the same router's.
    assert f"traceproxy demo --router {name} --scenario healthy" in out, out


def test_behind_smg_a_decode_reset_is_an_engine_failure_not_ok(demo_behind):
    result = demo_behind("smg")
    row = _table_row(result.stdout, BY_KEY["decode-reset"].title)
    assert "  engine failure  " in row and "  OK  " not in row and "  yes  " in row, row
    assert result.returncode == 0, result.stdout


def test_each_router_is_expected_to_get_what_its_behaviour_makes_of_the_scenario():
    reset, prefill, stall = BY_KEY["decode-reset"], BY_KEY["prefill-stall"], BY_KEY["decode-stall"]
    for name in ROUTER_NAMES:
        kind = router_kind(name)
        behaviour = kind.behaviour
        if behaviour.reports_stream_errors_in_band:  # smg: the error event, [DONE], a clean end
            assert expectation(reset, kind).failure_of is Blame.ENGINE and expectation(reset, kind).outcome is None
        else:  # the stream cut
            assert expectation(reset, kind).outcome is Flag.UC
        assert expectation(prefill, kind).outcome is Flag.FBS  # the proxy sees no head either way
        assert ("never called" in expectation(prefill, kind).note) == kind.decode_waits_for_prefill
        assert ("drops the silent decode" in expectation(stall, kind).note) == behaviour.cancels_silent_decode
    alone = expectation(reset, None)  # no router: decode's own stream is cut
    assert (alone.outcome, alone.note) == (Flag.UC, "")


def test_an_engine_failure_is_met_by_a_final_failure_blamed_on_the_engine_and_nothing_else():
    engine_failure = expectation(BY_KEY["decode-reset"], router_kind("smg"))
    assert engine_failure.text == "engine failure"
    assert engine_failure.met_by(Said("UPE engine", "a" * 32, Flag.UPE))
    assert engine_failure.met_by(Said("UC engine", "a" * 32, Flag.UC))
    assert not engine_failure.met_by(Said("OK", "a" * 32, Flag.OK))
    assert not engine_failure.met_by(Said("DC client", "a" * 32, Flag.DC))
    assert not engine_failure.met_by(Said("MSS engine, not yet stalled", "a" * 32, Flag.MSS))
    assert not engine_failure.met_by(Said("failed"))
    # A failure taken for a success is not passed over in silence: the note says so.
    missed = Row(BY_KEY["decode-reset"], Said("OK", "a" * 32, Flag.OK), engine_failure)
    assert not missed.matches and missed.note.endswith("it took the in-band error event for a success")
    judged = Row(BY_KEY["decode-reset"], Said("USE engine", "a" * 32, Flag.USE), engine_failure)
    assert judged.matches and judged.note == engine_failure.note


def test_a_router_that_is_not_installed_is_a_one_line_error_and_nothing_starts(monkeypatch, capsys):
    from traceproxy.demo import add_arguments, run_demo
    from traceproxy.sim.routers import RouterKind

    monkeypatch.setattr(RouterKind, "installed", property(lambda kind: kind.name != "smg"))
    args = add_arguments(argparse.ArgumentParser()).parse_args(["--router", "smg"])
    assert run_demo(args) == 2
    err = capsys.readouterr().err
    assert err.strip() == "traceproxy demo: --router smg: not installed (pip install smg)", err
    with pytest.raises(SystemExit):
        add_arguments(argparse.ArgumentParser()).parse_args(["--router", "nginx"])


class _Lines:
    """A child's stdout, read line by line in a thread, so every wait on it is bounded."""

    def __init__(self, stream) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._queue.put(line)
        self._queue.put(None)

    def _lines(self, timeout: float):
        """The lines printed from now on, each kept in ``seen``, until the output ends or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                return
            if line is None:
                return
            self.seen.append(line)
            yield line

    def until(self, prefix: str, timeout: float) -> str:
        for line in self._lines(timeout):
            if line.strip().startswith(prefix):
                return line.strip()
        raise AssertionError(f"no line starting {prefix!r} within {timeout} s:\n{''.join(self.seen)}")

    def rest(self, timeout: float = 10) -> str:
        for _ in self._lines(timeout):
            pass
        return "".join(self.seen)


def _run(command: list[str], cwd, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_keep_running_leaves_a_stack_its_printed_commands_work_against_and_ctrl_c_stops_it(tmp_path):
    stderr_path = tmp_path / "stderr.txt"
    with open(stderr_path, "w") as stderr:
        demo = subprocess.Popen([sys.executable, "-m", "traceproxy", "demo", "--keep-running", "--scenario", "healthy",
                                 "--scenario", "client-leaves"], cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=stderr, text=True, start_new_session=True)
    out = _Lines(demo.stdout)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    try:
        try:
            out.until("the stack keeps running", timeout=120)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nstderr:\n{stderr_path.read_text()}") from None
        curl = out.until("curl -sN ", 5)
        repro = out.until("traceproxy repro ", 5)
        top = out.until("traceproxy top ", 5)
        diagnose = out.until("traceproxy diagnose ", 5)
        stall_on, stalled_repro, stall_off = (out.until("curl -s ", 5), out.until("traceproxy repro ", 5),
                                              out.until("curl -s ", 5))
        through_faulty_proxy = out.until("traceproxy repro ", 5)
        children = psutil.Process(demo.pid).children(recursive=True)
        proxy_port = int(shlex.split(repro)[3].rsplit(":", 1)[1])

        if shutil.which("curl"):
            answer = _run(shlex.split(curl), elsewhere)
            assert answer.returncode == 0 and "data: [DONE]" in answer.stdout, answer.stdout + answer.stderr
        healthy = _run(_traceproxy(repro), elsewhere)
        assert healthy.returncode == 0 and "all 12 turns ok" in healthy.stdout, healthy.stdout + healthy.stderr
        frame = _run(_traceproxy(top) + ["--once", "--no-color"], elsewhere)
        assert frame.returncode == 0 and shlex.split(top)[3] in frame.stdout, frame.stdout + frame.stderr
        looked_up = _run(_traceproxy(diagnose), elsewhere)
        assert looked_up.returncode == 0 and "DC (downstream_connection_termination)" in looked_up.stdout, \
            looked_up.stdout + looked_up.stderr

        if shutil.which("curl"):
            assert '"decode_stall:3"' in _run(shlex.split(stall_on), elsewhere).stdout
            hung = _run(_traceproxy(stalled_repro), elsewhere)
            assert hung.returncode == 1 and "blame engine (outcome MSS)" in hung.stdout, hung.stdout
            assert '"faults": []' in _run(shlex.split(stall_off), elsewhere).stdout
        front = _run(_traceproxy(through_faulty_proxy), elsewhere)
        assert front.returncode == 1 and "never reached the proxy" in front.stdout, front.stdout
        assert "  fresh       6     6" in front.stdout, front.stdout  # fresh connections work

        os.killpg(demo.pid, signal.SIGINT)  # as a terminal's Ctrl-C reaches the whole group
        out.until("stopping the stack", 10)
        os.killpg(demo.pid, signal.SIGINT)  # an impatient second Ctrl-C does not cut the stopping short
        code = demo.wait(timeout=60)
        err = stderr_path.read_text()
        assert code == 0, err
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
    assert "demo finished" in out.rest() and "Traceback" not in err, err
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", proxy_port), timeout=2).close()


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_ctrl_c_stops_the_demo_with_a_line_not_a_traceback_and_leaves_nothing_running(tmp_path, stop):
    # A new session, SIGINT restored (a non-interactive parent may have it ignored).
    proc = subprocess.Popen([sys.executable, "-c", RUN_DEMO], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not psutil.Process(proc.pid).children(recursive=True):
            time.sleep(0.1)
        time.sleep(2)  # well into the run: workers, router and proxy up
        children = psutil.Process(proc.pid).children(recursive=True)
        if stop == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C reaches the whole group
        else:
            os.kill(proc.pid, signal.SIGTERM)  # as kill or a supervisor stops the demo alone
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    expected = (130, "demo interrupted") if stop == "ctrl-c" else (143, "demo stopped (SIGTERM)")
    assert (proc.returncode, expected[1] in err, "Traceback" in err) == (expected[0], True, False), err
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, [child.cmdline() for child in alive]


# ----------------------------------------------------------------------------------
# What it prints, without a stack
# ----------------------------------------------------------------------------------
def _row(key: str, text: str, trace_id: str = "-") -> Row:
    return Row(BY_KEY[key], Said(text, trace_id, BY_CODE.get(text.split(" ")[0])), expectation(BY_KEY[key], None))


def test_the_legend_explains_each_code_shown_once_from_the_flag_table():
    rows = [_row("healthy", "OK", "a" * 32), _row("pool-cap", "PWS proxy", "b" * 32),
            _row("decode-stall", "UC engine", "c" * 32), _row("faulty-proxy", NOT_REACHED_TEXT)]
    assert codes_shown(rows) == ["OK", "PWS", "MSS", "UC"]  # expected and said columns, first seen first
    legend = legend_lines(codes_shown(rows))
    assert len(legend) == 4
    for line, code in zip(legend, ["OK", "PWS", "MSS", "UC"]):
        assert line.split()[0] == code and BY_CODE[code].name in line and BY_CODE[code].meaning in line
    assert "blame proxy" in legend[1] and "blame" not in legend[0]


def test_an_engine_stall_matches_only_when_named_by_its_component():
    kv = BY_KEY["kv-transfer-stall"]
    expected = expectation(kv, router_kind("sglang-router"))
    named = Row(kv, Said("FBS engine", "a" * 32, Flag.FBS, "kv_transfer", "kv_transfer (prefill ...)"), expected)
    assert named.matches and named.cells()[4] == "kv_transfer"
    elsewhere = Row(kv, Said("FBS engine", "a" * 32, Flag.FBS, "prefill", "prefill (prefill ...)"), expected)
    unnamed = Row(kv, Said("FBS engine", "a" * 32, Flag.FBS), expected)
    assert not elsewhere.matches and not unnamed.matches
    lines = engine_stage_lines([named, elsewhere, unnamed])
    assert f"  {kv.title}: expected component kv_transfer, traceproxy named prefill" in lines
    assert f"  {kv.title}: expected component kv_transfer, traceproxy named -" in lines
    assert engine_stage_lines([_row("healthy", "OK", "a" * 32)]) == []  # no stall, no list
    # Without a router the PD stalls are skipped, not failed.
    skipped = Row(kv, Said("skipped (needs a router)"), expectation(kv, None))
    assert skipped.matches and engine_stage_lines([skipped]) == []


def test_only_scenarios_that_set_no_fault_on_a_worker_run_at_once():
    shared = {scenario.key for scenario in SCENARIOS if scenario.shares_the_stack}
    assert shared == {"healthy", "client-leaves", "client-body-stall", "faulty-proxy", "prefill-stall",
                      "decode-stall", *PD_SCENARIOS}
    assert all(BY_KEY[key].request_fault for key in ("prefill-stall", "decode-stall", *PD_SCENARIOS))


def test_the_lookup_offered_is_a_request_that_went_wrong():
    rows = [_row("healthy", "OK", "a" * 32), _row("faulty-proxy", NOT_REACHED_TEXT),
            _row("client-leaves", "DC client", "d" * 32)]
    assert example_trace_id(rows) == "d" * 32
    assert example_trace_id(rows[:2]) == "a" * 32
    assert example_trace_id(rows[1:2]) is None


def test_after_a_run_of_some_scenarios_the_offer_to_keep_it_running_names_them(tmp_path):
    where = Where("http://127.0.0.1:41001", "127.0.0.1:41002", tmp_path / "spans.jsonl", tmp_path / "access.log",
                  "http://127.0.0.1:41003", None, 2)
    some = stopped_lines([_row("pool-cap", "PWS proxy", "e" * 32)], where)
    assert some[-1].endswith("traceproxy demo --scenario pool-cap --keep-running"), some
    every = stopped_lines([_row(scenario.key, "OK", "a" * 32) for scenario in SCENARIOS], where)
    assert every[-1].endswith("traceproxy demo --keep-running"), every
    behind_smg = stopped_lines([_row("pool-cap", "PWS proxy", "e" * 32)], replace(where, router="smg"))
    assert behind_smg[-1].endswith("traceproxy demo --router smg --scenario pool-cap --keep-running"), behind_smg


def test_the_running_commands_name_the_stacks_real_addresses_and_paths(tmp_path):
    spans = tmp_path / "a folder" / "spans.jsonl"
    where = Where("http://127.0.0.1:41001", "127.0.0.1:41002", spans, tmp_path / "access.log",
                  "http://127.0.0.1:41003", "http://127.0.0.1:41004", 2)
    lines = running_lines([_row("pool-cap", "PWS proxy", "e" * 32)], where)
    text = "\n".join(lines)
    # The simulated workers' model: smg routes by model and has no worker for another.
    assert "traceproxy repro --url http://127.0.0.1:41001 --admin 127.0.0.1:41002 --model sim-llama" in text
    assert "traceproxy top --admin 127.0.0.1:41002" in text
    assert f"traceproxy diagnose {'e' * 32} --spans {shlex.quote(str(spans))}" in text
    assert "curl -sN http://127.0.0.1:41001/v1/chat/completions" in text
    assert "curl -s http://127.0.0.1:41003/admin/faults" in text
    assert "traceproxy repro --url http://127.0.0.1:41004 --admin 127.0.0.1:41002 --model sim-llama" in text
    assert "8000" not in text and "9464" not in text


def test_a_signal_ends_the_keep_running_wait_and_a_second_one_does_not_cut_the_stopping_short():
    import asyncio

    from traceproxy.demo_stack import StopSignals

    async def keep_running_then_stop() -> None:
        signals = StopSignals()
        signals.catch()
        try:
            asyncio.get_running_loop().call_later(0.1, os.kill, os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(signals.received.wait(), timeout=10)
            # While the stack stops, a second signal is still caught (sending one for real would
            # end this test process if it were not; the keep-running test sends a second Ctrl-C).
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
        finally:
            signals.release()

    asyncio.run(keep_running_then_stop())
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handed back once all has stopped
