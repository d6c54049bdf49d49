"""``traceproxy bench --workers N --scrape-every S``: each in-tree proxy is a service of N
workers, and its /metrics is read during every measured run. No timing thresholds."""

from __future__ import annotations

import json

import pytest

from .support import run_bench


def test_bench_runs_a_service_of_workers_and_scrapes_it_during_the_run(tmp_path):
    report_path = tmp_path / "bench.json"
    result = run_bench("--quick", "--scale", "0.1", "--scenarios", "S1", "--targets", "direct,proxy", "--workers", "2",
                    "--scrape-every", "0.1", "--json", str(report_path))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "2 workers per proxy" in result.stdout and "/metrics read every 0.1 s" in result.stdout
    doc = json.loads(report_path.read_text())
    assert doc["meta"]["workers"] == 2 and doc["meta"]["scrape_every_s"] == 0.1
    [run] = doc["runs"]["S1"]["proxy"]
    assert run["ok"] > 0 and sum(run["errors"].values()) == 0
    assert run["scrapes"]["count"] >= 1 and run["scrapes"]["failed"] == 0
    # The service's parent and its two workers, each a process of the proxy's tree.
    assert len(doc["memory"]["proxy"]["processes"]) == 3


@pytest.mark.parametrize("args, said", [(["--workers", "0"], "--workers must be from 1 to 64"),
                                        (["--scrape-every", "-1"], "--scrape-every must be seconds")])
def test_bench_refuses_a_worker_count_or_scrape_interval_it_cannot_use(args, said):
    result = run_bench("--scenarios", "S1", *args)
    assert result.returncode == 2 and said in result.stderr, result.stderr[-2000:]
