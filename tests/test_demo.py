"""The README's first command runs to completion and every injected fault gets the
verdict it should."""

from __future__ import annotations

import subprocess
import sys

from traceproxy.demo import SCENARIOS


def test_demo_runs_and_its_table_matches(tmp_path):
    result = subprocess.run([sys.executable, "-m", "traceproxy", "demo"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    for scenario in SCENARIOS:
        row = next(line for line in result.stdout.splitlines() if line.startswith(scenario.name))
        assert scenario.expected in row and "  yes  " in row, row
    assert (tmp_path / "traceproxy-data" / "spans.jsonl").stat().st_size > 0
    assert (tmp_path / "traceproxy-data" / "access.log").stat().st_size > 0


def test_ctrl_c_stops_the_demo_with_a_line_not_a_traceback_and_leaves_nothing_running(tmp_path):
    import os
    import signal
    import time

    import psutil

    # A new session, SIGINT restored (a non-interactive parent may have it ignored).
    proc = subprocess.Popen([sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, "
                             "signal.default_int_handler); from traceproxy.cli import main; sys.exit(main(['demo']))"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not psutil.Process(proc.pid).children(recursive=True):
            time.sleep(0.1)
        time.sleep(2)  # well into the run: workers, router and proxy up
        children = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C reaches the whole group
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and "demo interrupted" in err and "Traceback" not in err, err
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive
