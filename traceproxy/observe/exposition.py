"""The scrape body in either format a scraper may ask for.

* Prometheus text, version 0.0.4 (the default): per family a ``# HELP`` and a
  ``# TYPE`` line, then one sample per line; histograms as cumulative
  ``_bucket{le=...}`` samples ending with ``+Inf``, then ``_sum`` and ``_count``.
* OpenMetrics 1.0 (when the ``Accept`` header asks for
  ``application/openmetrics-text``, as Prometheus does with exemplar storage on):
  counter families are named without their ``_total`` suffix, counters and
  histograms get a ``_created`` sample (when the service began counting),
  histogram buckets may carry an exemplar (``# {trace_id="...",request_id="..."}
  value timestamp``), and the body ends with ``# EOF``.

Names get ``PREFIX`` here; callers pass the rest. Nothing here knows what is counted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

PREFIX = "traceproxy_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
OPENMETRICS_MEDIA_TYPE = "application/openmetrics-text"
# OpenMetrics: "The combined length of the label names and values of an Exemplar's
# LabelSet MUST NOT exceed 128 UTF-8 character code points."
EXEMPLAR_LABELS_MAX = 128

Labels = tuple[tuple[str, str], ...]


class Exemplar:
    """One request shown beside a histogram bucket: its trace, request id, the value
    it observed (exported units) and when it ended (Unix seconds)."""

    __slots__ = ("trace_id", "request_id", "value", "timestamp")

    def __init__(self, trace_id: str, request_id: str, value: float, timestamp: float) -> None:
        self.trace_id, self.request_id, self.value, self.timestamp = trace_id, request_id, value, timestamp

    def labels(self) -> Labels:
        """trace_id always; request_id too when both fit the 128-character budget."""
        labels: Labels = (("trace_id", self.trace_id),)
        with_request = labels + (("request_id", self.request_id),)
        if self.request_id and sum(len(name) + len(value) for name, value in with_request) <= EXEMPLAR_LABELS_MAX:
            return with_request
        return labels


def wants_openmetrics(accept: str | None) -> bool:
    """Whether an ``Accept`` header prefers OpenMetrics to the text format: it names
    ``application/openmetrics-text`` with a quality above 0 and at least that of any
    text or wildcard type. No header, or ``*/*`` alone, keeps the text format."""
    if not accept:
        return False
    openmetrics_q, text_q = 0.0, 0.0
    for part in accept.split(","):
        media, *params = (piece.strip() for piece in part.split(";"))
        quality = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0
        media = media.lower()
        if media == OPENMETRICS_MEDIA_TYPE:
            openmetrics_q = max(openmetrics_q, quality)
        elif media in ("text/plain", "text/*", "*/*"):
            text_q = max(text_q, quality)
    return openmetrics_q > 0 and openmetrics_q >= text_q


class Exposition:
    """Builds the scrape body. ``openmetrics`` picks the format; ``created`` (Unix
    seconds) is the ``_created`` value of every counter and histogram in it."""

    def __init__(self, openmetrics: bool = False, created: float | None = None) -> None:
        self.openmetrics = openmetrics
        self.created = created
        self.lines: list[str] = []

    @property
    def content_type(self) -> str:
        return OPENMETRICS_CONTENT_TYPE if self.openmetrics else CONTENT_TYPE

    def counter(self, name: str, help_text: str, samples: Iterable[tuple[Labels, float]]) -> None:
        full = PREFIX + name
        if not self.openmetrics:
            self._family(full, "counter", help_text, samples)
            return
        family = full.removesuffix("_total")
        self._header(family, "counter", help_text)
        for labels, value in samples:
            self._sample(family + "_total", labels, value)
            self._created(family, labels)

    def gauge(self, name: str, help_text: str, samples: Iterable[tuple[Labels, float]]) -> None:
        self._family(PREFIX + name, "gauge", help_text, samples)

    def histogram(self, name: str, help_text: str, bounds: Sequence[float], cumulative_counts: Sequence[int],
                  total: float, exemplars: Sequence[Exemplar | None] = ()) -> None:
        """``cumulative_counts``: observations at or below each bound, then the count
        (+Inf); ``exemplars``, one per bucket or empty, are written in OpenMetrics only."""
        self.histograms(name, help_text, bounds, [((), cumulative_counts, total, exemplars)])

    def histograms(self, name: str, help_text: str, bounds: Sequence[float],
                   series: Iterable[tuple[Labels, Sequence[int], float, Sequence[Exemplar | None]]]) -> None:
        """One histogram family, one series per label set: (labels, cumulative counts,
        total, exemplars) each, as ``histogram`` takes them; no series, the family alone."""
        full = PREFIX + name
        self._header(full, "histogram", help_text)
        les = [format_value(float(bound)) for bound in (*bounds, math.inf)]
        for labels, cumulative_counts, total, exemplars in series:
            with_exemplars = self.openmetrics and exemplars
            for index, (le, at_or_below) in enumerate(zip(les, cumulative_counts)):
                line = f"{full}_bucket{format_labels((*labels, ('le', le)))} {format_value(at_or_below)}"
                exemplar = exemplars[index] if with_exemplars else None
                if exemplar is not None:
                    line += (f" # {format_labels(exemplar.labels())} {format_value(exemplar.value)} "
                             f"{format_value(exemplar.timestamp)}")
                self.lines.append(line)
            self._sample(full + "_sum", labels, total)
            self._sample(full + "_count", labels, cumulative_counts[-1])
            if self.openmetrics:
                self._created(full, labels)

    def text(self) -> str:
        if self.openmetrics:
            return "\n".join(self.lines) + "\n# EOF\n"
        return "\n".join(self.lines) + "\n"

    def _family(self, full: str, kind: str, help_text: str, samples: Iterable[tuple[Labels, float]]) -> None:
        self._header(full, kind, help_text)
        for labels, value in samples:
            self._sample(full, labels, value)

    def _header(self, full_name: str, kind: str, help_text: str) -> None:
        help_text = escape_openmetrics_help(help_text) if self.openmetrics else escape_help(help_text)
        self.lines.append(f"# HELP {full_name} {help_text}")
        self.lines.append(f"# TYPE {full_name} {kind}")

    def _sample(self, full_name: str, labels: Labels, value: float) -> None:
        self.lines.append(f"{full_name}{format_labels(labels)} {format_value(value)}")

    def _created(self, family: str, labels: Labels) -> None:
        if self.created is not None:
            self._sample(family + "_created", labels, self.created)


def format_labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{name}="{escape_label_value(value)}"' for name, value in labels) + "}"


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def escape_openmetrics_help(text: str) -> str:
    """OpenMetrics escapes double quotes in HELP too."""
    return escape_label_value(text)


def format_value(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
