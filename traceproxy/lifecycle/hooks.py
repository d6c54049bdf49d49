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
"""

from __future__ import annotations

import logging
from typing import Protocol

from .marks import Mark
from .timeline import RequestRecord

log = logging.getLogger("traceproxy.observers")


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
        # How much of the end of a long request body an observer wants kept on the
        # record (``request_body_tail``): the most any observer asked for, 0 when none.
        self.request_body_tail_bytes = 0
        for observer in observers or []:
            self.add(observer)

    def add(self, observer: Observer) -> None:
        self.observers.append(observer)
        self.request_body_tail_bytes = max(self.request_body_tail_bytes,
                                           getattr(observer, "request_body_tail_bytes", 0))
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
        for observer in self.done_observers:
            try:
                observer.on_done(record)
            except Exception:
                self._count_error(observer, "on_done")

    def _count_error(self, observer: object, method: str) -> None:
        self.observer_errors += 1
        log.exception("observer %s.%s raised; proxying continues", type(observer).__name__, method)
