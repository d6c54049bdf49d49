"""The one timer of the I/O shells: a deadline kept on one loop handle, re-aimed lazily.

Theory of operation
-------------------
A ``Timer`` holds one deadline and the callback due at it. Setting a later deadline
than the one its handle is armed for costs nothing: the handle fires early, finds the
deadline moved on, and re-arms itself for it. Only an earlier deadline replaces the
handle. So a keep-alive connection, whose deadlines move later with every request,
creates a handle per deadline that is reached, not a handle and a cancel per request.
``clear`` stands a timer down the same way: its handle fires into nothing.

Deadlines are on the loop's clock (``loop.time()``), the clock the handle fires by:
compared with another clock, a handle firing a hair early would re-arm again and again.
The loop is the running one, taken when a timer is first set, so a timer can be made
before the loop runs (the pool is).

Hazards
-------
* A callback runs at its deadline whatever happened since: it re-checks whether its
  connection or request has ended (the timer knows neither).
* A set timer holds its callback, usually a bound method of its owner, which holds
  the timer: a reference cycle until it fires or is cancelled. An owner cancels its
  timers when it closes (``cancel``), so that reference counting frees it, not the
  cycle collector (see docs/architecture.md, Hazards).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Timer:
    __slots__ = ("_loop", "_handle", "_due", "callback")

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        # What is due at the deadline; None: nothing (cleared, or it ran). Setting it to
        # None is ``clear`` without a call, for code that runs on every request.
        self.callback: Callable[[], object] | None = None

    @property
    def armed(self) -> bool:
        """A callback is due (it has neither run nor been cleared)."""
        return self.callback is not None

    def now(self) -> float:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop.time()

    def set(self, due: float, callback: Callable[[], object]) -> None:
        """Call ``callback`` at ``due`` (loop time), in place of what was set."""
        self._due, self.callback = due, callback
        handle = self._handle
        if handle is not None:
            if handle.when() <= due:
                return  # it fires first, and re-arms itself for ``due``
            handle.cancel()
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        self._handle = loop.call_at(due, self._fired)

    def set_in(self, seconds: float, callback: Callable[[], object]) -> None:
        """``set`` at ``seconds`` from now (inlined: keep-alive connections set one per request)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        self._due = due = loop.time() + seconds
        self.callback = callback
        handle = self._handle
        if handle is not None:
            if handle.when() <= due:
                return
            handle.cancel()
        self._handle = loop.call_at(due, self._fired)

    def clear(self) -> None:
        """Stand down: nothing is called (the handle, if armed, fires into nothing)."""
        self.callback = None

    def cancel(self) -> None:
        """Stand down and let go of the handle: for an owner that is closing."""
        self.callback = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fired(self) -> None:
        self._handle = None
        callback = self.callback
        if callback is None:
            return
        loop = self._loop
        if loop.time() < self._due:
            self._handle = loop.call_at(self._due, self._fired)
            return
        self.callback = None
        callback()


class ExchangeTimer(Timer):
    """A client connection's timer for the deadlines of the exchange it is answering,
    on monotonic nanoseconds (the clock of the request's marks). It is the connection's
    and outlives an exchange, so that keep-alive requests do not each create and cancel
    one; when it fires it calls ``on_due``, which asks the active exchange."""

    __slots__ = ("_on_due", "_due_ns")

    def __init__(self, on_due: Callable[[], object]) -> None:
        super().__init__()
        self._on_due: Callable[[], object] | None = on_due
        self._due_ns = 0  # the deadline aimed at, on the monotonic clock

    def aim(self, due_ns: int, now_ns: int) -> None:
        """Call back no later than ``due_ns``. Due sooner already, it is left alone: the
        exchange re-aims it when it fires, so its deadlines may move later meanwhile."""
        if self.callback is None or self._due_ns > due_ns:
            self._due_ns = due_ns
            self.set(self.now() + (due_ns - now_ns) / 1e9, self._on_due)

    def due_by_ns(self, when_ns: int) -> bool:
        """It calls back by ``when_ns`` (monotonic) anyway: asked at every request's start,
        so it reads no clock."""
        return self.callback is not None and self._due_ns <= when_ns

    def cancel(self) -> None:
        super().cancel()
        self._on_due = None  # a bound method of the connection: a reference cycle else
