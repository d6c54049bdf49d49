"""Prometheus metrics: counted when something ends, read when scraped.

Theory of operation
-------------------
Two kinds of numbers, kept in two ways:

* Events the proxy does not count itself (finished requests by status, outcome and
  blame; stalls; latency histograms; requests per client connection) are counted
  here, by hooks that run once per event: ``on_done`` once per request, ``on_stall``
  and ``on_stall_resolved`` once per stall, ``on_client_connection_closed`` once per
  client connection. Each costs a dict increment or a bisect into fixed bucket
  bounds. There is no ``on_mark`` and nothing runs per chunk: the largest gap
  between upstream reads is kept on the record by the proxy and observed once, here,
  when the request ends.
* State and counts that already live elsewhere (the upstream pool, open client
  connections, open stalls, span export, observer errors) are read from their owners
  when asked, so there is no second copy that could drift.

Asked, ``numbers()`` copies all of it into plain data (dicts, lists, tuples, ints;
what ``marshal`` carries between processes) in one pass of the event loop, a few
microseconds. The requests in flight by phase are counted by the caller, in slices
(``observe.worker_view``), since that pass grows with the requests in flight.
``observe.service_metrics`` merges the numbers of every worker and writes the
exposition; a service of one worker is merged from one.

Per model (``ModelNumbers``, one per ``model`` label, bounded by ``genai.ModelLabels``):
for each POST request, its end-to-end latency and token counts; for an event stream,
its time to first token, inter-token latency and heartbeats. All from the record in
``on_done``: the proxy stamps the first and last output events and the longest gap
between two of them as they pass, and the inter-token histogram gets two observations
per stream (its longest gap, and the mean of the other gaps counted once per gap; see
``observe_inter_token``), so its ``_sum`` and ``_count`` are those of every gap.

Exemplars: each latency histogram keeps, per bucket, one request that landed in it
(its trace id, request id, value and end), preferring a failed or stalled one for
``EXEMPLAR_PREFER_FAILED_NS`` over healthier ones that come later.

This module may import ``lifecycle`` only; the server context, the watchdog and
the span exporter are read through the attributes named in ``ProxyMetrics``.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Callable, Iterable

from ..lifecycle.flags import Flag
from ..lifecycle.machine import WAITING_TURN, Phase, in_flight_phase
from ..lifecycle.marks import MARK
from ..lifecycle.stall import Judgement
from ..lifecycle.timeline import ClientConnectionRecord, RequestRecord, StallEntry
from .exposition import CONTENT_TYPE, PREFIX, Exposition, escape_help, escape_label_value, format_labels, format_value
from .genai import DEFAULT_MAX_MODELS, ModelLabels, request_model, usage_in_body

__all__ = ["CONTENT_TYPE", "PREFIX", "Exposition", "Histogram", "ModelNumbers", "ProxyMetrics", "escape_help",
           "escape_label_value", "format_labels", "format_value", "observe_inter_token", "phase_counts",
           "prometheus_totals"]

# Seconds: from a health check (milliseconds) to a long generation (minutes).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)
# Seconds between upstream reads: decode pacing is milliseconds to tens of
# milliseconds; a stall is seconds.
CHUNK_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
NS_PER_S = 1_000_000_000
CONNECTION_REQUEST_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)
# The per-model histograms: the union of the bounds vLLM (vllm/v1/metrics/loggers.py,
# PrometheusStatLogger) and SGLang (python/sglang/srt/metrics/collector.py,
# TokenizerMetricsCollector) use for the same quantity, so every le= either engine's
# dashboards and alerts ask for is a bucket here too.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.2, 0.25, 0.4, 0.5, 0.6, 0.75, 0.8, 1.0, 2.0,
                2.5, 4.0, 5.0, 6.0, 7.5, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 160.0, 200.0, 400.0, 640.0,
                2560.0)
INTER_TOKEN_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.06,
                       0.075, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.75, 0.8, 1.0, 2.0, 2.5, 4.0, 5.0, 6.0,
                       7.5, 8.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.0, 2.5, 4.0, 5.0, 6.0, 8.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 80.0, 100.0, 120.0, 200.0, 240.0, 400.0, 480.0, 600.0, 960.0, 1200.0, 1800.0,
               1920.0, 2400.0, 7680.0)
# A failed or stalled request stays a bucket's exemplar this long before a healthy
# one that lands in the same bucket takes its place: a scrape a minute apart still
# finds the request worth opening in the trace view.
EXEMPLAR_PREFER_FAILED_NS = 60 * NS_PER_S

# A request in ``ctx.in_flight`` has not finished, so it is never in DONE.
IN_FLIGHT_PHASES = tuple(phase.value for phase in Phase if phase is not Phase.DONE) + (WAITING_TURN,)

# The histograms every worker keeps: name -> (bucket bounds in exported units, raw units per exported unit).
HISTOGRAM_SHAPES: dict[str, tuple[tuple[float, ...], int]] = {
    "request_duration_seconds": (LATENCY_BUCKETS, NS_PER_S),
    "time_to_first_byte_seconds": (LATENCY_BUCKETS, NS_PER_S),
    "time_to_first_chunk_seconds": (LATENCY_BUCKETS, NS_PER_S),
    "response_chunk_max_gap_seconds": (CHUNK_GAP_BUCKETS, NS_PER_S),
    "client_connection_requests": (CONNECTION_REQUEST_BUCKETS, 1),
}
# Per model label, in ``ModelNumbers.numbers()`` order, then the three token and event counters.
MODEL_HISTOGRAM_SHAPES: dict[str, tuple[tuple[float, ...], int]] = {
    "time_to_first_token_seconds": (TTFT_BUCKETS, NS_PER_S),
    "inter_token_latency_seconds": (INTER_TOKEN_BUCKETS, NS_PER_S),
    "e2e_request_latency_seconds": (E2E_BUCKETS, NS_PER_S),
}
MODEL_COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "stream_heartbeats_total")

# An exemplar as kept and carried: (raw value, trace id, request id, end ns (monotonic), failed).
EXEMPLAR_RAW, EXEMPLAR_TRACE, EXEMPLAR_REQUEST, EXEMPLAR_END, EXEMPLAR_FAILED = range(5)


def replaces(new: tuple, held: tuple | None) -> bool:
    """Whether exemplar ``new`` (the later one) takes the place of ``held``: a failed
    one always does; a healthy one unless ``held`` failed within the preference window."""
    return (held is None or new[EXEMPLAR_FAILED] or not held[EXEMPLAR_FAILED]
            or new[EXEMPLAR_END] - held[EXEMPLAR_END] > EXEMPLAR_PREFER_FAILED_NS)


# ----------------------------------------------------------------------------------
# Counting
# ----------------------------------------------------------------------------------
class Histogram:
    """Fixed bucket bounds; counts per bucket, not cumulative (that is done at render).

    Values are counted in raw units, ``scale`` of them per exported unit: the
    latency histograms count integer nanoseconds (scale 1e9), so the per-request
    path adds integers instead of dividing each duration into float seconds.
    With ``exemplars``, ``count_raw_with_exemplar`` also keeps one request per bucket.
    """

    __slots__ = ("bounds", "raw_bounds", "scale", "bucket_counts", "raw_sum", "exemplars")

    def __init__(self, bounds: Iterable[float], scale: int = 1, exemplars: bool = False) -> None:
        self.bounds = tuple(float(bound) for bound in bounds)
        # Rounded: 0.005 s is 5_000_000 ns exactly, not 5_000_000.000000001.
        self.raw_bounds = self.bounds if scale == 1 else tuple(round(bound * scale) for bound in self.bounds)
        self.scale = scale
        self.bucket_counts = [0] * (len(self.bounds) + 1)  # the last bucket is +Inf
        self.raw_sum = 0
        self.exemplars: list[tuple | None] | None = [None] * (len(self.bounds) + 1) if exemplars else None

    def observe(self, value: float) -> None:
        """Count ``value``, in exported units."""
        self.count_raw(value * self.scale if self.scale != 1 else value)

    def count_raw(self, raw: int | float) -> None:
        """Count ``raw``, in raw units (ns for a latency histogram)."""
        # bisect_left: a value equal to a bound belongs to that bound's bucket (le is <=).
        self.bucket_counts[bisect.bisect_left(self.raw_bounds, raw)] += 1
        self.raw_sum += raw

    def count_raw_with_exemplar(self, raw: int, trace_id: int, request_id: str, end_ns: int, failed: bool) -> None:
        """``count_raw``, keeping this request as its bucket's exemplar (see ``replaces``)."""
        index = bisect.bisect_left(self.raw_bounds, raw)
        self.bucket_counts[index] += 1
        self.raw_sum += raw
        held = self.exemplars[index]
        if held is None or failed or not held[EXEMPLAR_FAILED] or end_ns - held[EXEMPLAR_END] > EXEMPLAR_PREFER_FAILED_NS:
            self.exemplars[index] = (raw, trace_id, request_id, end_ns, failed)

    def count_many_with_exemplar(self, raw_each: int | float, times: int, raw_total: int, trace_id: int,
                                 request_id: str, end_ns: int, failed: bool) -> None:
        """``times`` observations of ``raw_each`` that add up to ``raw_total`` (exact, where
        ``raw_each * times`` would round), in one bisect, with its exemplar."""
        index = bisect.bisect_left(self.raw_bounds, raw_each)
        self.bucket_counts[index] += times
        self.raw_sum += raw_total
        held = self.exemplars[index]
        if (held is None or failed or not held[EXEMPLAR_FAILED]
                or end_ns - held[EXEMPLAR_END] > EXEMPLAR_PREFER_FAILED_NS):
            self.exemplars[index] = (raw_each, trace_id, request_id, end_ns, failed)

    @property
    def sum(self) -> float:
        return self.raw_sum / self.scale if self.scale != 1 else self.raw_sum

    @property
    def count(self) -> int:
        return sum(self.bucket_counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it), ending with (+inf, count)."""
        running, out = 0, []
        for bound, in_bucket in zip((*self.bounds, math.inf), self.bucket_counts):
            running += in_bucket
            out.append((bound, running))
        return out

    def numbers(self) -> list:
        """[bucket counts, raw sum, exemplars or None]: plain data, copied."""
        return [list(self.bucket_counts), self.raw_sum, list(self.exemplars) if self.exemplars is not None else None]


class ModelNumbers:
    """What is counted per ``model`` label: three latency histograms (with exemplars) and
    the token and heartbeat counts."""

    __slots__ = ("ttft", "inter_token", "e2e", "prompt_tokens", "generation_tokens", "heartbeats")

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS, NS_PER_S, exemplars=True)
        self.inter_token = Histogram(INTER_TOKEN_BUCKETS, NS_PER_S, exemplars=True)
        self.e2e = Histogram(E2E_BUCKETS, NS_PER_S, exemplars=True)
        self.prompt_tokens = self.generation_tokens = self.heartbeats = 0

    def numbers(self) -> list:
        """[ttft, inter-token, e2e histogram numbers, prompt tokens, generation tokens, heartbeats]."""
        return [self.ttft.numbers(), self.inter_token.numbers(), self.e2e.numbers(),
                self.prompt_tokens, self.generation_tokens, self.heartbeats]


def observe_inter_token(histogram: Histogram, first_ns: int, last_ns: int, max_gap_ns: int, output_events: int,
                        trace_id: int, request_id: str, end_ns: int, failed: bool) -> None:
    """The gaps between a stream's ``output_events`` output events, observed in two
    points: its longest gap once, and the mean of the others once per gap. ``_sum`` and
    ``_count`` are exactly those of every gap; a stall inside a stream stands out as its
    own observation, where a mean would hide it. (SGLang observes each interval between
    its outputs the same way, as its mean per token counted once per token.)"""
    gaps = output_events - 1
    if gaps < 1:
        return
    total = last_ns - first_ns
    longest = max_gap_ns if 0 < max_gap_ns <= total else 0
    if gaps == 1 or not longest:
        histogram.count_many_with_exemplar(total // gaps, gaps, total, trace_id, request_id, end_ns, failed)
        return
    histogram.count_raw_with_exemplar(longest, trace_id, request_id, end_ns, failed)
    rest = total - longest
    histogram.count_many_with_exemplar(rest // (gaps - 1), gaps - 1, rest, trace_id, request_id, end_ns, failed)


class ProxyMetrics:
    """Lifecycle observer, stall listener and connection-closed listener in one.

    ``ctx`` needs ``in_flight`` (id -> RequestRecord), ``connections`` (sized),
    ``settings``, ``pool`` (``open_count``, ``idle``, ``stats``, ``keepalive``,
    ``warm_target``), ``fanout`` (``observer_errors``) and ``shutting_down``.
    ``watchdog`` needs ``open`` and ``listener_errors``; ``span_export`` needs
    ``stats``, ``tracing`` ``shed`` (reason -> count). Any may be None.
    """

    # The model label reads the end of a long request body too, where the OpenAI SDKs
    # write "model" (after the messages): the proxy keeps that much of it (see Fanout).
    request_body_tail_bytes = 4096

    def __init__(self, ctx, watchdog=None, span_export=None, tracing=None) -> None:
        self.ctx = ctx
        self.watchdog = watchdog
        self.span_export = span_export
        self.tracing = tracing
        # Finished requests by (status or None, outcome code): counted as cheaply as
        # a dict can on every request; turned into label values when rendered.
        self.requests: dict[tuple[int | None, str], int] = {}
        self.stalls: Counter[tuple[str, str]] = Counter()  # (outcome, blame)
        self.stalls_resolved: Counter[str] = Counter()  # outcome
        self.request_duration = Histogram(LATENCY_BUCKETS, NS_PER_S, exemplars=True)
        self.time_to_first_byte = Histogram(LATENCY_BUCKETS, NS_PER_S, exemplars=True)
        self.time_to_first_chunk = Histogram(LATENCY_BUCKETS, NS_PER_S, exemplars=True)
        self.chunk_max_gap = Histogram(CHUNK_GAP_BUCKETS, NS_PER_S, exemplars=True)
        self.client_connection_requests = Histogram(CONNECTION_REQUEST_BUCKETS)
        metrics_settings = getattr(ctx.settings, "metrics", None)
        self.model_labels = ModelLabels(getattr(metrics_settings, "max_models", DEFAULT_MAX_MODELS))
        self.models: dict[str, ModelNumbers] = {}
        self.engines = None  # EngineScraper, set by the composition root when this process scrapes the engines

    # -- lifecycle observer ------------------------------------------------------
    def on_done(self, record: RequestRecord) -> None:
        key = (record.status, record.outcome.code)
        self.requests[key] = self.requests.get(key, 0) + 1
        marks = record.marks
        start = marks.get(MARK.FIRST_DOWNSTREAM_RX_BYTE)
        if start is None:
            return
        end, trace_id, request_id = record.end_ns, record.trace_id, record.request_id
        # Failed as the tracer keeps spans for (TracingObserver._keep_spans), written out: this
        # runs for every request.
        failed = record.outcome is not Flag.OK or (record.status or 0) >= 500 or bool(record.stalls)
        self.request_duration.count_raw_with_exemplar(end - start, trace_id, request_id, end, failed)
        head_sent = marks.get(MARK.FIRST_DOWNSTREAM_TX_BYTE)
        if head_sent is not None:
            self.time_to_first_byte.count_raw_with_exemplar(head_sent - start, trace_id, request_id, end, failed)
        body_sent = marks.get(MARK.FIRST_DOWNSTREAM_TX_BODY_BYTE)
        if body_sent is not None:
            self.time_to_first_chunk.count_raw_with_exemplar(body_sent - start, trace_id, request_id, end, failed)
        # One read has no gap; observing 0 for it would drag the distribution down.
        if record.upstream_rx_chunks > 1:
            self.chunk_max_gap.count_raw_with_exemplar(record.max_chunk_gap_ns, trace_id, request_id, end, failed)
        if record.method == "POST":
            self._count_per_model(record, start, end, failed)

    # POST requests only: health checks, model lists and scrapes are GETs, name no model,
    # and would crowd the "unknown" series of a model server's latencies.
    def _count_per_model(self, record: RequestRecord, start: int, end: int, failed: bool) -> None:
        label = self.model_labels.label(request_model(record.request_body_head, record.request_body_tail,
                                                      record.downstream_rx_body_bytes))
        numbers = self.models.get(label)
        if numbers is None:
            numbers = self.models[label] = ModelNumbers()
        trace_id, request_id = record.trace_id, record.request_id
        numbers.e2e.count_raw_with_exemplar(end - start, trace_id, request_id, end, failed)
        events = record.stream_events  # an event stream's scanner
        if events is not None:
            stream = events.summary()
            numbers.heartbeats += stream.heartbeats
            first = record.first_token_ns
            if first is not None:
                numbers.ttft.count_raw_with_exemplar(first - start, trace_id, request_id, end, failed)
                observe_inter_token(numbers.inter_token, first, record.last_token_ns, record.max_token_gap_ns,
                                    stream.output_events, trace_id, request_id, end, failed)
            # token_counts(stream, ...), inlined: this runs for every stream.
            prompt, generated = stream.prompt_tokens, stream.completion_tokens
            if generated is None:
                generated = stream.output_events
        elif record.status == 200:
            prompt, generated = usage_in_body(record.response_tail)
        else:  # a refusal or an error: no usage to look for
            return
        if prompt:
            numbers.prompt_tokens += prompt
        if generated:
            numbers.generation_tokens += generated

    # -- stall listener ----------------------------------------------------------
    def on_stall(self, record: RequestRecord, judgement: Judgement, entry: StallEntry) -> None:
        self.stalls[(entry.code, judgement.verdict.outcome.blame.value)] += 1

    def on_stall_resolved(self, record: RequestRecord, entry: StallEntry) -> None:
        self.stalls_resolved[entry.code] += 1

    # -- connection-closed listener ----------------------------------------------
    def on_client_connection_closed(self, connection: ClientConnectionRecord) -> None:
        self.client_connection_requests.observe(connection.requests_started)

    # -- asked -------------------------------------------------------------------
    def numbers(self) -> dict:
        """This process's counters, histograms and the gauges its owners hold, as plain
        data (see ``observe.service_metrics`` for the keys). Everything but the
        requests in flight by phase, which the caller counts (``worker_view``)."""
        ctx = self.ctx
        pool = ctx.pool
        stats = pool.stats
        learned = pool.keepalive.learned
        return {
            "requests": dict(self.requests),
            "stalls": dict(self.stalls),
            "stalls_resolved": dict(self.stalls_resolved),
            "histograms": {
                "request_duration_seconds": self.request_duration.numbers(),
                "time_to_first_byte_seconds": self.time_to_first_byte.numbers(),
                "time_to_first_chunk_seconds": self.time_to_first_chunk.numbers(),
                "response_chunk_max_gap_seconds": self.chunk_max_gap.numbers(),
                "client_connection_requests": self.client_connection_requests.numbers(),
            },
            "models": {label: numbers.numbers() for label, numbers in self.models.items()},
            "pool": {
                "opened": stats["opened"], "opened_ahead": stats["opened_ahead"], "reused": stats["reused"],
                "stale": stats["closed_by_upstream_while_idle"] + stats["stale_retried"] + stats["stale_not_retried"],
                "retries": stats["stale_retried"], "connect_failed": stats["connect_failed"],
            },
            **self._internal_numbers(),
            "stalls_open": len(self.watchdog.open) if self.watchdog is not None else 0,
            "client_connections": len(ctx.connections),
            "upstream_open": pool.open_count,
            "upstream_idle": len(pool.idle),
            "warm_target": pool.warm_target,
            "keepalive_learned": None if learned is None else float(learned),
            "keepalive_misaligned": bool(pool.keepalive.misaligned),
            "client_keepalive": float(ctx.settings.timeouts.client_keepalive),
        }

    def _internal_numbers(self) -> dict:
        spans = self.span_export.stats if self.span_export is not None else {}
        # No samples when tracing is off: the observer may still exist for the access
        # log alone, and never sheds then.
        tracing = self.tracing
        return {
            "spans": {key: spans.get(key, 0) for key in
                      ("spans_dropped", "spans_exported", "spans_failed", "access_log_lines_lost")},
            "shed": dict(tracing.shed) if tracing is not None and tracing.spans else None,
            "observer_errors": self.ctx.fanout.observer_errors,
            "stall_listener_errors": self.watchdog.listener_errors if self.watchdog is not None else 0,
        }

    def render(self) -> str:
        """This process alone, in the text format, counted in one pass (for tools and
        tests; the admin listener goes through ``worker_view`` and ``service_metrics``)."""
        from .service_metrics import merge, render

        numbers = self.numbers()
        numbers["in_flight"] = phase_counts(self.ctx.in_flight.values())
        out = Exposition()
        render(out, merge([numbers]), self.engines)
        return out.text()

    def _render_internals(self, out: Exposition) -> None:
        """The span export and error counters alone, into ``out``."""
        from .service_metrics import render_internals

        render_internals(out, ProxyMetrics._internal_numbers(self))


def phase_counts(records: Iterable[RequestRecord]) -> dict[str, int]:
    """Every in-flight phase, zeros included, so dashboards always see the series; a
    pipelined request behind others counts as waiting its turn, as /debug/inflight says."""
    counts = dict.fromkeys(IN_FLIGHT_PHASES, 0)
    for record in records:
        phase = in_flight_phase(record)
        counts[phase] = counts.get(phase, 0) + 1
    return counts


# ----------------------------------------------------------------------------------
# Reading another server's exposition (the engines')
# ----------------------------------------------------------------------------------
def prometheus_totals(text: str, keep: Callable[[str], bool] | None = None,
                      finite_only: bool = False) -> dict[str, float]:
    """Each metric name of a Prometheus text body with its samples summed over label
    sets; with ``keep``, only the names it accepts. A malformed line is skipped, so one
    bad series never costs the rest; a sample's trailing timestamp is ignored. With
    ``finite_only``, NaN and infinite samples are skipped: for totals that are counts of
    work, NaN says nothing and would make every total it joins NaN."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            # The last "}" closes the labels: a value or timestamp never holds one.
            rest = rest.rpartition("}")[2]
        else:
            name, _, rest = line.replace("\t", " ").partition(" ")  # tokens are split by blanks or tabs
        name = name.strip()
        if keep is not None and not keep(name):
            continue
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if finite_only and not math.isfinite(value):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


