"""The engines' spans in: an OTLP receiver over HTTP (``POST /v1/traces``, protobuf) and
over gRPC (``TraceService/Export``), the span store it fills, and the relay of every
request, unchanged, to traceproxy's own span destination.

Theory of operation
-------------------
SGLang workers launched with ``--enable-trace --otlp-traces-endpoint`` pointed here
export their spans to traceproxy instead of the collector, and lose nothing: each
export request's bytes (after HTTP content decoding) are handed as they are to the
exporter process (``SpanExportPipe.submit_raw``), which sends them to the collector or
writes them to the span file beside the proxy's own spans. What the join needs is read
out on the way (``otlp_reader``) and kept in the ``EngineSpanStore``.

One receiver per service: in one process, in the proxy's process; with several
workers, in the service's parent, which sends each worker the stages that changed
(``on_changes``, at most every ``FLUSH_S``), as it sends the engine readings.

Answers, as a collector gives them: 200 with an empty ``ExportTraceServiceResponse``;
400 (gRPC INVALID_ARGUMENT) for a body that is not one (or whose gzip does not inflate);
413 (RESOURCE_EXHAUSTED) for one over ``MAX_BODY_BYTES``, before it is read or,
compressed, as soon as it inflates past it; 415 for another content type (OTLP/JSON is
not taken) or content encoding. Each refusal is counted by
reason (``rejected``) and its reason is in the answer (HTTP: a ``google.rpc.Status``, as
OTLP says), never a crash. The HTTP side is a server of its own
(``engine_receiver_http``: one path, one method); gRPC itself refuses a message over
twice the cap before it reaches the handler (uncounted here: gRPC's limit).

Cost: reading a batch happens on the event loop: protobuf's C parser (about 0.2 us a
span), then facts built in Python for the spans the store reads (``read_engine_request``)
and the store's update, once per trace and request. A body over ``THREAD_BODY_BYTES``
is read in a thread, so one huge request cannot hold the loop. The store is bounded
(``engine_spans``); the relay is bounded by the exporter's queue, counted in spans
(``relay_dropped``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

import grpc

from .engine_join import stage_message
from .engine_receiver_http import REASONS, BodyRefused, OtlpHttpServer
from .engine_spans import EngineSpanStore, read_engine_request
from .export_wire import RawSpans
from .otlp_reader import MalformedOtlp, count_spans

log = logging.getLogger("traceproxy.engine_spans")

MAX_BODY_BYTES = 4 << 20  # gRPC's default receive limit, and far past any batch SGLang sends (64 spans)
THREAD_BODY_BYTES = 64 << 10
FLUSH_S = 0.1
SWEEP_S = 1.0
SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"


class EngineSpans:
    """The receivers, the store and the relay. ``relay``: what takes a ``RawSpans`` to
    traceproxy's span destination (``submit_raw``: a ``SpanExportPipe``, or the pipe to the
    proxy from the receivers' own process); None: spans are kept for the join, relayed
    nowhere."""

    def __init__(self, http_address, grpc_address, *, max_traces: int, relay=None) -> None:
        self.http_address, self.grpc_address = http_address, grpc_address
        self.store = EngineSpanStore(max_traces)
        self.relay = relay
        self.on_changes: list[Callable[[dict], None]] = []
        self.requests = 0
        self.rejected = dict.fromkeys(REASONS, 0)
        self.spans_relayed = self.relay_dropped = 0
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self._http: OtlpHttpServer | None = None
        self._grpc: grpc.aio.Server | None = None
        self._ticker: asyncio.Task | None = None

    # -- running -------------------------------------------------------------------
    async def start(self) -> None:
        if self.http_address is not None:
            await self._start_http(self.http_address)
        if self.grpc_address is not None:
            await self._start_grpc(self.grpc_address)
        self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="traceproxy-engine-spans")

    async def _start_http(self, address) -> None:
        self._http = OtlpHttpServer(self.take, self._refused, MAX_BODY_BYTES, take_now=self.take_now,
                                    take_now_bytes=THREAD_BODY_BYTES)
        try:
            self.http_port = await self._http.start(address.host, address.port)
        except OSError as exc:
            await self.stop()
            raise OSError(exc.errno, f"engines.otlp_receiver {address}: {exc.strerror or exc}") from None

    async def _start_grpc(self, address) -> None:
        # gRPC sets SO_REUSEPORT by default on Linux: a second proxy given the same address
        # would then listen beside the first and take half of the engines' spans, silently.
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 2 * MAX_BODY_BYTES),
                                          ("grpc.so_reuseport", 0)])
        handler = grpc.method_handlers_generic_handler(
            SERVICE, {"Export": grpc.unary_unary_rpc_method_handler(self._grpc_export)})  # bytes in, bytes out
        server.add_generic_rpc_handlers((handler,))
        target = str(address)  # HOST:PORT, an IPv6 host in brackets
        try:
            port = server.add_insecure_port(target)
        except RuntimeError:
            port = 0
        if not port:
            await self.stop()
            raise OSError(f"engines.otlp_receiver_grpc {target}: cannot listen there (in use, or not this "
                          "machine's address)")
        self._grpc, self.grpc_port = server, port
        await server.start()

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        if self._http is not None:
            await self._http.stop()
            self._http = None
        if self._grpc is not None:
            await self._grpc.stop(0)
            self._grpc = None

    async def _tick(self) -> None:
        """Send the stages that changed; once a second, sweep."""
        swept = time.monotonic()
        while True:
            await asyncio.sleep(FLUSH_S)
            changes = self.store.take_changes()  # taken even with nobody to tell: the set stays bounded
            if changes and self.on_changes:
                message = stage_message(changes, self.store.seen_engine_spans)
                for listener in self.on_changes:
                    listener(message)
            if time.monotonic() - swept >= SWEEP_S:
                swept = time.monotonic()
                self.store.sweep(time.monotonic_ns())

    # -- one export request ------------------------------------------------------------
    async def take(self, body: bytes, peer: str) -> int:
        """Keep what the join needs and relay the request; the spans it held. Raises BodyRefused."""
        if len(body) <= THREAD_BODY_BYTES:
            return self.take_now(body, peer)
        return self._keep(await asyncio.to_thread(_read, body), body, peer)

    def take_now(self, body: bytes, peer: str) -> int:
        """``take`` on the loop, for a body of at most ``THREAD_BODY_BYTES``."""
        return self._keep(_read(body), body, peer)

    def _keep(self, batches: list, body: bytes, peer: str) -> int:
        spans = count_spans(batches)
        self.requests += 1
        self.store.add(batches, peer, time.monotonic_ns())
        if self.relay is not None and spans:
            if self.relay.submit_raw(RawSpans(body, spans)):
                self.spans_relayed += spans
            else:
                self.relay_dropped += spans
        return spans

    def _refused(self, refusal: BodyRefused, where: str) -> None:
        self.rejected[refusal.reason] += 1
        log.debug("engine spans refused (%s) from %s: %s", refusal.reason, where, refusal)

    # -- gRPC ----------------------------------------------------------------------------
    async def _grpc_export(self, request: bytes, context) -> bytes:
        peer = context.peer()
        try:
            if len(request) > MAX_BODY_BYTES:
                raise BodyRefused("too_large", f"a request of {len(request)} bytes, over {MAX_BODY_BYTES}")
            await self.take(request, peer)
        except BodyRefused as refusal:
            self._refused(refusal, peer)
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if refusal.reason == "too_large" else \
                grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, str(refusal))
        return b""

    # -- reading -------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return os.getpid()

    def open_work(self) -> list:
        """(trace id, EngineStage) of the traces with a worker that has not finished, updated
        longest ago first (whether a request in flight has them is the caller's to judge)."""
        return self.store.open_traces()

    def numbers(self) -> dict:
        """The ``engine_spans`` object of ``/debug/inflight``."""
        return {"otlp_http": self.http_port, "otlp_grpc": self.grpc_port, "requests": self.requests,
                "rejected": dict(self.rejected), "spans_relayed": self.spans_relayed,
                "relay_dropped": self.relay_dropped, **self.store.numbers()}


def _read(body: bytes) -> list:
    """``read_engine_request``, a body it cannot read refused as malformed."""
    try:
        return read_engine_request(body)
    except MalformedOtlp as exc:
        raise BodyRefused("malformed", str(exc)) from None
