"""From raw load-generator results to figures, the markdown table, the JSON file and the exit status.

Rates and latencies are medians over repetitions; counts (ok, errors, hangs) are
totals over repetitions, so a failure in any repetition shows. Hangs include
requests never started because the scenario ran out of its time budget.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from .stats import median, merge_lists, percentile

TARGETS = ("direct", "proxy")
_SUMMED = ("ok", "hangs", "skipped", "reconnects", "server_closes", "bytes_up", "bytes_down", "events", "streams")
_SAMPLES = ("ttfb", "ttft", "gaps", "delivery")
SATURATED = 90  # CPU % of one core at which a helper process, not the proxy, sets the pace


def merge(parts: list[dict]) -> dict:
    """One run's result from the results of its load processes (which ran side by side)."""
    merged: dict = {key: sum(p[key] for p in parts) for key in _SUMMED}
    merged["elapsed"] = max(p["elapsed"] for p in parts)
    merged["load_cpu_max"] = max(100 * p["cpu_s"] / max(p["elapsed"], 1e-9) for p in parts)
    errors: dict[str, int] = {}
    for part in parts:
        for kind, n in part["errors"].items():
            errors[kind] = errors.get(kind, 0) + n
    merged["errors"] = errors
    for key in _SAMPLES:
        merged[key] = merge_lists([p[key] for p in parts])
    return merged


def _ms(values: list[float], pct: float) -> float | None:
    value = percentile(values, pct)
    return None if value is None else value * 1000


def figures(run: dict) -> dict:
    """The numbers of one run that the table can show."""
    secs = max(run["elapsed"], 1e-9)
    return {
        "req_s": run["ok"] / secs,
        "events_s": run["events"] / secs,
        "streams_s": run["streams"] / secs,
        "upload_mb_s": run["bytes_up"] / secs / 1e6,
        "ttfb_p50": _ms(run["ttfb"], 50), "ttfb_p99": _ms(run["ttfb"], 99),
        "ttft_p50": _ms(run["ttft"], 50), "ttft_p99": _ms(run["ttft"], 99),
        "gap_p99": _ms(run["gaps"], 99), "delivery_p99": _ms(run["delivery"], 99),
        "ok": run["ok"], "errors": sum(run["errors"].values()), "hangs": run["hangs"] + run["skipped"],
        "reconnects": run["reconnects"],
        "cpu_load": run["load_cpu_max"], "cpu_upstream": run["cpu"].get("upstream"),
        "cpu_proxy": run["cpu"].get("proxy"),
    }


_COUNTS = ("ok", "errors", "hangs", "reconnects")


def combine(per_rep: list[dict]) -> dict:
    """Figures over repetitions: counts summed, everything else the median."""
    if not per_rep:
        return {}
    keys = per_rep[0].keys()
    return {k: (sum(f[k] for f in per_rep) if k in _COUNTS else median([f[k] for f in per_rep])) for k in keys}


# --- table rows -------------------------------------------------------------------------------


def _num(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "–"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def _ratio(direct: float | None, proxy: float | None) -> str:
    if not direct or proxy is None:
        return "–"
    return f"{proxy / direct:.2f}×"


def _added(direct: float | None, proxy: float | None) -> str:
    if direct is None or proxy is None:
        return "–"
    return f"{proxy - direct:+.2f} ms"


def _cpu(f: dict) -> str:
    if not f:
        return "–"
    return " / ".join(_num(f.get(k), 0) for k in ("cpu_load", "cpu_upstream", "cpu_proxy"))


def _failures_vs(d: dict, p: dict) -> str:
    if not d or not p:
        return "–"
    bad_p, bad_d = p["errors"] + p["hangs"], d["errors"] + d["hangs"]
    if bad_p and not bad_d:
        return "FAIL: proxy only"
    return "same" if bad_p == bad_d else f"{bad_p - bad_d:+d}"


@dataclass(frozen=True)
class Metric:
    label: str
    show: Callable[[dict], str]
    compare: Callable[[dict, dict], str]


def _value(key: str, digits: int = 1) -> Callable[[dict], str]:
    return lambda f: _num(f.get(key), digits) if f else "–"


def _rate(label: str, key: str) -> Metric:
    return Metric(label, _value(key), lambda d, p: _ratio(d.get(key), p.get(key)))


def _latency(label: str, key: str) -> Metric:
    return Metric(label, _value(key, 2), lambda d, p: _added(d.get(key), p.get(key)))


METRICS: dict[str, Metric] = {
    "req_s": _rate("req/s", "req_s"),
    "events_s": _rate("chunks/s (SSE events)", "events_s"),
    "streams_s": _rate("streams/s", "streams_s"),
    "upload_mb_s": _rate("upload MB/s", "upload_mb_s"),
    "ttfb_p50": _latency("TTFB p50 ms", "ttfb_p50"),
    "ttfb_p99": _latency("TTFB p99 ms", "ttfb_p99"),
    "ttft_p50": _latency("TTFT p50 ms", "ttft_p50"),
    "ttft_p99": _latency("TTFT p99 ms", "ttft_p99"),
    "gap_p99": _latency("inter-chunk gap p99 ms", "gap_p99"),
    "delivery_p99": _latency("chunk delivery latency p99 ms", "delivery_p99"),
    "failures": Metric("errors / hangs", lambda f: f"{f['errors']} / {f['hangs']}" if f else "–", _failures_vs),
    "ok": Metric("ok / errors / hangs", lambda f: f"{f['ok']} / {f['errors']} / {f['hangs']}" if f else "–",
                 _failures_vs),
    "reconnects": Metric("reconnects", _value("reconnects", 0),
                         lambda d, p: "–" if not d or not p else f"{p['reconnects'] - d['reconnects']:+d}"),
    "cpu": Metric("CPU % load / upstream / proxy", _cpu, lambda d, p: ""),
}


def scenario_rows(name: str, metric_keys: tuple[str, ...], direct: dict, proxy: dict) -> list[list[str]]:
    rows = []
    for key in metric_keys:
        metric = METRICS[key]
        rows.append([name, metric.label, metric.show(direct), metric.show(proxy), metric.compare(direct, proxy)])
    return rows


def markdown(rows: list[list[str]]) -> str:
    header = ["scenario", "metric", "direct", "proxy", "proxy vs direct"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def regressed(direct: dict, proxy: dict) -> bool:
    """Errors or hangs through the proxy where direct had none."""
    if not proxy:
        return False
    return bool(proxy["errors"] + proxy["hangs"]) and not (direct and direct["errors"] + direct["hangs"])


def notes(summary: dict[str, dict]) -> list[str]:
    out = []
    for name, s in summary.items():
        for target in TARGETS:
            f = s.get(target) or {}
            for part, hint in (("load", " (try --load-procs 2)"), ("upstream", "")):
                cpu = f.get(f"cpu_{part}")
                if cpu is not None and cpu >= SATURATED:
                    out.append(f"{name} {target}: the {part} process was at {cpu:.0f}% CPU, so this "
                               f"run's rates are bounded by it, not by what is measured{hint}.")
            kinds = s.get("error_kinds", {}).get(target)
            if kinds:
                out.append(f"{name} {target} errors: " + ", ".join(f"{k}×{n}" for k, n in sorted(kinds.items())))
    return out


def write_json(path: str, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")
