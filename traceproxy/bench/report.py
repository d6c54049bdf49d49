"""From raw load-generator results to figures, the markdown table, the JSON file and the exit status.

Rates and latencies are medians over repetitions; counts (ok, errors, hangs) are
totals over repetitions, so a failure in any repetition shows. Hangs include
requests never started because the scenario ran out of its time budget.

The table has one value column per target and, when ``direct`` ran, one comparison
column per proxy target against it. ``added_cost`` compares ``proxy-traced`` (or
``proxy-logged``) with ``bare`` (or ``proxy`` when ``bare`` did not run): what turning
tracing (or the access log) on costs; ``receiver_cost`` the same for ``proxy-receiver``
(or ``proxy-receiver-grpc``), with what its receivers' process took apart and per 1,000
spans. ``observer_prices`` says the same in CPU µs per
request, for every scenario and every observed target, ``defaults`` included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from .stats import median, merge_lists, percentile

TARGETS = ("direct", "bare", "proxy", "proxy-traced", "proxy-logged", "proxy-receiver", "proxy-receiver-grpc",
           "defaults")
# Run unless --targets says otherwise; ``proxy`` only with --proxy-cmd (without one it is ``bare``).
DEFAULT_TARGETS = ("direct", "bare", "proxy-traced", "proxy-logged", "defaults")
BASELINE = "direct"
BARE = ("bare", "proxy")  # the target observers are priced against: the first of these that ran
OBSERVED = ("proxy-traced", "proxy-logged", "proxy-receiver", "proxy-receiver-grpc", "defaults")
RECEIVERS = {"proxy-receiver": "http", "proxy-receiver-grpc": "grpc"}  # target -> the protocol its engines send
SHORT = {"direct": "direct", "bare": "bare", "proxy": "proxy", "proxy-traced": "traced", "proxy-logged": "logged",
         "proxy-receiver": "receiver", "proxy-receiver-grpc": "receiver-grpc", "defaults": "defaults"}
_SUMMED = ("ok", "hangs", "skipped", "reconnects", "server_closes", "bytes_up", "bytes_down", "events", "streams")
_SAMPLES = ("ttfb", "ttft", "gaps", "delivery", "latency")
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
    merged["proxy_cpu_s"] = None
    for key in _SAMPLES:
        merged[key] = merge_lists([p.get(key, []) for p in parts])
    return merged


def _ms(values: list[float], pct: float) -> float | None:
    value = percentile(values, pct)
    return None if value is None else value * 1000


def cpu_us_per_request(run: dict) -> float | None:
    """The proxy tree's CPU (exporter included, read once it was quiet again) per request answered."""
    cpu_s = run.get("proxy_cpu_s")
    return None if cpu_s is None or not run["ok"] else cpu_s * 1e6 / run["ok"]


def engine_spans_per_s(run: dict) -> float | None:
    """Spans a second the run's engine span loads had taken (answered with success), both summed."""
    loads = run.get("engine_loads")
    if not loads:
        return None
    return sum(load["spans_sent"] / max(load["elapsed"], 1e-9) for load in loads)


def ms_per_1000_spans(cpu_percent: float | None, spans_per_s: float | None) -> float | None:
    """CPU % of one core spent taking this many spans a second, as ms of CPU per 1,000 spans."""
    if cpu_percent is None or not spans_per_s:
        return None
    return cpu_percent * 10 / spans_per_s * 1000


def figures(run: dict) -> dict:
    """The numbers of one run that the table can show."""
    secs = max(run["elapsed"], 1e-9)
    spans_s = engine_spans_per_s(run)
    return {
        "cpu_us": cpu_us_per_request(run),
        "req_s": run["ok"] / secs,
        "events_s": run["events"] / secs,
        "streams_s": run["streams"] / secs,
        "upload_mb_s": run["bytes_up"] / secs / 1e6,
        "latency_p50": _ms(run["latency"], 50),
        "ttfb_p50": _ms(run["ttfb"], 50), "ttfb_p99": _ms(run["ttfb"], 99),
        "ttft_p50": _ms(run["ttft"], 50), "ttft_p99": _ms(run["ttft"], 99),
        "gap_p99": _ms(run["gaps"], 99), "delivery_p99": _ms(run["delivery"], 99),
        "ok": run["ok"], "errors": sum(run["errors"].values()), "hangs": run["hangs"] + run["skipped"],
        "reconnects": run["reconnects"],
        "cpu_load": run["load_cpu_max"], "cpu_upstream": run["cpu"].get("upstream"),
        "cpu_proxy": run["cpu"].get("proxy"), "cpu_exporter": run["cpu"].get("exporter"),
        "cpu_sink": run["cpu"].get("sink"),
        "cpu_receiver": run["cpu"].get("receiver"), "cpu_engines": run["cpu"].get("engines"),
        "cpu_discard": run["cpu"].get("discard"),
        "engine_spans_s": spans_s,
        "engine_spans_not_sent": sum(load["spans_not_sent"] + load["spans_dropped"]
                                     for load in run.get("engine_loads") or []),
        "receiver_ms_per_1000_spans": ms_per_1000_spans(run["cpu"].get("receiver"), spans_s),
    }


_COUNTS = ("ok", "errors", "hangs", "reconnects", "engine_spans_not_sent")


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
    text = " / ".join(_num(f.get(k), 0) for k in ("cpu_load", "cpu_upstream", "cpu_proxy"))
    extra = [f"{label} {_num(f[k], 0)}" for k, label in (("cpu_exporter", "exporter"), ("cpu_sink", "sink"),
                                                          ("cpu_receiver", "receiver"), ("cpu_engines", "engines"),
                                                          ("cpu_discard", "discard"))
             if f.get(k) is not None and (k != "cpu_exporter" or f[k] >= 0.5)]
    return f"{text} ({', '.join(extra)})" if extra else text


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
    "latency_p50": _latency("request latency p50 ms", "latency_p50"),
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
    "cpu_us": Metric("proxy CPU µs/request", _value("cpu_us", 0), lambda d, p: ""),
}


def compared(targets: tuple[str, ...]) -> tuple[str, ...]:
    """The targets that get a comparison column: every proxy target, when the baseline ran."""
    return tuple(t for t in targets if t != BASELINE) if BASELINE in targets else ()


def header(targets: tuple[str, ...]) -> list[str]:
    return ["scenario", "metric", *targets, *(f"{SHORT[t]} vs {BASELINE}" for t in compared(targets))]


def scenario_rows(name: str, metric_keys: tuple[str, ...], by_target: dict[str, dict],
                  targets: tuple[str, ...] = TARGETS) -> list[list[str]]:
    """One row per metric: each target's value, then each proxy target against direct."""
    rows = []
    base = by_target.get(BASELINE) or {}
    for key in metric_keys:
        metric = METRICS[key]
        rows.append([name, metric.label, *(metric.show(by_target.get(t) or {}) for t in targets),
                     *(metric.compare(base, by_target.get(t) or {}) for t in compared(targets))])
    return rows


def memory_row(memory: dict[str, dict], targets: tuple[str, ...]) -> list[str]:
    """Peak RSS of each proxy's process tree (each process's peak, summed), with the parts."""
    cells = []
    for target in targets:
        m = memory.get(target) or {}
        peak = m.get("peak_bytes")
        if not peak:
            cells.append("–")
            continue
        parts = [p["vm_hwm_bytes"] for p in m.get("processes", []) if p.get("vm_hwm_bytes")]
        text = f"{peak / 2**20:.1f}"
        if len(parts) > 1:
            text += " (" + " + ".join(f"{b / 2**20:.1f}" for b in parts) + ")"
        cells.append(text)
    return ["all", "peak RSS MiB (process tree)", *cells, *("" for _ in compared(targets))]


def markdown(rows: list[list[str]], targets: tuple[str, ...] = TARGETS) -> str:
    header_cells = header(targets)
    widths = [max(len(r[i]) for r in [header_cells, *rows]) for i in range(len(header_cells))]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header_cells), sep, *(line(r) for r in rows)])


def regressed(direct: dict, proxy: dict) -> bool:
    """Errors or hangs through the proxy where direct had none."""
    if not proxy:
        return False
    return bool(proxy["errors"] + proxy["hangs"]) and not (direct and direct["errors"] + direct["hangs"])


def bare_of(targets) -> str | None:
    """The target observers are priced against, of those that ran."""
    return next((t for t in BARE if t in targets), None)


def observer_prices(summary: dict[str, dict], targets: tuple[str, ...]) -> list[str]:
    """Per scenario, each observed target's CPU µs per request against bare's: what its observers cost."""
    base = bare_of(targets)
    observed = [t for t in OBSERVED if t in targets]
    out = []
    if base is None or not observed:
        return out
    for name, entry in summary.items():
        plain = (entry.get(base) or {}).get("cpu_us")
        if not plain:
            continue
        parts = []
        for target in observed:
            cost = (entry.get(target) or {}).get("cpu_us")
            if cost is not None:
                parts.append(f"{SHORT[target]} {cost:,.0f} ({cost - plain:+,.0f}, {cost / plain:.2f}×)")
        if parts:
            out.append(f"{name}: {base} {plain:,.0f} µs; " + "; ".join(parts))
    return out


def added_cost(summary: dict[str, dict], memory: dict[str, dict], target: str,
               base: str = "bare") -> list[str]:
    """What a feature costs: ``target`` (proxy-traced, proxy-logged) against ``base``. Empty unless both ran."""
    out = []
    s1, s2, s5 = summary.get("S1") or {}, summary.get("S2") or {}, summary.get("S5") or {}
    plain, traced = s1.get(base) or {}, s1.get(target) or {}
    if plain.get("req_s") and traced.get("req_s") is not None:
        drop = 100 * (plain["req_s"] - traced["req_s"]) / plain["req_s"]
        verdict = f"a {drop:.1f} % drop" if drop >= 0 else f"{-drop:.1f} % higher (no cost measurable)"
        out.append(f"S1 throughput: {_num(plain['req_s'])} -> {_num(traced['req_s'])} req/s, {verdict}")
    # S1 is saturated (its latency is mostly queueing); S5 is paced, far from it.
    for label, entry, key in (("S1 request latency p50", s1, "latency_p50"), ("S2 TTFT p50", s2, "ttft_p50"),
                              ("S5 (paced) TTFB p50", s5, "ttfb_p50")):
        a, b = (entry.get(base) or {}).get(key), (entry.get(target) or {}).get(key)
        if a is not None and b is not None:
            change = f", {100 * (b - a) / a:+.1f} %" if a else ""
            verdict = f"{b - a:+.2f} ms added{change}" if b >= a else \
                f"{b - a:+.2f} ms{change} (lower: no cost measurable)"
            out.append(f"{label}: {_num(a, 2)} -> {_num(b, 2)} ms, {verdict}")
    peaks = {t: (memory.get(t) or {}).get("peak_bytes") for t in (base, target)}
    if all(peaks.values()):
        out.append(f"peak RSS: {peaks[base] / 2**20:.1f} -> {peaks[target] / 2**20:.1f} MiB "
                   f"({(peaks[target] - peaks[base]) / 2**20:+.1f} MiB, its child processes included)")
    return out


def receiver_cost(summary: dict[str, dict], memory: dict[str, dict], target: str, base: str) -> list[str]:
    """What receiving the engines' spans costs: ``target`` (a receiver target) against ``base``, both
    runs under the same engine span loads when ``--engine-span-load`` is on. The proxy's tree
    includes its receivers' process; that process is also shown apart, per 1,000 spans."""
    out = added_cost(summary, memory, target, base)
    if not out:
        return out
    for name, entry in summary.items():
        plain, received = entry.get(base) or {}, entry.get(target) or {}
        if not received:
            continue
        parts = []
        if plain.get("cpu_us") and received.get("cpu_us") is not None:
            parts.append(f"proxy CPU {plain['cpu_us']:,.0f} -> {received['cpu_us']:,.0f} µs/request "
                         f"({received['cpu_us'] / plain['cpu_us']:.2f}×, the receivers' process included)")
        if received.get("cpu_receiver") is not None:
            per_1000 = received.get("receiver_ms_per_1000_spans")
            taken = f", {per_1000:.1f} ms per 1,000 spans taken ({received['engine_spans_s']:,.0f} a second)" \
                if per_1000 is not None else ""
            parts.append(f"the receivers' process {received['cpu_receiver']:.1f} % of a core{taken}")
        if plain.get("cpu_engines") is not None or received.get("cpu_engines") is not None:
            discard = f"; the discard sink {plain['cpu_discard']:.1f} % on {base}'s side" \
                if plain.get("cpu_discard") is not None else ""
            parts.append(f"the engine span loads {_num(plain.get('cpu_engines'))} % ({base}) and "
                         f"{_num(received.get('cpu_engines'))} % ({SHORT[target]}) of a core{discard}")
        if parts:
            out.append(f"{name}: " + "; ".join(parts))
    return out


def engine_load_evidence(summary: dict[str, dict], rate: float) -> list[str]:
    """That the engine span loads ran, at what rate, and where each target's spans went."""
    if not rate:
        return []
    out = [f"two emulated SGLang workers (prefill, 9 spans a request; decode, 25) each exported the spans of "
           f"{rate:g} requests a second, 64 spans an export request, in every run: to the receiver for "
           f"{', '.join(RECEIVERS)}, else to the discard sink"]
    for name, entry in summary.items():
        cells = [f"{SHORT[t]} {f['engine_spans_s']:,.0f}" for t, f in entry.items()
                 if t in TARGETS and f and f.get("engine_spans_s") is not None]
        lost = sum((f or {}).get("engine_spans_not_sent") or 0 for t, f in entry.items() if t in TARGETS)
        if cells:
            out.append(f"{name}: spans taken a second (median of runs): {', '.join(cells)}"
                       + (f"; {lost:,} spans not taken (refused, unanswered or dropped by a full queue)" if lost
                          else "; none refused or lost"))
    return out


def tracing_evidence(tracing: dict) -> list[str]:
    """That tracing really ran: what the sink received, what the proxy counted."""
    if not tracing:
        return []
    out = []
    sink = tracing.get("sink") or {}
    metrics = tracing.get("proxy_metrics_before_stop") or {}
    line = (f"OTLP sink received {sink.get('spans', 0):,} spans in {sink.get('requests', 0):,} export requests "
            f"({sink.get('bytes', 0) / 2**20:.1f} MiB) during the proxy-traced runs")
    if sink.get("undecodable"):
        line += f"; {sink['undecodable']} requests did not decode"
    requests = metrics.get("requests_total")
    if requests:
        line += (f"; proxy-traced served {requests:,.0f} requests (warm-up included), "
                 f"{sink.get('spans', 0) / requests:.2f} spans each")
    if metrics.get("spans_dropped_total") is not None:
        line += (f"; its spans_dropped_total: {metrics['spans_dropped_total']:,.0f} "
                 "(span items, one per request or stall, dropped with the export queue full)")
    if metrics.get("spans_shed_total"):
        line += (f"; spans_shed_total: {metrics['spans_shed_total']:,.0f} (healthy requests whose spans were "
                 "shed: past tracing.healthy_max_per_second, or while the exporter was behind)")
    out.append(line)
    return out


def access_log_evidence(access_log: dict) -> list[str]:
    """That the access log really ran: its lines against the requests proxy-logged counted."""
    if not access_log:
        return []
    log = access_log.get("file") or {}
    metrics = access_log.get("proxy_metrics_before_stop") or {}
    line = f"proxy-logged wrote {log.get('lines', 0):,} lines ({log.get('bytes', 0) / 2**20:.1f} MiB)"
    requests = metrics.get("requests_total")
    if requests:
        line += f" for {requests:,.0f} requests (warm-up included)"
    if metrics.get("spans_dropped_total"):
        line += f"; {metrics['spans_dropped_total']:,.0f} lines dropped with the export queue full"
    return [line + "; the file was in the run's temp directory"]


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
            never = s.get("never_started", {}).get(target)
            if never:
                out.append(f"{name} {target}: {never} requests never started within the scenario's time "
                           "budget; they are counted as hangs.")
    return out


def write_json(path: str, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")
