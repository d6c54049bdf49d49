"""Prometheus metrics: counted when something ends, rendered when scraped.

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
* State and counts that already live elsewhere (requests in flight by phase, the
  upstream pool, open client connections, open stalls, span export, observer
  errors) are read from their owners at scrape time, so there is no second copy
  that could drift.

``render`` writes the Prometheus text exposition format, version 0.0.4: per family
a ``# HELP`` and a ``# TYPE`` line, then one sample per line; histograms as
cumulative ``_bucket{le=...}`` samples ending with ``+Inf``, then ``_sum`` and
``_count``.

The numbers are per process: with ``workers > 1`` each worker counts only its own
traffic, and a scrape reaches whichever worker accepts it.

This module may import ``lifecycle`` only; the server context, the watchdog and
the span exporter are read through the attributes named in ``ProxyMetrics``.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Callable, Iterable

from ..lifecycle.flags import BY_CODE
from ..lifecycle.machine import WAITING_TURN, Phase, in_flight_phase
from ..lifecycle.marks import MARK
from ..lifecycle.stall import Judgement
from ..lifecycle.timeline import ClientConnectionRecord, RequestRecord, StallEntry

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "traceproxy_"

# Seconds: from a health check (milliseconds) to a long generation (minutes).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)
# Seconds between upstream reads: decode pacing is milliseconds to tens of
# milliseconds; a stall is seconds.
CHUNK_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
NS_PER_S = 1_000_000_000
CONNECTION_REQUEST_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)

# A request in ``ctx.in_flight`` has not finished, so it is never in DONE.
IN_FLIGHT_PHASES = tuple(phase.value for phase in Phase if phase is not Phase.DONE) + (WAITING_TURN,)


# ----------------------------------------------------------------------------------
# Counting
# ----------------------------------------------------------------------------------
class Histogram:
    """Fixed bucket bounds; counts per bucket, not cumulative (that is done at render).

    Values are counted in raw units, ``scale`` of them per exported unit: the
    latency histograms count integer nanoseconds (scale 1e9), so the per-request
    path adds integers instead of dividing each duration into float seconds.
    """

    __slots__ = ("bounds", "raw_bounds", "scale", "bucket_counts", "raw_sum")

    def __init__(self, bounds: Iterable[float], scale: int = 1) -> None:
        self.bounds = tuple(float(bound) for bound in bounds)
        # Rounded: 0.005 s is 5_000_000 ns exactly, not 5_000_000.000000001.
        self.raw_bounds = self.bounds if scale == 1 else tuple(round(bound * scale) for bound in self.bounds)
        self.scale = scale
        self.bucket_counts = [0] * (len(self.bounds) + 1)  # the last bucket is +Inf
        self.raw_sum = 0

    def observe(self, value: float) -> None:
        """Count ``value``, in exported units."""
        self.count_raw(value * self.scale if self.scale != 1 else value)

    def count_raw(self, raw: int | float) -> None:
        """Count ``raw``, in raw units (ns for a latency histogram)."""
        # bisect_left: a value equal to a bound belongs to that bound's bucket (le is <=).
        self.bucket_counts[bisect.bisect_left(self.raw_bounds, raw)] += 1
        self.raw_sum += raw

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


class ProxyMetrics:
    """Lifecycle observer, stall listener and connection-closed listener in one.

    ``ctx`` needs ``in_flight`` (id -> RequestRecord), ``connections`` (sized),
    ``settings``, ``pool`` (``open_count``, ``idle``, ``stats``, ``keepalive``,
    ``warm_target``) and ``fanout`` (``observer_errors``). ``watchdog`` needs ``open`` and ``listener_errors``;
    ``span_export`` needs ``stats``, ``tracing`` ``shed`` (reason -> count). Any may be None.
    """

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
        self.request_duration = Histogram(LATENCY_BUCKETS, NS_PER_S)
        self.time_to_first_byte = Histogram(LATENCY_BUCKETS, NS_PER_S)
        self.time_to_first_chunk = Histogram(LATENCY_BUCKETS, NS_PER_S)
        self.chunk_max_gap = Histogram(CHUNK_GAP_BUCKETS, NS_PER_S)
        self.client_connection_requests = Histogram(CONNECTION_REQUEST_BUCKETS)
        self.engines = None  # EngineScraper, set by the composition root when scraping is on

    # -- lifecycle observer ------------------------------------------------------
    def on_done(self, record: RequestRecord) -> None:
        key = (record.status, record.outcome.code)
        self.requests[key] = self.requests.get(key, 0) + 1
        marks = record.marks
        start = marks.get(MARK.FIRST_DOWNSTREAM_RX_BYTE)
        if start is None:
            return
        self.request_duration.count_raw(record.end_ns - start)
        head_sent = marks.get(MARK.FIRST_DOWNSTREAM_TX_BYTE)
        if head_sent is not None:
            self.time_to_first_byte.count_raw(head_sent - start)
        body_sent = marks.get(MARK.FIRST_DOWNSTREAM_TX_BODY_BYTE)
        if body_sent is not None:
            self.time_to_first_chunk.count_raw(body_sent - start)
        # One read has no gap; observing 0 for it would drag the distribution down.
        if record.upstream_rx_chunks > 1:
            self.chunk_max_gap.count_raw(record.max_chunk_gap_ns)

    # -- stall listener ----------------------------------------------------------
    def on_stall(self, record: RequestRecord, judgement: Judgement, entry: StallEntry) -> None:
        self.stalls[(entry.code, judgement.verdict.outcome.blame.value)] += 1

    def on_stall_resolved(self, record: RequestRecord, entry: StallEntry) -> None:
        self.stalls_resolved[entry.code] += 1

    # -- connection-closed listener ----------------------------------------------
    def on_client_connection_closed(self, connection: ClientConnectionRecord) -> None:
        self.client_connection_requests.observe(connection.requests_started)

    # -- scrape --------------------------------------------------------------------
    def render(self) -> str:
        out = Exposition()
        self._render_requests(out)
        self._render_latencies(out)
        self._render_stalls(out)
        self._render_upstream_pool(out)
        self._render_client_connections(out)
        self._render_internals(out)
        self._render_engines(out)
        return out.text()

    def _render_requests(self, out: "Exposition") -> None:
        phases = phase_counts(self.ctx.in_flight.values())
        out.gauge("requests_in_flight", "Requests in flight, by the phase they are in.",
                  [((("phase", phase),), n) for phase, n in phases.items()])
        out.counter("requests_total", "Finished requests by response status (empty when none was sent), "
                    "outcome code and blame.",
                    [((("status", status), ("outcome", code), ("blame", blame)), n)
                     for (status, code, blame), n in sorted(self._requests_by_label().items())])

    def _requests_by_label(self) -> Counter[tuple[str, str, str]]:
        labelled: Counter[tuple[str, str, str]] = Counter()
        for (status, code), n in self.requests.items():
            labelled[("" if status is None else str(status), code, BY_CODE[code].blame.value)] += n
        return labelled

    def _render_latencies(self, out: "Exposition") -> None:
        out.histogram("request_duration_seconds",
                      "Seconds from the request's first byte to the end of the request.", self.request_duration)
        out.histogram("time_to_first_byte_seconds",
                      "Seconds from the request's first byte to the first response byte sent to the client "
                      "(the upstream's response head, or the proxy's own error reply).", self.time_to_first_byte)
        out.histogram("time_to_first_chunk_seconds",
                      "Seconds from the request's first byte to the first response body byte sent to the client.",
                      self.time_to_first_chunk)
        out.histogram("response_chunk_max_gap_seconds",
                      "Per request with two or more upstream body reads: its largest gap between reads, "
                      "observed once when it ends.", self.chunk_max_gap)

    def _render_stalls(self, out: "Exposition") -> None:
        out.counter("stalls_total", "Stalls detected by the watchdog, by outcome code and blame.",
                    [((("outcome", code), ("blame", blame)), n) for (code, blame), n in sorted(self.stalls.items())])
        out.counter("stalls_resolved_total", "Stalls that ended because the awaited byte came after all.",
                    [((("outcome", code),), n) for code, n in sorted(self.stalls_resolved.items())])
        open_stalls = len(self.watchdog.open) if self.watchdog is not None else 0
        out.gauge("stalls_open", "Requests stalled right now.", [((), open_stalls)])

    def _render_upstream_pool(self, out: "Exposition") -> None:
        pool = self.ctx.pool
        stats = pool.stats
        out.gauge("upstream_connections_open", "Upstream connections open or connecting.",
                  [((), pool.open_count)])
        out.gauge("upstream_connections_idle", "Upstream connections idle in the pool.", [((), len(pool.idle))])
        out.counter("upstream_connections_opened_total", "Upstream connections opened.",
                    [((), stats["opened"])])
        out.counter("upstream_connections_opened_ahead_total",
                    "Upstream connections opened ahead of demand to keep the pool warm (pool.keep_warm); "
                    "included in upstream_connections_opened_total.", [((), stats["opened_ahead"])])
        out.gauge("upstream_pool_warm_target",
                  "Connections the pool keeps open: the most in use at once during the last pool.keep_warm "
                  "seconds (0 when off or unused).", [((), pool.warm_target)])
        out.counter("upstream_connections_reused_total", "Requests sent on a pooled (reused) upstream connection.",
                    [((), stats["reused"])])
        out.counter("upstream_stale_connections_total",
                    "Pooled upstream connections the upstream closed (or broke) while idle, plus reused ones "
                    "that failed under a request before any response byte (resent, or failed SRC when too "
                    "large to resend).",
                    [((), stats["closed_by_upstream_while_idle"] + stats["stale_retried"] + stats["stale_not_retried"])])
        out.counter("upstream_retries_total", "Requests resent on a fresh connection after a stale reused one.",
                    [((), stats["stale_retried"])])
        out.counter("upstream_connect_failures_total", "Upstream connection attempts that failed or timed out.",
                    [((), stats["connect_failed"])])
        keepalive = pool.keepalive
        learned = keepalive.learned
        out.gauge("upstream_keepalive_timeout_seconds",
                  "The upstream's idle keep-alive timeout as learned from its Keep-Alive header and the idle age "
                  "at which it closed pooled connections; NaN while unknown.",
                  [((), math.nan if learned is None else float(learned))])
        out.gauge("upstream_keepalive_misaligned",
                  "1 when pool.idle_timeout is not safely below the learned upstream keep-alive timeout, else 0.",
                  [((), int(keepalive.misaligned))])
        out.gauge("client_keepalive_timeout_seconds",
                  "Seconds an idle client keep-alive connection is kept (timeouts.client_keepalive).",
                  [((), float(self.ctx.settings.timeouts.client_keepalive))])

    def _render_client_connections(self, out: "Exposition") -> None:
        out.gauge("client_connections_open", "Client connections open.", [((), len(self.ctx.connections))])
        out.histogram("client_connection_requests", "Requests carried by each closed client connection.",
                      self.client_connection_requests)

    def _render_internals(self, out: "Exposition") -> None:
        spans = self.span_export.stats if self.span_export is not None else {}
        out.counter("spans_dropped_total", "Span items (a finished request's spans, or one stall span) dropped because the export queue "
                    "was full or the exporter process was gone.",
                    [((), spans.get("spans_dropped", 0))])
        # No samples when tracing is off: the observer may still exist for the access
        # log alone, and never sheds then.
        shed = self.tracing.shed if self.tracing is not None and self.tracing.spans else {}
        out.counter("spans_shed_total", "Healthy requests whose spans were not exported: past "
                    "tracing.healthy_max_per_second (reason=rate) or while the exporter was behind, its queue "
                    "past half full (reason=backlog); errored and stalled requests are never shed.",
                    [((("reason", reason),), count) for reason, count in shed.items()])
        out.counter("spans_exported_total", "Spans the exporter process delivered.",
                    [((), spans.get("spans_exported", 0))])
        out.counter("spans_failed_total", "Spans the exporter process could not deliver: the collector "
                    "refused or was unreachable, or the span file could not be written.",
                    [((), spans.get("spans_failed", 0))])
        out.counter("access_log_lines_lost_total", "Access log lines the exporter process could not write "
                    "(a full disk, an unwritable file).",
                    [((), spans.get("access_log_lines_lost", 0))])
        out.counter("observer_errors_total", "Exceptions raised by lifecycle observers (caught; proxying went on).",
                    [((), self.ctx.fanout.observer_errors)])
        listener_errors = self.watchdog.listener_errors if self.watchdog is not None else 0
        out.counter("stall_listener_errors_total", "Exceptions raised by stall listeners (caught).",
                    [((), listener_errors)])


    def _render_engines(self, out: "Exposition") -> None:
        # Rendered with the scraper off too (no samples, zeros), so dashboards and the
        # docs check always see the families.
        engines = self.engines
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


def phase_counts(records: Iterable[RequestRecord]) -> dict[str, int]:
    """Every in-flight phase, zeros included, so dashboards always see the series; a
    pipelined request behind others counts as waiting its turn, as /debug/inflight says."""
    counts = dict.fromkeys(IN_FLIGHT_PHASES, 0)
    for record in records:
        phase = in_flight_phase(record)
        counts[phase] = counts.get(phase, 0) + 1
    return counts


# ----------------------------------------------------------------------------------
# The text exposition format, version 0.0.4
# ----------------------------------------------------------------------------------
Labels = tuple[tuple[str, str], ...]


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


class Exposition:
    """Builds the scrape body; names get ``PREFIX`` here, callers pass the rest."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def counter(self, name: str, help_text: str, samples: Iterable[tuple[Labels, float]]) -> None:
        self._family(name, "counter", help_text, samples)

    def gauge(self, name: str, help_text: str, samples: Iterable[tuple[Labels, float]]) -> None:
        self._family(name, "gauge", help_text, samples)

    def histogram(self, name: str, help_text: str, histogram: Histogram) -> None:
        full = PREFIX + name
        self._header(full, "histogram", help_text)
        for bound, at_or_below in histogram.cumulative():
            self._sample(full + "_bucket", (("le", format_value(bound)),), at_or_below)
        self._sample(full + "_sum", (), histogram.sum)
        self._sample(full + "_count", (), histogram.count)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"

    def _family(self, name: str, kind: str, help_text: str, samples: Iterable[tuple[Labels, float]]) -> None:
        full = PREFIX + name
        self._header(full, kind, help_text)
        for labels, value in samples:
            self._sample(full, labels, value)

    def _header(self, full_name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {full_name} {escape_help(help_text)}")
        self.lines.append(f"# TYPE {full_name} {kind}")

    def _sample(self, full_name: str, labels: Labels, value: float) -> None:
        self.lines.append(f"{full_name}{format_labels(labels)} {format_value(value)}")


def format_labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{name}="{escape_label_value(value)}"' for name, value in labels) + "}"


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
