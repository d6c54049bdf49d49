"""The link between the service's parent and each of its workers (``--workers N``).

Theory of operation
-------------------
Before forking, the parent makes one connected Unix socket pair per worker; each
worker keeps its end, the parent the others. Over it:

* the parent asks (``ask``, a sequence number and one of ``worker_view.KINDS``) and
  the worker answers (``answer`` with the same number; ``inflight`` first sends its
  entries in ``part`` frames, one per slice, so no single frame holds the loop long);
* the parent tells every worker the engine readings after each scrape of the
  engines (``engines``), which the worker's stall lines, stall spans and in-flight
  entries read.

A frame is a 4-byte length and a ``marshal``-ed tuple: plain data only, between two
processes of this program. The worker answers from a task on its own event loop,
through ``WorkerView``, which bounds how long any answer holds the loop; nothing
on the request path ever waits for the link.

The parent (``WorkerLinks.ask``) asks every worker at once and waits at most
``ANSWER_TIMEOUT_S``. A worker that did not answer by then is *missing* from that
answer (and ``late_total`` counts it): its gauges and in-flight requests are left
out, visibly, and its counters are its last answer's (``last_numbers``), so a
service total never goes down. Its answer, when it comes, still updates
``last_numbers``. A worker never has more than ``MAX_OUTSTANDING`` questions
waiting: one that is stuck is not sent a pile of them.
"""

from __future__ import annotations

import asyncio
import logging
import marshal
import os
import socket
import struct
from dataclasses import dataclass, field

from .observe.worker_view import WorkerView

log = logging.getLogger("traceproxy.workers")

# How long the admin side waits for a worker's answer before it goes on without it.
# A worker answers within a loop pass or a few slices (well under a millisecond each)
# unless its loop is held up; a second is far past any healthy loop's delay and well
# within a scraper's timeout (Prometheus' default is 10 s).
ANSWER_TIMEOUT_S = 1.0
MAX_OUTSTANDING = 4
_LENGTH = struct.Struct("!I")
MAX_FRAME = 256 << 20  # far past any answer: a longer length is a broken link


def frame(message: tuple) -> bytes:
    payload = marshal.dumps(message)
    return _LENGTH.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> tuple | None:
    """The next message, or None at the end of the link."""
    try:
        head = await reader.readexactly(_LENGTH.size)
        (length,) = _LENGTH.unpack(head)
        if length > MAX_FRAME:
            raise ValueError(f"a frame of {length} bytes")
        return marshal.loads(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


# ----------------------------------------------------------------------------------
# The worker's end
# ----------------------------------------------------------------------------------
class WorkerLink:
    """Made in the parent before the fork, used in the worker it was made for.

    ``healthy_ceiling``: the service's shared ``SharedRateCeiling`` or None;
    ``readings``: the worker's ``EngineReadings`` when the service scrapes engines
    (set by the worker's composition root)."""

    def __init__(self, sock: socket.socket, healthy_ceiling=None) -> None:
        self.sock = sock
        self.healthy_ceiling = healthy_ceiling
        self.readings = None
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task | None = None
        self._answering: set[asyncio.Task] = set()

    async def serve(self, view: WorkerView) -> None:
        """Answer the parent from now on; first tell it this worker serves its port."""
        reader, self._writer = await asyncio.open_unix_connection(sock=self.sock)
        self._writer.write(frame(("ready", 0, None)))
        self._task = asyncio.get_running_loop().create_task(self._serve(reader, view), name="traceproxy-worker-link")

    async def _serve(self, reader: asyncio.StreamReader, view: WorkerView) -> None:
        while (message := await read_frame(reader)) is not None:
            if message[0] == "ask":
                _, seq, kind = message
                task = asyncio.get_running_loop().create_task(self._answer(view, seq, kind))
                self._answering.add(task)
                task.add_done_callback(self._answering.discard)
            elif message[0] == "engines" and self.readings is not None:
                self.readings.update(message[1])

    async def _answer(self, view: WorkerView, seq: int, kind: str) -> None:
        writer = self._writer
        try:
            payload = await view.answer(kind, lambda piece: writer.write(frame(("part", seq, piece))))
        except Exception as exc:  # one answer's failure is said to the parent, never a dead link
            log.exception("answering the admin side's %s failed", kind)
            writer.write(frame(("error", seq, f"{type(exc).__name__}: {exc}")))
            return
        writer.write(frame(("answer", seq, payload)))

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for task in list(self._answering):
            task.cancel()
        if self._writer is not None:
            self._writer.close()
        else:
            self.sock.close()


# ----------------------------------------------------------------------------------
# The parent's end
# ----------------------------------------------------------------------------------
@dataclass
class _Question:
    kind: str
    future: asyncio.Future
    parts: list = field(default_factory=list)


class WorkerPeer:
    """One worker as the parent sees it."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid, self.sock = pid, sock
        self.alive = True
        self.last_numbers: dict | None = None
        self._last_numbers_seq = -1
        self._seq = 0
        self._questions: dict[int, _Question] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task | None = None
        self.ready: asyncio.Future | None = None  # True once the worker serves its port; False if it never will

    async def start(self) -> None:
        self.ready = asyncio.get_running_loop().create_future()
        reader, self._writer = await asyncio.open_unix_connection(sock=self.sock)
        self._task = asyncio.get_running_loop().create_task(self._read(reader), name=f"traceproxy-peer-{self.pid}")

    def ask(self, kind: str) -> asyncio.Future | None:
        """The future of the worker's answer; None when it cannot be asked (gone, or
        already holding ``MAX_OUTSTANDING`` questions)."""
        if not self.alive or self._writer is None or len(self._questions) >= MAX_OUTSTANDING:
            return None
        self._seq += 1
        future = asyncio.get_running_loop().create_future()
        self._questions[self._seq] = _Question(kind, future)
        self._writer.write(frame(("ask", self._seq, kind)))
        return future

    def tell(self, message: tuple) -> None:
        if self.alive and self._writer is not None:
            self._writer.write(frame(message))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while (message := await read_frame(reader)) is not None:
                self._take(*message)
        finally:
            self._gone()

    def _take(self, what: str, seq: int, payload) -> None:
        if what == "ready":
            if not self.ready.done():
                self.ready.set_result(True)
            return
        question = self._questions.get(seq)
        if question is None:
            return
        if what == "part":
            question.parts.extend(payload)
            return
        del self._questions[seq]
        if what == "error":
            log.warning("worker %d could not answer %s: %s", self.pid, question.kind, payload)
            payload = None
        elif question.kind == "inflight":
            payload["entries"] = question.parts + payload["entries"]
        elif question.kind == "numbers" and seq > self._last_numbers_seq:
            self.last_numbers, self._last_numbers_seq = payload, seq
        if not question.future.done():  # one that nobody waits for any more is fine to resolve
            question.future.set_result(payload)

    def _gone(self) -> None:
        self.alive = False
        if self.ready is not None and not self.ready.done():
            self.ready.set_result(False)
        for question in self._questions.values():
            if not question.future.done():
                question.future.set_result(None)
        self._questions.clear()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._writer is not None:
            self._writer.close()
        else:
            self.sock.close()


@dataclass
class Answers:
    answered: dict[int, object]  # pid -> answer, in worker order
    missing: list[int]  # pids that did not answer in time (or are gone)


class WorkerLinks:
    """The admin side's source of answers with several workers (see ``admin.ServiceAdmin``)."""

    def __init__(self, peers: list[WorkerPeer], timeout: float = ANSWER_TIMEOUT_S) -> None:
        self.peers = peers
        self.timeout = timeout
        self.late_total = 0

    @property
    def workers(self) -> list[int]:
        return [peer.pid for peer in self.peers]

    async def start(self) -> bool:
        """Open every link and wait until each worker serves its port: True, or False
        when one ended first (the supervisor then stops the service)."""
        for peer in self.peers:
            await peer.start()
        return all(await asyncio.gather(*(peer.ready for peer in self.peers)))

    async def ask(self, kind: str) -> Answers:
        futures = {peer.pid: peer.ask(kind) for peer in self.peers}
        waiting = [f for f in futures.values() if f is not None]
        if waiting:
            # A question that times out here stays open (wait cancels nothing): its
            # answer, when it comes, still updates the worker's last numbers.
            await asyncio.wait(waiting, timeout=self.timeout)
        answered, missing = {}, []
        for pid, future in futures.items():
            if future is not None and future.done() and future.result() is not None:
                answered[pid] = future.result()
            else:
                missing.append(pid)
        self.late_total += len(missing)
        return Answers(answered, missing)

    def last_numbers(self, pid: int) -> dict | None:
        return next((peer.last_numbers for peer in self.peers if peer.pid == pid), None)

    async def count_at_engines(self) -> int | None:
        """The service's requests at the engines; None when a worker did not say."""
        answers = await self.ask("at_engines")
        return None if answers.missing else sum(answers.answered.values())

    def tell_readings(self, readings: dict) -> None:
        for peer in self.peers:
            peer.tell(("engines", readings))

    def close(self) -> None:
        for peer in self.peers:
            peer.close()


class LocalSource:
    """The admin side's source of answers with one worker: this process's own view."""

    def __init__(self, view: WorkerView) -> None:
        self.view = view
        self.late_total = 0

    @property
    def workers(self) -> list[int]:
        return [os.getpid()]

    async def ask(self, kind: str) -> Answers:
        return Answers({os.getpid(): await self.view.answer(kind)}, [])

    def last_numbers(self, pid: int) -> dict | None:
        return None
