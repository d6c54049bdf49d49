"""The service's metrics: the numbers of every worker merged, then written out.

Theory of operation
-------------------
Each worker's ``ProxyMetrics.numbers()`` (plus its requests in flight by phase) is
plain data. ``merge`` turns the numbers of the workers into the service's:

* counters and histograms are summed, bucket by bucket, over every worker, each with
  its latest answer: a worker that missed this scrape's deadline counts with the
  numbers it gave last, which are lower than its current ones but never higher, so
  a service total never goes down while the service runs (a counter going down is a
  reset to Prometheus: ``rate()`` and ``increase()`` would be wrong);
* gauges that count things (requests in flight, open stalls, connections, the pool)
  are summed over the workers that answered this scrape only: a number from an
  earlier moment would describe requests that may be gone. What is left out is
  visible as ``traceproxy_workers_answering`` below ``traceproxy_workers``;
* gauges that are not counts are reduced: the learned upstream keep-alive timeout is
  the smallest any worker learned (the one the pool must stay below), misalignment
  is 1 when any worker's pool is misaligned, the client keep-alive timeout is the
  configured value (the same in every worker);
* each histogram bucket's exemplar is the one of the workers' that ``replaces``
  prefers (a recent failed or stalled request over a later healthy one);
* the per-model families are merged by label: a label's histograms bucket by bucket and
  its counters summed, over the workers that have it. Each worker bounds its own labels
  (``metrics.max_models`` names, then ``other``), so the service shows at most that many
  per worker; in a deployment whose clients name a few models every worker names the
  same few. A bound for the service as a whole would need the workers to agree on one
  list as requests come (a lock on the request path), or would move a name's counts into
  ``other`` between scrapes, which Prometheus reads as a counter reset.

``render`` writes the families, with the same names and meanings whether the service
has one worker or many; the engine families come from the service's one scraper.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterable

from ..lifecycle.flags import BY_CODE
from .exposition import Exemplar, Exposition
from .metrics import (EXEMPLAR_END, EXEMPLAR_RAW, EXEMPLAR_REQUEST, EXEMPLAR_TRACE, HISTOGRAM_SHAPES,
                      IN_FLIGHT_PHASES, MODEL_COUNTERS, MODEL_HISTOGRAM_SHAPES, replaces)

COUNTED_DICTS = ("requests", "stalls", "stalls_resolved", "pool", "spans")
COUNTED_INTS = ("observer_errors", "stall_listener_errors")
SUMMED_GAUGES = ("stalls_open", "client_connections", "upstream_open", "upstream_idle", "warm_target")


def merge(fresh: list[dict], late: Iterable[dict] = ()) -> dict:
    """The service's numbers from the workers that answered (``fresh``) and the last
    answers of those that did not (``late``; counters and histograms only)."""
    counted = [*fresh, *late]
    service: dict = {key: _sum_dicts(n[key] for n in counted) for key in COUNTED_DICTS}
    for key in COUNTED_INTS:
        service[key] = sum(n[key] for n in counted)
    sheds = [n["shed"] for n in counted if n["shed"] is not None]
    service["shed"] = _sum_dicts(sheds) if sheds else None
    service["histograms"] = {name: merge_histograms([n["histograms"][name] for n in counted], len(bounds) + 1)
                             for name, (bounds, _) in HISTOGRAM_SHAPES.items()}
    service["models"] = merge_models([n.get("models") or {} for n in counted])
    service["in_flight"] = {**dict.fromkeys(IN_FLIGHT_PHASES, 0), **_sum_dicts(n["in_flight"] for n in fresh)}
    for key in SUMMED_GAUGES:
        service[key] = sum(n[key] for n in fresh)
    learned = [n["keepalive_learned"] for n in fresh if n["keepalive_learned"] is not None]
    service["keepalive_learned"] = min(learned) if learned else None
    service["keepalive_misaligned"] = any(n["keepalive_misaligned"] for n in fresh)
    service["client_keepalive"] = max((n["client_keepalive"] for n in fresh), default=math.nan)
    return service


def _sum_dicts(dicts: Iterable[dict]) -> dict:
    total: dict = {}
    for numbers in dicts:
        for key, value in numbers.items():
            total[key] = total.get(key, 0) + value
    return total


def merge_histograms(histograms: list[list], buckets: int) -> list:
    """[bucket counts, raw sum, exemplars] summed bucket by bucket; each bucket's
    exemplar chosen among the workers' as one worker would have kept it."""
    counts, raw_sum, exemplars = [0] * buckets, 0, [None] * buckets
    for bucket_counts, worker_sum, worker_exemplars in histograms:
        for index, n in enumerate(bucket_counts):
            counts[index] += n
        raw_sum += worker_sum
        for index, candidate in enumerate(worker_exemplars or ()):
            if candidate is not None:
                exemplars[index] = _preferred(candidate, exemplars[index])
    return [counts, raw_sum, exemplars]


_MODEL_BUCKETS = tuple(len(bounds) + 1 for bounds, _ in MODEL_HISTOGRAM_SHAPES.values())


def merge_models(workers: list[dict]) -> dict:
    """Each ``model`` label's numbers (``ModelNumbers.numbers()``) merged over the workers that have it."""
    by_label: dict[str, list[list]] = {}
    for models in workers:
        for label, numbers in models.items():
            by_label.setdefault(label, []).append(numbers)
    merged = {}
    for label, answers in by_label.items():
        histograms = [merge_histograms([answer[i] for answer in answers], buckets)
                      for i, buckets in enumerate(_MODEL_BUCKETS)]
        counters = [sum(answer[i] for answer in answers) for i in range(len(_MODEL_BUCKETS), len(answers[0]))]
        merged[label] = [*histograms, *counters]
    return merged


def _preferred(a: tuple, b: tuple | None) -> tuple:
    if b is None:
        return a
    older, newer = (a, b) if a[EXEMPLAR_END] <= b[EXEMPLAR_END] else (b, a)
    return newer if replaces(newer, older) else older


# ----------------------------------------------------------------------------------
# Writing the families
# ----------------------------------------------------------------------------------
def render(out: Exposition, service: dict, engines=None, workers: dict | None = None) -> None:
    """``engines``: the service's ``EngineScraper`` or None. ``workers``: ``count``,
    ``answering`` and ``late_total`` (one worker, answering, when None)."""
    _render_requests(out, service)
    _render_latencies(out, service["histograms"])
    _render_models(out, service["models"])
    _render_stalls(out, service)
    _render_upstream_pool(out, service)
    _render_client_connections(out, service)
    render_internals(out, service)
    _render_engines(out, engines)
    _render_workers(out, workers or {"count": 1, "answering": 1, "late_total": 0})


def _render_requests(out: Exposition, service: dict) -> None:
    out.gauge("requests_in_flight", "Requests in flight, by the phase they are in.",
              [((("phase", phase),), n) for phase, n in service["in_flight"].items()])
    labelled: Counter[tuple[str, str, str]] = Counter()
    for (status, code), n in service["requests"].items():
        labelled[("" if status is None else str(status), code, BY_CODE[code].blame.value)] += n
    out.counter("requests_total", "Finished requests by response status (empty when none was sent), "
                "outcome code and blame.",
                [((("status", status), ("outcome", code), ("blame", blame)), n)
                 for (status, code, blame), n in sorted(labelled.items())])


LATENCY_HELP = {
    "request_duration_seconds": "Seconds from the request's first byte to the end of the request.",
    "time_to_first_byte_seconds": "Seconds from the request's first byte to the first response byte sent to the "
                                  "client (the upstream's response head, or the proxy's own error reply).",
    "time_to_first_chunk_seconds": "Seconds from the request's first byte to the first response body byte sent "
                                   "to the client.",
    "response_chunk_max_gap_seconds": "Per request with two or more upstream body reads: its largest gap between "
                                      "reads, observed once when it ends.",
}


def _render_latencies(out: Exposition, histograms: dict) -> None:
    for name, help_text in LATENCY_HELP.items():
        _histogram(out, name, help_text, histograms[name])


def _histogram(out: Exposition, name: str, help_text: str, numbers: list) -> None:
    bounds, scale = HISTOGRAM_SHAPES[name]
    out.histogram(name, help_text, bounds, *_series(out, numbers, scale))


def _series(out: Exposition, numbers: list, scale: int) -> tuple[list[int], float, list]:
    """A histogram's numbers as written: cumulative counts, the sum in exported units, exemplars."""
    counts, raw_sum, kept = numbers
    cumulative, running = [], 0
    for n in counts:
        running += n
        cumulative.append(running)
    exemplars = [_exemplar(e, scale) for e in kept] if out.openmetrics and kept else []
    return cumulative, raw_sum / scale if scale != 1 else raw_sum, exemplars


MODEL_HELP = {
    "time_to_first_token_seconds": "Per model, for event streams: seconds from the request's first byte to the first "
                                   "event with generated output (heartbeats and empty deltas are not tokens).",
    "inter_token_latency_seconds": "Per model, for event streams: seconds between output events; per stream its "
                                   "longest gap once and the mean of the others once per gap.",
    "e2e_request_latency_seconds": "Per model, for POST requests: seconds from the request's first byte to its end.",
    "prompt_tokens_total": "Per model: prompt tokens, as the engine reported them (usage or meta_info).",
    "generation_tokens_total": "Per model: generated tokens, as the engine reported them, else the output events "
                               "of the stream counted.",
    "stream_heartbeats_total": "Per model: events of event streams that carried no output (SSE comments, empty or "
                               "role-only deltas, usage-only and keep-alive events).",
}


def _render_models(out: Exposition, models: dict) -> None:
    """The per-model families; every one declared, with no samples while no request named a model."""
    labels = sorted(models)
    for index, (name, (bounds, scale)) in enumerate(MODEL_HISTOGRAM_SHAPES.items()):
        out.histograms(name, MODEL_HELP[name], bounds,
                       [((("model", label),), *_series(out, models[label][index], scale)) for label in labels])
    for offset, name in enumerate(MODEL_COUNTERS, start=len(MODEL_HISTOGRAM_SHAPES)):
        out.counter(name, MODEL_HELP[name], [((("model", label),), models[label][offset]) for label in labels])


def _exemplar(kept: tuple | None, scale: int) -> Exemplar | None:
    if kept is None or not kept[EXEMPLAR_TRACE]:
        return None
    # Monotonic nanoseconds are the machine's (CLOCK_MONOTONIC), the same in every
    # worker: one offset turns any worker's end into wall-clock time.
    wall_ns = kept[EXEMPLAR_END] + time.time_ns() - time.monotonic_ns()
    return Exemplar("%032x" % kept[EXEMPLAR_TRACE], kept[EXEMPLAR_REQUEST] or "", kept[EXEMPLAR_RAW] / scale,
                    round(wall_ns / 1e9, 3))


def _render_stalls(out: Exposition, service: dict) -> None:
    out.counter("stalls_total", "Stalls detected by the watchdog, by outcome code and blame.",
                [((("outcome", code), ("blame", blame)), n) for (code, blame), n in sorted(service["stalls"].items())])
    out.counter("stalls_resolved_total", "Stalls that ended because the awaited byte came after all.",
                [((("outcome", code),), n) for code, n in sorted(service["stalls_resolved"].items())])
    out.gauge("stalls_open", "Requests stalled right now.", [((), service["stalls_open"])])


def _render_upstream_pool(out: Exposition, service: dict) -> None:
    pool = service["pool"]
    out.gauge("upstream_connections_open", "Upstream connections open or connecting.",
              [((), service["upstream_open"])])
    out.gauge("upstream_connections_idle", "Upstream connections idle in the pool.", [((), service["upstream_idle"])])
    out.counter("upstream_connections_opened_total", "Upstream connections opened.", [((), pool.get("opened", 0))])
    out.counter("upstream_connections_opened_ahead_total",
                "Upstream connections opened ahead of demand to keep the pool warm (pool.keep_warm); "
                "included in upstream_connections_opened_total.", [((), pool.get("opened_ahead", 0))])
    out.gauge("upstream_pool_warm_target",
              "Connections the pool keeps open: the most in use at once during the last pool.keep_warm "
              "seconds (0 when off or unused).", [((), service["warm_target"])])
    out.counter("upstream_connections_reused_total", "Requests sent on a pooled (reused) upstream connection.",
                [((), pool.get("reused", 0))])
    out.counter("upstream_stale_connections_total",
                "Pooled upstream connections the upstream closed (or broke) while idle, plus reused ones "
                "that failed under a request before any response byte (resent, or failed SRC when too "
                "large to resend).", [((), pool.get("stale", 0))])
    out.counter("upstream_retries_total", "Requests resent on a fresh connection after a stale reused one.",
                [((), pool.get("retries", 0))])
    out.counter("upstream_connect_failures_total", "Upstream connection attempts that failed or timed out.",
                [((), pool.get("connect_failed", 0))])
    learned = service["keepalive_learned"]
    out.gauge("upstream_keepalive_timeout_seconds",
              "The upstream's idle keep-alive timeout as learned from its Keep-Alive header and the idle age "
              "at which it closed pooled connections; NaN while unknown.",
              [((), math.nan if learned is None else float(learned))])
    out.gauge("upstream_keepalive_misaligned",
              "1 when pool.idle_timeout is not safely below the learned upstream keep-alive timeout, else 0.",
              [((), int(service["keepalive_misaligned"]))])
    out.gauge("client_keepalive_timeout_seconds",
              "Seconds an idle client keep-alive connection is kept (timeouts.client_keepalive).",
              [((), float(service["client_keepalive"]))])


def _render_client_connections(out: Exposition, service: dict) -> None:
    out.gauge("client_connections_open", "Client connections open.", [((), service["client_connections"])])
    _histogram(out, "client_connection_requests", "Requests carried by each closed client connection.",
               service["histograms"]["client_connection_requests"])


def render_internals(out: Exposition, numbers: dict) -> None:
    """Span export and the errors caught: from one worker's numbers or the service's."""
    spans = numbers["spans"]
    out.counter("spans_dropped_total", "Span items (a finished request's spans, or one stall span) dropped because "
                "the export queue was full or the exporter process was gone.",
                [((), spans.get("spans_dropped", 0))])
    shed = numbers["shed"] or {}
    out.counter("spans_shed_total", "Healthy requests whose spans were not exported: past "
                "tracing.healthy_max_per_second (reason=rate) or while the exporter was behind, its queue "
                "past half full (reason=backlog); errored and stalled requests are never shed.",
                [((("reason", reason),), count) for reason, count in shed.items()])
    out.counter("spans_exported_total", "Spans the exporter process delivered.",
                [((), spans.get("spans_exported", 0))])
    out.counter("spans_failed_total", "Spans the exporter process could not deliver: the collector "
                "refused or was unreachable, or the span file could not be written.",
                [((), spans.get("spans_failed", 0))])
    out.counter("access_log_lines_lost_total", "Access log lines lost: not written by the exporter process "
                "(a full disk, an unwritable file) or dropped before they reached it (its queue full, the "
                "process gone).", [((), spans.get("access_log_lines_lost", 0))])
    out.counter("observer_errors_total", "Exceptions raised by lifecycle observers (caught; proxying went on).",
                [((), numbers["observer_errors"])])
    out.counter("stall_listener_errors_total", "Exceptions raised by stall listeners (caught).",
                [((), numbers["stall_listener_errors"])])


def _render_engines(out: Exposition, engines) -> None:
    # Rendered with the scraper off too (no samples, zeros), so dashboards and the
    # docs check always see the families.
    endpoints = engines.endpoints.values() if engines is not None else ()
    errors = sorted((ep.url, ep.errors) for ep in endpoints if ep.errors)
    out.counter("engine_scrape_errors_total", "Failed or timed-out scrapes of an engine /metrics URL.",
                [((("url", url),), n) for url, n in errors])
    gauges = [((("url", ep.url), ("name", name)), value) for ep in endpoints
              for name, value in sorted(ep.gauges.items())]
    out.gauge("engine_gauge", "The engines' latest SGLang work gauges and router smg_* active/error series, "
              "summed over label sets, by URL and metric name.", gauges)
    out.gauge("engine_orphaned_requests", "Engine requests in flight that no proxied request explains, "
              "once that has lasted engines.orphan_after (outcome EOR, blame engine); 0 otherwise.",
              [((), engines.orphaned() if engines is not None else 0)])
    out.counter("engine_orphans_total", "Times engine work no proxied request explains was reported (EOR).",
                [((), engines.orphans_total if engines is not None else 0)])
    _render_engine_spans(out, getattr(engines, "receiver", None))


# The engine span receiver's counts (its ``numbers()``, the ``engine_spans`` object of
# /debug/inflight) as families: name, type, help, the key it is read from.
ENGINE_SPAN_FAMILIES = (
    ("engine_span_requests_total", "counter", "OTLP export requests the engine span receivers took.", "requests"),
    ("engine_spans_received_total", "counter", "Spans in the export requests the engine span receivers took.",
     "spans_received"),
    ("engine_spans_kept_total", "counter", "Received spans kept for the live join (SGLang's stage and "
     "scheduler-thread spans).", "spans_kept"),
    ("engine_spans_dropped_total", "counter", "Kept spans dropped for lack of room: of traces evicted while "
     "work was still at the engines (engines.span_traces).", "spans_dropped_no_room"),
    ("engine_spans_relayed_total", "counter", "Received spans handed to the proxy's span exporter, unchanged.",
     "spans_relayed"),
    ("engine_spans_relay_dropped_total", "counter", "Received spans not relayed: the span exporter's queue was full "
     "or the proxy was behind reading the receivers' process.", "relay_dropped"),
    ("engine_span_traces", "gauge", "Traces the engine span store holds now (at most engines.span_traces).",
     "traces"),
    ("engine_span_traces_evicted_total", "counter", "Traces the engine span store evicted to make room for new "
     "ones.", "traces_evicted"),
)


def _render_engine_spans(out: Exposition, receiver) -> None:
    """The engine span receiver's counts: every family declared, with samples only while
    the receivers are on (one set for the service: they run once, where the scraper does)."""
    numbers = receiver.numbers() if receiver is not None else None
    for name, kind, help_text, key in ENGINE_SPAN_FAMILIES:
        samples = [] if numbers is None else [((), numbers.get(key) or 0)]
        (out.counter if kind == "counter" else out.gauge)(name, help_text, samples)
    rejected = (numbers or {}).get("rejected") or {}  # every reason, zeros included, once the receivers report
    out.counter("engine_span_requests_rejected_total", "OTLP export requests the engine span receivers refused, by "
                "reason: malformed (400, INVALID_ARGUMENT), too_large (413, RESOURCE_EXHAUSTED), "
                "unsupported_media_type (415).",
                [((("reason", reason),), n) for reason, n in sorted(rejected.items())])


def _render_workers(out: Exposition, workers: dict) -> None:
    out.gauge("workers", "Worker processes serving the listen port.", [((), workers["count"])])
    out.gauge("workers_answering", "Workers whose numbers this scrape holds as of now; the others count with their "
              "last answer in counters and histograms and are left out of the gauges.",
              [((), workers["answering"])])
    out.counter("worker_answers_late_total", "Times a worker did not answer the admin side within its deadline "
                "(a scrape, /debug/inflight, /healthz or the engine check), which then went on without it.",
                [((), workers["late_total"])])
