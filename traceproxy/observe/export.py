"""Parent side of span export: hand spans to a separate exporter process, never block.

The proxy's event loop cannot afford building and encoding spans (about 50 µs a
request even hand-written, close to what proxying a small request costs), so each
finished request leaves as a small tuple, in marshalled batches over a pipe, to
``python -m traceproxy.observe.exporter_main``, which builds, encodes and exports
the spans.

Theory of operation:
- Items are ``SpanData`` or request summaries (``spans.RequestSummary``, which the
  child turns into spans); the parent counts and bounds items, calling them spans.
- Access log lines come made (``submit_line``: the tracing observer formats each on
  the loop, which costs less than sending its summary here and restoring it there; see
  decision 0030). They wait in one buffer and leave with the batch, as one item of the
  frame, and count toward the batch and the queue one item a line, so a stuck stdout
  bounds them as a slow collector bounds spans. A line dropped here (the queue full, the
  child gone) is counted with the child's lines it could not write:
  ``access_log_lines_lost``.
- ``backlogged`` says the queue is past ``shed_mark`` (half of ``queue_spans``): the
  tracing observer then sheds healthy requests' spans before building anything,
  so only errored and stalled ones compete for the rest (and counts what it shed).
- The child runs at a lower CPU priority (``nice``, 10 by default): when the cores
  are saturated, proxying wins and the queue fills; shedding and the bounded queue
  take it from there, never the event loop.
- ``submit`` flattens the item (``export_wire.flatten``) into the current batch. A
  full batch (``batch_spans``, or ``BATCH_EVIDENCE_BYTES`` of kept requests' body
  evidence), a timer (``flush_interval`` after the batch's first span) or
  ``submit_now`` sends it: one ``marshal`` dump of the batch, length prefix, one
  ``transport.write`` on a non-blocking pipe. The byte bound is for the exporter's
  memory: a kept request carries up to 24 KiB of its bodies for the GenAI
  attributes, and the child holds a whole frame, twice (read, then decoded), while it
  works through it; 512 such requests made a frame of 12 MiB.
- The one bounded queue is the pipe transport's user-space buffer. It is bounded in
  spans, not bytes: every frame written is remembered as (end offset in the stream,
  span count), and ``get_write_buffer_size()`` tells how much of the stream has not
  reached the kernel yet, hence which frames still wait. A batch that would push the
  waiting spans past ``queue_spans`` is dropped and counted. (A byte high-water mark
  would only be a guess: a span's encoded size depends on its attributes.) On top of
  that queue: at most one partial batch, and the kernel's pipe buffer (64 KiB).
- The child exports one batch at a time and buffers nothing else, so a slow, down
  or black-holing collector fills the pipe and then this queue; only drops follow.
- If the child dies, spans are dropped and counted from then on; it is not
  restarted (a crash would most likely repeat, e.g. a bad endpoint or an OOM kill).
  One warning is logged, and ``stats["exporter_alive"]`` turns False for health
  checks. Spans still in the queue when it dies count as dropped; those already in
  the kernel's pipe buffer are lost uncounted (submitted - dropped - exported -
  failed shows them).
- ``stop`` flushes, closes the pipe (EOF: the child exports what is left and exits)
  and waits; past its deadline it sends the child's "stop now" signal (SIGUSR1),
  then SIGKILL. It never hangs. The child ignores SIGINT and SIGTERM: sent to the
  whole process group or cgroup, they are the proxy's to act on, and the child must
  outlive the proxy's shutdown grace to log and export the requests ending in it.
- The child gets no inherited descriptors but its stdin and the stats pipe
  (``close_fds``), so it never holds the proxy's listening sockets.

All methods run on the event loop's thread; none is thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import site
import sys
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path

import traceproxy

from .export_wire import (STATS, STOP_NOW, ExportConfig, RawSpans, flatten, flatten_lines, flatten_raw, frame,
                          parse_stats_line)
from .spandata import SpanData
from .spans import RequestSummary

__all__ = ["ExportConfig", "SpanExportPipe"]

log = logging.getLogger("traceproxy.export")
CHILD_MODULE = "traceproxy.observe.exporter_main"
# Of stop()'s timeout, the part kept for "stop now" and SIGKILL after draining overran.
KILL_RESERVE_SHARE, KILL_RESERVE_MAX = 0.25, 1.0
# A batch is sent once the kept requests in it carry this much body evidence: the
# exporter holds a frame twice and builds its spans whole, so this bounds its memory
# (at 1 MiB, its peak under S4's uploads was 24 MiB; at 256 KiB, 21).
BATCH_EVIDENCE_BYTES = 1 << 18
# Relayed engine requests written as one frame (submit_raw_many): far below the exporter's
# MAX_FRAME_BYTES whatever their number, each at most the receiver's body limit.
RAW_FRAME_BYTES = 16 << 20


class SpanExportPipe:
    """Parent side. Never blocks the event loop; bounded; counts drops."""

    def __init__(self, config: ExportConfig) -> None:
        self.config = config
        # A batch bigger than the queue could never be sent.
        self._batch_spans = min(config.batch_spans, config.queue_spans)
        self._batch: list[tuple] = []  # flattened items
        self._lines = bytearray()  # access log lines for the batch, each with its newline
        self._line_count = 0
        self._batch_evidence = 0  # body bytes the kept requests in the batch carry
        self._flush_timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._writer: asyncio.WriteTransport | None = None
        self._writer_lost = False
        self._waiting = _WaitingFrames()
        self._stats_reader: _StatsProtocol | None = None
        self._exit_watch: asyncio.Task | None = None
        self._accepting = False
        self._stopping = False
        self._submitted = 0
        self._dropped = 0
        self._lines_dropped = 0
        self._shed_mark = max(1, self.config.queue_spans // 2)

    # ------------------------------------------------------------------ start
    async def start(self) -> None:
        if self._loop is not None:
            raise RuntimeError("SpanExportPipe.start() called twice")
        self._loop = asyncio.get_running_loop()
        if not self.config.needs_process:
            return
        data_read, data_write = os.pipe()
        stats_read, stats_write = os.pipe()
        try:
            self._process = await self._spawn(data_read, stats_write)
        except BaseException:
            os.close(data_write)
            os.close(stats_read)
            raise
        finally:
            os.close(data_read)
            os.close(stats_write)
        await self._connect_pipes(data_write, stats_read)
        self._exit_watch = self._loop.create_task(self._watch_exit())
        self._accepting = True

    async def _spawn(self, stdin_fd: int, stats_fd: int) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            CHILD_MODULE,
            self.config.to_json(),
            str(stats_fd),
            stdin=stdin_fd,
            pass_fds=(stats_fd,),
            close_fds=True,
            env=_child_environment(),
            # Its own session: a terminal's Ctrl-C reaches the proxy's process group,
            # not this child while it still starts (before it ignores SIGINT, see
            # exporter_main); it ends when the proxy closes its stdin, as always.
            start_new_session=True,
        )

    async def _connect_pipes(self, data_fd: int, stats_fd: int) -> None:
        self._writer, _ = await self._loop.connect_write_pipe(
            lambda: _WriterProtocol(self), open(data_fd, "wb", buffering=0)
        )
        self._stats_reader = _StatsProtocol()
        await self._loop.connect_read_pipe(lambda: self._stats_reader, open(stats_fd, "rb", buffering=0))

    async def _watch_exit(self) -> None:
        code = await self._process.wait()
        if not self._stopping:
            log.warning("span exporter process %d exited (code %s); spans are dropped from now on",
                        self._process.pid, code)
        self._accepting = False

    # ----------------------------------------------------------------- submit
    def submit(self, spans: Iterable[SpanData]) -> None:
        if not self._accepting:
            self._drop_uncollected(spans)
            return
        for item in spans:
            self._submitted += 1
            try:
                self._batch.append(flatten(item))
            except Exception:  # an odd item must not reach the proxy's caller
                log.exception("dropping a %s that cannot be flattened", type(item).__name__)
                self._dropped += 1
                continue
            if type(item) is RequestSummary:
                self._batch_evidence += len(item.request_body_head) + len(item.response_tail) + \
                    len(item.request_body_tail)
        self._batch_grew()

    def submit_line(self, line: bytes) -> None:
        """One access log line, without its newline, to be appended by the exporter process."""
        if not self._accepting:
            if self.config.needs_process:
                self._lines_dropped += 1
            return
        # Copied at once, so orjson's bytes are freed as soon as they were made: kept
        # alive until a join, each a fresh heap block, they cost five times as much to make.
        lines = self._lines
        lines += line
        lines += b"\n"
        self._line_count += 1
        self._batch_grew()

    def _batch_grew(self) -> None:
        if len(self._batch) + self._line_count >= self._batch_spans or self._batch_evidence >= BATCH_EVIDENCE_BYTES:
            self._flush()
        elif self._flush_timer is None:
            self._flush_timer = self._loop.call_later(self.config.flush_interval, self._flush)

    def backlogged(self) -> bool:
        """The exporter is behind: what waits for it is past the shedding mark."""
        return self._queued() >= self._shed_mark

    def _queued(self) -> int:
        """Items waiting in this process: the open batch and the frames not yet in the pipe."""
        self._settle_waiting()
        return len(self._batch) + self._line_count + self._waiting.spans

    def submit_now(self, spans: Iterable[SpanData]) -> None:
        """Like ``submit``, then send at once: for spans that must be seen while a request still hangs."""
        self.submit(spans)
        self._flush()

    def submit_raw(self, raw: RawSpans) -> bool:
        """An engine's export request, relayed as it came, in a frame of its own at once;
        counted (and bounded in the queue) as the spans it holds. False: dropped."""
        return self.submit_raw_many([raw])[0]

    def submit_raw_many(self, raws: Sequence[RawSpans]) -> list[bool]:
        """``submit_raw`` for each of several requests (what the engine span receiver took
        since the last), each taken or dropped on its own, those taken written together:
        one frame, or one per ``RAW_FRAME_BYTES`` of requests. True: taken."""
        if not self.config.needs_process or self.config.exporter == "off":
            return [False] * len(raws)
        taken, frame_items, frame_spans, frame_bytes = [], [], 0, 0
        for raw in raws:
            self._submitted += raw.spans
            if not self._accepting or self._writer_lost or not self._has_room_for(frame_spans + raw.spans):
                self._dropped += raw.spans
                taken.append(False)
                continue
            if frame_items and frame_bytes + len(raw.payload) > RAW_FRAME_BYTES:
                self._write_raw(frame_items, frame_spans)
                frame_items, frame_spans, frame_bytes = [], 0, 0
            frame_items.append(flatten_raw(raw))
            frame_spans += raw.spans
            frame_bytes += len(raw.payload)
            taken.append(True)
        if frame_items:
            self._write_raw(frame_items, frame_spans)
        return taken

    def _write_raw(self, flat_items: list[tuple], spans: int) -> None:
        # Written before it is counted as waiting: settling compares the count with the
        # transport's buffer, which must already hold the frame.
        data, _ = frame(flat_items)  # bytes and ints: marshal writes them all
        self._writer.write(data)
        self._waiting.add(len(data), spans, 0)
        self._settle_waiting()

    def _drop_uncollected(self, spans: Iterable[SpanData]) -> None:
        if not self.config.needs_process:
            return
        count = sum(1 for _ in spans)
        self._submitted += count
        self._dropped += count

    def _flush(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        batch, self._batch = self._batch, []
        self._batch_evidence = 0
        lines, line_count = self._lines, self._line_count
        if not batch and not line_count:
            return
        self._lines, self._line_count = bytearray(), 0
        if not self._accepting or self._writer_lost or not self._has_room_for(len(batch) + line_count):
            self._dropped += len(batch)
            self._lines_dropped += line_count
            return
        items = len(batch)
        if line_count:
            batch.append(flatten_lines(lines, line_count))  # marshal writes a bytearray as bytes
        data, left_out = frame(batch)  # the lines' item is bytes and an int: it is never left out
        if left_out:
            log.warning("dropping %d span item(s) with a value that cannot be encoded", left_out)
            self._dropped += left_out
        self._writer.write(data)
        self._waiting.add(len(data), items - left_out + line_count, line_count)
        self._settle_waiting()  # most writes reach the kernel at once

    def _has_room_for(self, count: int) -> bool:
        self._settle_waiting()
        return self._waiting.spans + count <= self.config.queue_spans

    def _settle_waiting(self) -> None:
        # A closing transport may already have thrown its buffer away (the child
        # died): an empty buffer then means lost, not delivered; _writer_gone counts it.
        if self._writer is not None and not self._writer.is_closing():
            self._waiting.settle(self._writer.get_write_buffer_size())

    # ------------------------------------------------------------------ stats
    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def stats(self) -> dict:
        """Counts since start. ``spans_submitted`` includes the dropped ones and, like
        ``spans_dropped`` and ``spans_queued`` (what waits in this process now), counts
        items. ``spans_exported``/``spans_failed`` are the child's counts of real spans
        (a summary is usually 2). ``access_log_lines_lost``: lines dropped here (the
        queue full, the child gone) and those the child could not write. The child's
        counts are at most a second old, exact after ``stop()``."""
        child = self._stats_reader.latest if self._stats_reader else dict.fromkeys(STATS, 0)
        return {
            "spans_submitted": self._submitted,
            "spans_dropped": self._dropped,
            "spans_queued": self._queued(),
            "spans_exported": child["exported"],
            "spans_failed": child["failed"],
            "access_log_lines_lost": child["access_log_lost"] + self._lines_dropped,
            "exporter_alive": self._child_alive(),
        }

    def _writer_gone(self, exc: Exception | None) -> None:
        # With an error (the child died) the transport threw its buffer away; without
        # one it was empty: closed by stop() after draining, or by a clean child exit.
        self._writer_lost = True
        lost, lost_lines = self._waiting.forget()
        if exc is not None:
            self._count_lost(lost, lost_lines)

    def _count_lost(self, items: int, lines: int) -> None:
        """Items that were waiting for the child and will never reach it, lines apart."""
        self._dropped += items - lines
        self._lines_dropped += lines

    def _child_alive(self) -> bool:
        return self._process is not None and self._process.returncode is None and not self._writer_lost

    # ------------------------------------------------------------------- stop
    async def stop(self, timeout: float = 5.0) -> None:
        if self._process is None or self._stopping:
            return
        deadline = self._loop.time() + timeout
        self._flush()
        self._stopping = True
        self._accepting = False
        self._writer.close()  # EOF for the child once the buffer has drained
        reserve = min(timeout * KILL_RESERVE_SHARE, KILL_RESERVE_MAX)
        if not await self._exited_by(deadline - reserve):
            self._signal_child(STOP_NOW)
            if not await self._exited_by(deadline - reserve / 2):
                self._signal_child(signal.SIGKILL)
                await self._exited_by(deadline)
        await self._stats_reader.wait_closed(max(0.0, deadline - self._loop.time()))
        self._release()

    async def _exited_by(self, when: float) -> bool:
        if self._process.returncode is not None:
            return True
        try:
            await asyncio.wait_for(asyncio.shield(self._exit_watch), max(0.0, when - self._loop.time()))
        except asyncio.TimeoutError:
            return False
        return True

    def _signal_child(self, signum: signal.Signals) -> None:
        log.warning("span exporter process %d did not finish in time: %s", self._process.pid, signum.name)
        try:
            self._process.send_signal(signum)
        except ProcessLookupError:
            pass

    def _release(self) -> None:
        if not self._writer_lost and self._writer.get_write_buffer_size():
            self._waiting.settle(self._writer.get_write_buffer_size())
            self._count_lost(*self._waiting.forget())
            self._writer.abort()  # drops what a killed child never read; close() would wait for it
        self._stats_reader.close()
        if not self._exit_watch.done():
            self._exit_watch.cancel()


class _WaitingFrames:
    """Frames written to the transport that have not reached the kernel yet."""

    def __init__(self) -> None:
        # (stream offset of the frame's end, items, of which access log lines)
        self._frames: deque[tuple[int, int, int]] = deque()
        self._written = 0
        self.spans = 0  # items: spans, summaries and lines
        self.lines = 0

    def add(self, nbytes: int, items: int, lines: int) -> None:
        self._written += nbytes
        self._frames.append((self._written, items, lines))
        self.spans += items
        self.lines += lines

    def settle(self, still_buffered: int) -> None:
        delivered = self._written - still_buffered
        while self._frames and self._frames[0][0] <= delivered:
            _, items, lines = self._frames.popleft()
            self.spans -= items
            self.lines -= lines

    def forget(self) -> tuple[int, int]:
        """The transport discarded its buffer: how many items went with it, and of them lines."""
        lost = self.spans, self.lines
        self.spans = self.lines = 0
        self._frames.clear()
        return lost


class _WriterProtocol(asyncio.BaseProtocol):
    def __init__(self, pipe: SpanExportPipe) -> None:
        self._pipe = pipe

    def connection_lost(self, exc: Exception | None) -> None:
        self._pipe._writer_gone(exc)


class _StatsProtocol(asyncio.Protocol):
    """Reads the child's JSON stats lines; keeps the latest counts."""

    def __init__(self) -> None:
        self.latest = dict.fromkeys(STATS, 0)
        self._partial = b""
        self._transport: asyncio.ReadTransport | None = None
        self._closed = asyncio.Event()

    def connection_made(self, transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            counts = parse_stats_line(line)
            if counts is not None:
                self.latest = {key: max(value, self.latest[key]) for key, value in counts.items()}

    def eof_received(self) -> None:
        self._closed.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed.set()

    async def wait_closed(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._closed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def _child_environment() -> dict[str, str]:
    """The proxy's environment; for a traceproxy imported from outside site-packages
    (a checkout, a sys.path tweak), its directory first on PYTHONPATH, so the child
    runs the same code whatever the working directory."""
    env = dict(os.environ)
    package_root = str(Path(traceproxy.__file__).resolve().parent.parent)
    # Never put site-packages itself on PYTHONPATH: it would outrank the stdlib.
    if package_root not in _site_directories():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env


def _site_directories() -> set[str]:
    directories = [*site.getsitepackages(), site.getusersitepackages()]
    return {str(Path(directory).resolve()) for directory in directories}
