"""The observer protocol: the one place where ``proxy/`` meets ``observe/``.

Theory of operation
-------------------
The proxy calls a ``Fanout`` at each lifecycle edge; the fanout calls every
registered observer that implements that hook. Guarantees the proxy code relies on:

* ``on_request_start`` once per request, when its first byte arrives;
* ``on_mark`` for each mark, in the order the marks were stamped;
* ``on_done`` exactly once per started request, after its outcome is set, always
  (every ending path goes through ``RequestRecord.finish``, which refuses a second
  ending, and then calls ``done``);
* an observer that raises is caught and counted in ``observer_errors``: tracing can
  never break proxying.

Hooks are optional: an observer that does not define ``on_mark`` is never called
per mark. With nobody listening a hook is one empty-list check, which matters on
the per-request hot path (ten marks per request).

Deferred endings
----------------
A server calls ``defer_done(loop.call_soon)`` once: from then on ``done`` only
queues the record, and the ``on_done`` calls run after the I/O callbacks of the
loop pass that finished the request, in slices, oldest first. This is Envoy's
deferred deletion applied to observation: counting, logging and span building
never delay a byte that is waiting to be forwarded. It matters when the loop is
saturated for a moment (a round of streams ending and the next round's requests
arriving together): each pass then forwards every ready byte and runs only a
slice of the queued endings, at least ``DRAIN_MIN`` and otherwise half of the
queue, so the queue stays a few passes long however fast requests end. ``drain``
runs the whole queue at once (before a scrape, at shutdown). Observers still see
``on_request_start``, the marks and ``on_done`` in that order for each request:
only ``on_done`` waits, and a finished record no longer changes.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Protocol

from .marks import Mark
from .timeline import RequestRecord

log = logging.getLogger("traceproxy.observers")

# Queued on_done calls run per loop pass: at least this many, else half the queue.
DRAIN_MIN = 16


class Observer(Protocol):
    """Implement any subset of these."""

    def on_request_start(self, record: RequestRecord) -> None: ...

    def on_mark(self, record: RequestRecord, mark: Mark) -> None: ...

    def on_done(self, record: RequestRecord) -> None: ...


class Fanout:
    def __init__(self, observers: list[Observer] | None = None) -> None:
        self.observers: list[Observer] = []
        self.start_observers: list[Observer] = []
        self.mark_observers: list[Observer] = []
        self.done_observers: list[Observer] = []
        self.observer_errors = 0
        self._call_soon: Callable[[Callable[[], None]], object] | None = None
        self._ended: collections.deque[RequestRecord] = collections.deque()
        self._drain_scheduled = False
        for observer in observers or []:
            self.add(observer)

    def add(self, observer: Observer) -> None:
        self.observers.append(observer)
        for hook, group in (("on_request_start", self.start_observers), ("on_mark", self.mark_observers),
                            ("on_done", self.done_observers)):
            if callable(getattr(observer, hook, None)):
                group.append(observer)

    def request_start(self, record: RequestRecord) -> None:
        for observer in self.start_observers:
            try:
                observer.on_request_start(record)
            except Exception:
                self._count_error(observer, "on_request_start")

    def mark(self, record: RequestRecord, mark: Mark) -> None:
        for observer in self.mark_observers:
            try:
                observer.on_mark(record, mark)
            except Exception:
                self._count_error(observer, "on_mark")

    def done(self, record: RequestRecord) -> None:
        # Exactly once per request: callers reach this only through
        # ``RequestRecord.finish``, which raises on a second ending.
        if self._call_soon is None:
            self._done_now(record)
            return
        self._ended.append(record)
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self._call_soon(self._drain_slice)

    def defer_done(self, call_soon: Callable[[Callable[[], None]], object]) -> None:
        """Queue ``on_done`` calls and run them through ``call_soon`` (see Deferred endings)."""
        self._call_soon = call_soon

    def drain(self) -> None:
        """Run every queued ``on_done`` call now."""
        ended = self._ended
        while ended:
            self._done_now(ended.popleft())

    def _drain_slice(self) -> None:
        ended = self._ended
        for _ in range(min(len(ended), max(DRAIN_MIN, len(ended) // 2))):
            self._done_now(ended.popleft())
        if ended:
            self._call_soon(self._drain_slice)
        else:
            self._drain_scheduled = False

    def _done_now(self, record: RequestRecord) -> None:
        for observer in self.done_observers:
            try:
                observer.on_done(record)
            except Exception:
                self._count_error(observer, "on_done")

    def _count_error(self, observer: object, method: str) -> None:
        self.observer_errors += 1
        log.exception("observer %s.%s raised; proxying continues", type(observer).__name__, method)
