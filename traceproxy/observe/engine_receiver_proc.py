"""The proxy's side of the engine span receiver's process (``engine_receiver_main``), for a
proxy of one process.

Theory of operation
-------------------
``start`` spawns the process, at the exporter's lower CPU priority, and waits until its
receivers listen (or says why they could not: the message names the key). Then it reads
its frames as they come, on the loop, each a few microseconds of work:

* the stages that changed go to ``facts`` (``engine_join.StageFacts``, which keeps those
  of the requests in flight here, as a worker of several does);
* the requests to relay (gathered by the receiver's process for up to 50 ms) go, each
  as it came, to the proxy's exporter (``relay.submit_raw_many``); counted here as relayed
  or dropped. No span is read here: the proxy's part is per export request, and per
  frame of them;
* the receiver's counts and its open work (every second) are kept for ``numbers`` and
  ``open_work``, which ``/debug/inflight`` and the engine orphan check read.

``stop`` closes the process's stdin (it then stops its receivers and exits), waits for
it, and kills it past its deadline. A process that ends on its own is logged once; its
receivers are gone with it, and the join then says nothing from spans.
"""

from __future__ import annotations

import asyncio
import json
import logging
import marshal
import os
import signal
import sys
import time

from .engine_join import stage_from_tuple
from .export import _child_environment
from .export_wire import RawSpans

log = logging.getLogger("traceproxy.engine_spans")
CHILD_MODULE = "traceproxy.observe.engine_receiver_main"
READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 5.0
_HEADER = 4


class EngineReceiverProcess:
    def __init__(self, http_address, grpc_address, *, max_traces: int, facts, relay=None, nice: int = 10) -> None:
        self.http_address, self.grpc_address = http_address, grpc_address
        self.max_traces, self.facts, self.relay, self.nice = max_traces, facts, relay, nice
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self.spans_relayed = self.relay_dropped = 0
        self._numbers: dict = {}
        self._open_work: list = []
        self._process: asyncio.subprocess.Process | None = None
        self._reader: _Frames | None = None
        self._stopping = False

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        read_fd, write_fd = os.pipe()
        try:
            self._process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", CHILD_MODULE, json.dumps(self._config()), str(write_fd),
                stdin=asyncio.subprocess.PIPE, pass_fds=(write_fd,), close_fds=True, env=_child_environment(),
                start_new_session=True)  # a terminal's Ctrl-C is the proxy's, as for the exporter
        finally:
            os.close(write_fd)
        ready = loop.create_future()
        self._reader = _Frames(self._take, ready)
        await loop.connect_read_pipe(lambda: self._reader, open(read_fd, "rb", buffering=0))
        try:
            answer = await asyncio.wait_for(ready, READY_TIMEOUT_S)
        except asyncio.TimeoutError:
            answer = ("error", f"the engine span receiver did not start within {READY_TIMEOUT_S:g} s")
        if answer[0] != "ready":
            reason = answer[1] + await self._how_it_ended()
            await self.stop()
            raise OSError(reason)
        _, http_port, grpc_port = answer
        self.http_port, self.grpc_port = http_port or None, grpc_port or None
        loop.create_task(self._watch_exit())

    async def _how_it_ended(self, wait_s: float = 1.0) -> str:
        """`` (exit code N)`` or `` (killed by SIGKILL)`` once the child has ended (an OOM
        kill, a crash in C), "" while it runs: what a start that failed can say of it."""
        try:
            code = await asyncio.wait_for(self._process.wait(), wait_s)
        except asyncio.TimeoutError:
            return ""
        if code >= 0:
            return f" (exit code {code})" if code else ""
        try:
            return f" (killed by {signal.Signals(-code).name})"
        except ValueError:  # a real-time signal has no name of its own
            return f" (killed by signal {-code})"

    def _config(self) -> dict:
        def address(value):
            return [value.host, value.port] if value is not None else None

        return {"http": address(self.http_address), "grpc": address(self.grpc_address),
                "max_traces": self.max_traces, "relay": self.relay is not None, "nice": self.nice}

    def _take(self, message: tuple) -> None:
        kind = message[0]
        if kind == "stages":
            self.facts.update(message[1], time.monotonic_ns())
        elif kind == "raw":
            # A frame of export requests from the receiver's process: written to the
            # exporter together (one pipe write), each still taken or dropped on its own.
            raws = [RawSpans(payload, spans) for payload, spans in zip(message[1], message[2])]
            taken = self.relay.submit_raw_many(raws) if self.relay is not None else [False] * len(raws)
            for raw, was_taken in zip(raws, taken):
                if was_taken:
                    self.spans_relayed += raw.spans
                else:
                    self.relay_dropped += raw.spans
        elif kind == "numbers":
            self._numbers = message[1]
            self._open_work = [(trace_id, stage_from_tuple(fields)) for trace_id, fields in message[2]]

    async def _watch_exit(self) -> None:
        code = await self._process.wait()
        if not self._stopping:
            log.warning("the engine span receiver's process %d ended (code %s): engine spans are not received "
                        "from now on", self._process.pid, code)

    async def stop(self) -> None:
        if self._process is None or self._stopping:
            return
        self._stopping = True
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            await asyncio.wait_for(self._process.wait(), STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            try:
                self._process.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
            await self._process.wait()
        if self._reader is not None:
            self._reader.close()

    # -- reading ---------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def numbers(self) -> dict:
        """The ``engine_spans`` object of ``/debug/inflight`` (the receiver's counts, as of its
        last report; what it relayed and dropped, counted here)."""
        numbers = {key: value for key, value in self._numbers.items() if key != "relay_left_out"}
        numbers.update({"otlp_http": self.http_port, "otlp_grpc": self.grpc_port, "spans_relayed": self.spans_relayed,
                        "relay_dropped": self.relay_dropped + self._numbers.get("relay_left_out", 0)})
        return numbers

    def open_work(self) -> list:
        return self._open_work


class _Frames(asyncio.Protocol):
    """Length-prefixed marshal frames from the receiver's process."""

    def __init__(self, take, ready: asyncio.Future) -> None:
        self.take, self.ready = take, ready
        self._buffer = bytearray()
        self._transport = None

    def connection_made(self, transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while len(buffer) >= _HEADER:
            length = int.from_bytes(buffer[:_HEADER], "big")
            if len(buffer) < _HEADER + length:
                return
            message = marshal.loads(bytes(buffer[_HEADER:_HEADER + length]))
            del buffer[:_HEADER + length]
            if message[0] in ("ready", "error"):
                if not self.ready.done():
                    self.ready.set_result(message)
                continue
            self.take(message)

    def connection_lost(self, exc) -> None:
        if not self.ready.done():
            self.ready.set_result(("error", "the engine span receiver's process ended before it listened"))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
