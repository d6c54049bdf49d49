"""The exporter process: batches of spans in on stdin, OTLP (or a file, or stderr) out,
and the access log: the lines the proxy made, appended as they came.

Run as ``python -m traceproxy.observe.exporter_main CONFIG_JSON STATS_FD`` by
``SpanExportPipe`` (traceproxy/observe/export.py); the framing and the stats lines
are in ``export_wire.py``.

Theory of operation:
- One loop on the main thread: read a frame, export it, repeat. A frame holds
  ``SpanData`` and request summaries; a summary becomes its spans here
  (``spans.spans_for``), so that work stays off the proxy's loop too. Stats count
  spans; a summary that fails to become spans counts as one failure. The child buffers
  nothing beyond the batch in hand, so a slow or black-holing collector shows up as
  a full pipe, and the parent (the one bounded queue in the system) drops and
  counts. Memory here is bounded by one batch. Each export is bounded by its
  timeout, retries included (``export_timeout`` unless an
  ``OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT`` variable is set; ``otlp_transport.py``).
- EOF on stdin (the parent's ``stop()``, or the parent died) means: export what is
  left, shut the exporter down, send the final stats line, exit 0. So the child
  never outlives its parent by more than the exports of what is already in the
  pipe, each bounded by the export timeout.
- A thread sends cumulative ``{"exported", "failed", "access_log_lost"}`` counts
  once a second when they changed; the parent's "stop now" (``STOP_NOW``, SIGUSR1) sends them once more
  and exits at once (the parent uses it when draining overran its deadline).
- It lowers its own CPU priority (``ExportConfig.nice``) before anything else, so
  that when the cores are saturated the proxy's event loop gets them first.
- It runs in its own session, so a terminal's Ctrl-C (sent to the proxy's process
  group) never reaches it; SIGINT and SIGTERM are ignored too, for systemd's default
  stop, which signals the whole cgroup. The parent's orderly stop, after its shutdown
  grace, not the signal, should end this process. (A stop signal that reaches it
  before it ignores them, in its first fraction of a second, still ends it.)
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from ..allocator import IdleHeapTrim
from . import genai_spans
from .export_wire import STOP_NOW, AccessLines, ExportConfig, RawSpans, decode_frame, read_frame, stats_line
from .spandata import SpanData
from .spans import spans_for

log = logging.getLogger("traceproxy.exporter")
STATS_INTERVAL = 1.0


class Counters:
    """Spans handed to a sink, access log lines lost, frames read; written by the main
    thread only."""

    def __init__(self) -> None:
        self.exported = 0
        self.failed = 0
        self.access_log_lost = 0
        self.frames = 0  # frames read and
        self.frames_done = 0  # frames exported: how much work was done, and whether any goes on

    def snapshot(self) -> tuple[int, int, int]:
        return self.exported, self.failed, self.access_log_lost


class StatsReporter:
    """Sends the counts once a second when they changed; on the same tick, gives freed heap
    back to the kernel once the process went quiet after frames, none read and not yet
    exported (``IdleHeapTrim``, which takes glibc's allocator lock: safe from this thread;
    a frame that comes during the trim waits for it, milliseconds)."""

    def __init__(self, fd: int, counters: Counters) -> None:
        self._fd, self._counters = fd, counters
        self._heap_trim = IdleHeapTrim.for_this_process()
        self._stopping = threading.Event()
        self._last_sent: tuple[int, int, int] | None = None
        self._thread = threading.Thread(target=self._report_periodically, name="stats", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def send(self) -> None:
        counts = self._counters.snapshot()
        try:
            os.write(self._fd, stats_line(*counts))
        except OSError:
            pass  # the parent is gone or stopped listening; nothing to tell
        self._last_sent = counts

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(STATS_INTERVAL * 2)
        self.send()

    def _report_periodically(self) -> None:
        while not self._stopping.wait(STATS_INTERVAL):
            self.tick()

    def tick(self) -> None:
        if self._counters.snapshot() != self._last_sent:
            self.send()
        if self._heap_trim is not None:
            counters = self._counters
            done = counters.frames_done
            self._heap_trim.check(done, busy=counters.frames != done)


def pump(stream, sink, counters: Counters, access_log=None) -> None:
    while (payload := read_frame(stream)) is not None:
        counters.frames += 1
        try:
            _export_frame(payload, sink, counters, access_log)
        finally:
            counters.frames_done += 1


def _export_frame(payload: bytes, sink, counters: Counters, access_log) -> None:
    """One frame's lines written and spans exported (an export may take its whole timeout)."""
    try:
        items = decode_frame(payload)
    except Exception:  # the frame boundary is known, so the next frame is still good
        log.exception("skipping a span frame that does not decode")
        return
    if access_log is not None:
        for lines in (item for item in items if type(item) is AccessLines):
            access_log.write_lines(lines.data, lines.count)
        counters.access_log_lost = access_log.lines_lost
    if sink is None:
        return
    for raw in (item for item in items if isinstance(item, RawSpans)):
        relay_raw(sink, raw, counters)
    batch = spans_of(items, counters)
    if not batch:
        return
    if export_batch(sink, batch):
        counters.exported += len(batch)
    else:
        counters.failed += len(batch)


def spans_of(items: list, counters: Counters) -> list[SpanData]:
    """Items are ``SpanData``, or request summaries whose spans are built here, off the
    proxy's event loop (``traceproxy.observe.spans``)."""
    spans = []
    for item in items:
        if isinstance(item, SpanData):
            spans.append(item)
            continue
        if isinstance(item, (RawSpans, AccessLines)):  # relayed as they came (relay_raw), or the access log's
            continue
        try:
            spans.extend(spans_for(item))
        except Exception:  # one odd request must not cost the rest of the batch
            log.exception("building spans from a %s failed", type(item).__name__)
            counters.failed += 1
    return spans


EXPORT_LOGGER = "traceproxy.export"  # the sinks' logger, and failed batches'


def relay_raw(sink, raw: RawSpans, counters: Counters) -> None:
    """An engine's export request, to the same destination as the proxy's own spans:
    sent as it came to a collector, written as its OTLP/JSON line to the span file."""
    try:
        delivered = sink.export_raw(raw.payload)
    except Exception:  # one bad request must not end the exporter
        logging.getLogger(EXPORT_LOGGER).exception("relaying %d engine spans failed", raw.spans)
        delivered = False
    if delivered:
        EPISODE.delivered()
        counters.exported += raw.spans
    else:
        counters.failed += raw.spans


class FailureEpisode(logging.Filter):
    """Export errors are logged once per episode, not once per batch: a collector down
    for an hour must not write a line (or a traceback) every second. The episode ends
    with the next batch delivered, which is logged."""

    def __init__(self) -> None:
        super().__init__()
        self.failing = False
        self.suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or record.name != EXPORT_LOGGER:
            return True
        if self.failing:
            self.suppressed += 1
            return False
        self.failing = True
        return True

    def delivered(self) -> None:
        if self.failing:
            log.warning("exporting works again (%d more failure messages were not logged)", self.suppressed)
        self.failing, self.suppressed = False, 0


EPISODE = FailureEpisode()


def export_batch(sink, batch: list) -> bool:
    try:
        delivered = sink.export(batch)
    except Exception:  # one bad batch must not end the exporter
        logging.getLogger(EXPORT_LOGGER).exception("exporting %d spans failed", len(batch))
        return False
    if delivered:
        EPISODE.delivered()
    return delivered


def lower_priority(increment: int) -> None:
    """Under CPU contention the proxy's event loop goes first; a lagging exporter only
    fills the queue, which the parent sheds and bounds."""
    if increment:
        try:
            os.nice(increment)
        except OSError as exc:  # a container may forbid it; exporting still works
            log.warning("could not lower the exporter's CPU priority: %s", exc)


def obey_only_the_parent(reporter: StatsReporter) -> None:
    """SIGINT and SIGTERM sent to the whole group (a terminal's Ctrl-C, systemd
    stopping the unit's cgroup) are the proxy's to act on: it keeps serving through
    its shutdown grace, and the requests that finish in it must still be logged and
    exported. The child ends at EOF on stdin (the proxy's orderly stop), on the
    proxy's own ``STOP_NOW`` when that overran, or by SIGKILL."""
    def on_stop_now(signum, frame):
        reporter.send()
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(STOP_NOW, on_stop_now)


def main(argv: list[str]) -> int:
    config_json, stats_fd = argv
    logging.basicConfig(
        level=logging.WARNING, format="traceproxy-exporter[%(process)d] %(levelname)s %(name)s: %(message)s"
    )
    for handler in logging.getLogger().handlers:  # a logger's own filter would miss its children's records
        handler.addFilter(EPISODE)
    counters = Counters()
    reporter = StatsReporter(int(stats_fd), counters)
    obey_only_the_parent(reporter)
    reporter.start()
    sink = access_log = None
    try:
        config = ExportConfig.from_json(config_json)
        lower_priority(config.nice)
        genai_spans.OPTIONS = genai_spans.SpanOptions(config.genai_provider, genai_spans.latest_opted_in())
        if config.exporter != "off":
            from .export_sinks import make_sink

            sink = make_sink(config)
        if config.access_log_path:
            from .accesslog import AccessLogWriter

            access_log = AccessLogWriter(config.access_log_path)
        pump(sys.stdin.buffer, sink, counters, access_log)
    finally:
        if sink is not None:
            sink.shutdown()
        if access_log is not None:
            access_log.close()
        reporter.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
