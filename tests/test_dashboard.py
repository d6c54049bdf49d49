"""The Grafana dashboard (config/grafana/dashboards) asks only for metrics the proxy
exports: every metric name its PromQL names is a family a real proxy's /metrics
declares after a streamed request, a histogram's with _bucket, _sum or _count."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from .support import RawClient, wait_until
from .test_metrics import scrape

DASHBOARDS = sorted((Path(__file__).resolve().parents[1] / "config" / "grafana" / "dashboards").glob("*.json"))

# PromQL words that are not metric names where a name could stand.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
            "inf", "nan"}
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")  # label matchers
_RANGES = re.compile(r"\[[^\[\]]*\]")  # range and subquery selectors
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENTIFIER = re.compile(r"(?<![\w:$.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords, label names and
    Grafana's $variables left out)."""
    expr = _STRINGS.sub('""', expr)
    expr = _MATCHERS.sub("", expr)
    expr = _RANGES.sub("", expr)
    expr = _GROUPING.sub("", expr)
    names = set()
    for name, call in _IDENTIFIER.findall(expr):
        if not call and name.lower() not in KEYWORDS:
            names.add(name)
    return names


def _expressions(dashboard: dict) -> list[str]:
    found = []

    def walk(panels):
        for panel in panels:
            found.extend(target["expr"] for target in panel.get("targets", []) if target.get("expr"))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        query = query.get("query") if isinstance(query, dict) else query
        match = re.fullmatch(r"label_values\((.+),\s*\w+\)", query or "")
        if match:
            found.append(match.group(1))
    return found


@pytest.mark.parametrize("expr, names", [
    ('histogram_quantile(0.99, sum by (le, model) (rate(a_seconds_bucket{model=~"$model"}[$__rate_interval])))',
     {"a_seconds_bucket"}),
    ("sum(x_total) / ignoring(phase) group_left sum without (instance) (y)", {"x_total", "y"}),
    ('rate(z{job="by(x)"}[5m] offset 1h) > bool 0', {"z"}),
])
def test_the_metric_names_of_promql(expr, names):
    assert promql_metric_names(expr) == names


def test_every_metric_the_dashboard_asks_for_is_one_the_proxy_exports(fast_upstream, start_proxy):
    assert DASHBOARDS, "no dashboard in config/grafana/dashboards"
    proxy = start_proxy(fast_upstream().url)
    client = RawClient(proxy.port)
    assert client.roundtrip("POST", "/v1/chat/completions", body=b'{"model": "m", "stream": true, "max_tokens": 2}'
                            ).complete
    client.close()
    assert wait_until(lambda: scrape(proxy).value("traceproxy_requests_total", status="200", outcome="OK",
                                                  blame="-") == 1)
    types = scrape(proxy).types
    exported = set(types)
    exported |= {family + suffix for family, kind in types.items() if kind == "histogram"
                 for suffix in ("_bucket", "_sum", "_count")}
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        expressions = _expressions(dashboard)
        assert expressions, path.name
        asked = set().union(*(promql_metric_names(expr) for expr in expressions))
        assert asked and asked <= exported, f"{path.name} asks for metrics the proxy does not export: " \
                                            f"{sorted(asked - exported)}"
        # What the dashboard is for: tokens per model, blame, stalls, phases.
        for family in ("traceproxy_time_to_first_token_seconds_bucket", "traceproxy_inter_token_latency_seconds_bucket",
                       "traceproxy_requests_total", "traceproxy_stalls_open", "traceproxy_requests_in_flight"):
            assert family in asked, family
        latency = [target for panel in dashboard["panels"] for target in panel.get("targets", [])
                   if "_seconds_bucket" in target["expr"]]
        assert latency and all(target["exemplar"] for target in latency)  # linked to their traces
