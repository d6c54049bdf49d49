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
