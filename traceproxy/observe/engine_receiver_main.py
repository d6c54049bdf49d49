"""The engine span receiver's process, for a proxy of one process: the receivers and the
span store (``engine_receiver.EngineSpans``), off the proxy's event loop.

Run as ``python -m traceproxy.observe.engine_receiver_main CONFIG_JSON FD`` by
``engine_receiver_proc.EngineReceiverProcess``. Why a process of its own: taking an
engine's export request costs the receiving loop a few hundred microseconds (the HTTP or
gRPC server's own work, then reading the spans), and two engines exporting at a few
hundred requests a second send hundreds of them a second. On the proxy's loop that is
CPU proxying needs; here, at a lower priority (``nice``, as the exporter process), it is
CPU the proxy gets first when the cores are busy, and the engines' exports wait.

To the proxy, on ``FD``, frames of a 4-byte big-endian length and a ``marshal``-ed tuple:

* ``("ready", http port, grpc port)`` once both listen (0: that one is off), or
  ``("error", message)`` and exit 1;
* ``("raw", [payload, ...], [spans, ...])``: the requests to relay, each as it came (the
  proxy hands each to its exporter process), gathered for at most ``RELAY_EVERY_S`` or
  ``RELAY_BATCH_BYTES``: the proxy's loop then wakes for a frame a few times a second,
  not once per export request (hundreds a second at S5's rate). A request is left
  out, and counted, while the proxy has not taken ``MAX_BUFFERED`` bytes of what was
  sent before;
* ``("stages", message)``: the stages that changed (``engine_join.stage_message``);
* ``("numbers", numbers, open work)`` every second: the receiver's counts, and the
  traces with a worker that has not finished (at most ``OPEN_WORK_SENT``, the oldest),
  for the engine work no request in flight has.

EOF on stdin (the proxy stops it, or died) stops the receivers and ends the process.
SIGINT and SIGTERM are the proxy's to act on (see ``exporter_main.obey_only_the_parent``).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import marshal
import os
import signal
import struct
import sys
import traceback

from .engine_join import stage_tuple
from .engine_receiver import EngineSpans
from .export_wire import RawSpans
from .exporter_main import lower_priority

log = logging.getLogger("traceproxy.engine_spans")
HEADER = struct.Struct("!I")
MAX_BUFFERED = 16 << 20  # bytes sent the proxy has not read yet, past which relays wait
RELAY_EVERY_S = 0.05  # well under an engine's own export delay (SGLang: 500 ms)
RELAY_BATCH_BYTES = 1 << 20
OPEN_WORK_SENT = 200
NUMBERS_EVERY_S = 1.0
YOUNG_COLLECTION_THRESHOLD = 50_000


class _Address:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def frame(message: tuple) -> bytes:
    payload = marshal.dumps(message)
    return HEADER.pack(len(payload)) + payload


class _ToProxy:
    """The pipe to the proxy, and the relay the receivers hand requests to."""

    def __init__(self, transport: asyncio.WriteTransport) -> None:
        self.transport = transport
        self.left_out = 0  # relays not sent: the proxy was behind
        self._payloads: list[bytes] = []
        self._spans: list[int] = []
        self._pending_bytes = 0
        self._timer: asyncio.TimerHandle | None = None

    def send(self, message: tuple) -> None:
        if not self.transport.is_closing():
            self.transport.write(frame(message))

    def submit_raw(self, raw: RawSpans) -> bool:
        if self.transport.get_write_buffer_size() + self._pending_bytes > MAX_BUFFERED:
            self.left_out += raw.spans
            return False
        self._payloads.append(raw.payload)
        self._spans.append(raw.spans)
        self._pending_bytes += len(raw.payload)
        if self._pending_bytes >= RELAY_BATCH_BYTES:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(RELAY_EVERY_S, self.flush)
        return True

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._payloads:
            self.send(("raw", self._payloads, self._spans))
            self._payloads, self._spans, self._pending_bytes = [], [], 0


async def run(config: dict, fd: int) -> int:
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_write_pipe(asyncio.BaseProtocol, open(fd, "wb", buffering=0))
    to_proxy = _ToProxy(transport)
    address = {key: _Address(*config[key]) if config[key] else None for key in ("http", "grpc")}
    receiver = EngineSpans(address["http"], address["grpc"], max_traces=config["max_traces"],
                           relay=to_proxy if config["relay"] else None)
    receiver.on_changes.append(lambda message: to_proxy.send(("stages", message)))
    try:
        await receiver.start()
    except Exception as exc:  # an address it cannot listen on; or a fault of ours or gRPC's, not a silent exit
        if not isinstance(exc, OSError):
            traceback.print_exc()
        to_proxy.send(("error", str(exc) if isinstance(exc, OSError)
                       else f"the engine span receiver failed to start: {exc!r}"))
        await _drain(transport)
        return 1
    to_proxy.send(("ready", receiver.http_port or 0, receiver.grpc_port or 0))
    # As in the proxy (app.YOUNG_COLLECTION_THRESHOLD): what a request allocates is freed by
    # reference counting; walking the store's thousands of traces at every few hundred
    # allocations (CPython's default) cost a quarter of this process's CPU under load.
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, *gc.get_threshold()[1:])
    numbers = loop.create_task(_send_numbers(receiver, to_proxy))
    try:
        await _until_stdin_ends(loop)
    finally:
        numbers.cancel()
        await receiver.stop()
        to_proxy.flush()
        await _drain(transport)
    return 0


async def _send_numbers(receiver: EngineSpans, to_proxy: _ToProxy) -> None:
    while True:
        await asyncio.sleep(NUMBERS_EVERY_S)
        open_work = [(trace_id, stage_tuple(stage)) for trace_id, stage in receiver.open_work()[:OPEN_WORK_SENT]]
        to_proxy.send(("numbers", {**receiver.numbers(), "relay_left_out": to_proxy.left_out}, open_work))


async def _until_stdin_ends(loop: asyncio.AbstractEventLoop) -> None:
    ended = loop.create_future()

    class _Stdin(asyncio.Protocol):
        def eof_received(self):
            if not ended.done():
                ended.set_result(None)

        def connection_lost(self, exc):
            if not ended.done():
                ended.set_result(None)

    await loop.connect_read_pipe(_Stdin, sys.stdin.buffer)
    await ended


async def _drain(transport: asyncio.WriteTransport, timeout: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while transport.get_write_buffer_size() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    transport.close()


def main(argv: list[str]) -> int:
    config_json, fd = argv
    logging.basicConfig(level=logging.WARNING,
                        format="traceproxy-engine-spans[%(process)d] %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    config = json.loads(config_json)
    lower_priority(config["nice"])
    import uvloop

    return uvloop.run(run(config, int(fd)))


if __name__ == "__main__":
    os._exit(main(sys.argv[1:]))
