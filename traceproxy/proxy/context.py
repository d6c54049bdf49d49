"""What every connection of one proxy server shares: settings, the pool, observers.

Also the connection registry, which serves two rules: the cap on open client
connections (at the cap the longest-idle keep-alive connection is closed to make
room, so thousands of idle clients never lock out a new one), and graceful
shutdown (idle connections close at once, busy ones after their response).
"""

from __future__ import annotations

import fcntl
import os
import time
from typing import TYPE_CHECKING

from ..lifecycle.flags import Outcome
from ..lifecycle.hooks import Fanout
from ..lifecycle.marks import Mark
from ..lifecycle.timeline import RequestRecord
from . import tracecontext as tc
from .headers import ForwardingContext, RequestParts
from .upstream import UpstreamPool

if TYPE_CHECKING:
    from ..config import Settings
    from .downstream import ClientConnection
    from .forward import Exchange


# The descriptor table is grown to at most this many slots ahead of time (8 bytes each).
MAX_RESERVED_DESCRIPTORS = 65536


DESCRIPTORS_RESERVED = 64  # listeners, admin connections, the exporter's pipes, log files


def descriptors_needed(clients: int, upstream_cap: int) -> int:
    """Every client connection and every upstream connection is a descriptor
    (``upstream_cap`` 0: unlimited, at most one per client)."""
    return clients + (upstream_cap or clients) + DESCRIPTORS_RESERVED


def reserve_descriptor_table(slots: int) -> int:
    """Grow this process's file-descriptor table to hold ``slots`` descriptors now.

    The kernel grows the table by doubling when a new descriptor does not fit, and
    in a process with more than one thread (uvloop's resolver pool is enough) each
    growth waits for an RCU grace period inside ``socket()`` or ``accept()``: 10 to
    30 ms with the event loop blocked, each time the open connections first cross
    256, 512, 1024... Growing it once at startup moves those stalls out of the first
    burst of traffic. The table never shrinks. Returns the size reserved (0 if not).
    """
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, ValueError, OSError):
        return 0
    top = min(slots, soft, MAX_RESERVED_DESCRIPTORS) - 1
    if top < 256:
        return 0
    src = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        # F_DUPFD takes the lowest free descriptor >= top: it never replaces one in use.
        fd = fcntl.fcntl(src, fcntl.F_DUPFD_CLOEXEC, top)
    except OSError:
        return 0
    finally:
        os.close(src)
    os.close(fd)
    return top + 1


class ServerContext:
    def __init__(self, settings: "Settings", fanout: Fanout | None = None) -> None:
        self.settings = settings
        self.timeouts = settings.timeouts
        # The exchange deadlines in nanoseconds (0: off), as every request computes them.
        self.upstream_headers_ns = int(settings.timeouts.upstream_headers * 1e9)
        self.client_body_ns = int(settings.timeouts.client_body * 1e9)
        self.upstream_read_ns = int(settings.timeouts.upstream_read * 1e9)
        self.client_send_ns = int(settings.timeouts.client_send * 1e9)
        # The header timeout ends before the body timeout would: a request's timer,
        # aimed at its body deadline, is re-aimed when its body ends.
        self.header_timeout_shorter = 0 < self.upstream_headers_ns < self.client_body_ns
        # The soonest a request's own deadline can fall after it starts (0 with none).
        self.first_request_deadline_ns = min((ns for ns in (self.upstream_headers_ns, self.client_body_ns) if ns),
                                             default=0)
        self.limits = settings.limits
        # A FIN after whole requests: answer them (else it is a disconnect).
        self.answer_half_close = settings.limits.client_half_close == "answer"
        self.retry_buffer_bytes = settings.pool.retry_buffer_bytes
        self.upstream_authority = settings.upstream.authority
        self.advertised_keepalive = int(settings.timeouts.client_keepalive)
        self.fanout = fanout or Fanout()
        reserve_descriptor_table(descriptors_needed(settings.limits.max_client_connections,
                                                    settings.pool.max_connections))
        self.pool = UpstreamPool(
            settings.upstream.host,
            settings.upstream.port,
            idle_timeout=settings.pool.idle_timeout,
            max_connections=settings.pool.max_connections,
            connect_timeout=settings.timeouts.connect,
            keep_warm=settings.pool.keep_warm,
            max_head_bytes=settings.limits.max_header_bytes,
        )
        self.connections: set[ClientConnection] = set()
        # Open client connections that have sent a keep-alive request: each may send its
        # next at any moment (see UpstreamPool.warm_for_clients).
        self.sending_clients: set[ClientConnection] = set()
        # Idle keep-alive connections, oldest first (dicts keep insertion order).
        self.idle_connections: dict[ClientConnection, None] = {}
        self.in_flight: dict[int, RequestRecord] = {}
        # Requests whose client left at their stream's end, still reading the upstream's
        # last bytes (see Exchange.client_sent_fin): no client connection holds them.
        self.tail_waits: set[Exchange] = set()
        # Called with the ClientConnectionRecord of every closed client connection.
        self.connection_closed_listeners: list = []
        self.shutting_down = False
        self._upstream_host = settings.upstream.authority.encode("ascii")
        self.request_id_names = tuple(n.encode("ascii") for n in settings.request_id.headers)
        self.request_id_header = self.request_id_names[0]
        self.inject_rid = settings.request_id.inject_rid
        self.conversation_id_name = settings.tracing.conversation_id_header.encode("ascii")  # b"": none
        # Upstream copies of what we set ourselves on every response.
        self.pool.replaced_response_headers = frozenset({self.request_id_header, b"traceresponse"})

    # -- requests ------------------------------------------------------------------
    def start_request(self, record: RequestRecord) -> None:
        self.in_flight[record.id] = record
        if self.fanout.start_observers:
            self.fanout.request_start(record)

    def end_request(self, record: RequestRecord, outcome: Outcome, error: str | None) -> None:
        """The only way a request ends: outcome stamped once, observers told once."""
        record.finish(outcome, time.monotonic_ns(), error)
        record.owner = None  # owner <-> record is a cycle: break it so refcounting frees both
        self.in_flight.pop(record.id, None)
        if self.fanout.done_observers:
            self.fanout.done(record)

    def stamp_once(self, record: RequestRecord, now: int, *marks: Mark) -> None:
        """Stamp each of ``marks`` not stamped yet and tell the mark observers: for the
        client connection's rare edges (an exchange stamps its own, on the hot path)."""
        for mark in marks:
            if record.mark_once(mark, now) and self.fanout.mark_observers:
                self.fanout.mark(record, mark)

    def identify(self, record: RequestRecord, parts: RequestParts | None) -> bool:
        """Stamp the trace and request ids; True when the request id was generated here.

        A request whose head stalled already has ids, given by the watchdog for its
        stall span and log line: it keeps them, so that its spans join that stall
        span, unless the client's own valid trace context is to be continued."""
        stalled_ids = record.trace_id != 0
        if parts is None or not parts.traceparents:
            if not stalled_ids:
                record.trace_id = tc.new_trace_id()  # a new trace, sampled (the fields' defaults)
                record.span_id = tc.new_span_id()
        else:
            decision = tc.continue_or_start(parts.traceparents)
            if decision.parent_span_id or not stalled_ids:
                record.trace_id, record.parent_span_id = decision.trace_id, decision.parent_span_id
                record.span_id = tc.new_span_id()
            record.sampled, record.rejected_traceparent = decision.sampled, decision.rejected
        if parts is not None and parts.user_agent is not None:
            record.user_agent = parts.user_agent.decode("latin-1")
        if parts is not None and parts.conversation_id:
            record.conversation_id = parts.conversation_id
        # W3C: tracestate belongs to the traceparent it came with; without a valid one
        # (absent or rejected: a new trace starts) it is dropped.
        if parts is not None and record.parent_span_id and parts.tracestates:
            record.tracestate = b",".join(parts.tracestates)
        if parts is not None and parts.request_id is not None:
            record.request_id = parts.request_id.decode("latin-1")
            return False
        record.request_id = record.request_id or tc.new_request_id()
        return True

    def response_ids(self, record: RequestRecord) -> bytes:
        """Header lines every response carries, the proxy's own errors included."""
        return b"%s: %s\r\ntraceresponse: %s\r\n" % (
            self.request_id_header, record.request_id.encode("latin-1"),
            tc.format_traceparent(record.trace_id, record.span_id, record.sampled))

    def forwarding_for(self, client: "ClientConnection") -> ForwardingContext:
        fwd = self.settings.forwarding
        return ForwardingContext(
            client_ip=client.peer_ip,
            scheme="http",
            upstream_authority=self._upstream_host,
            preserve_host=fwd.preserve_host,
            x_forwarded=fwd.x_forwarded,
        )

    # -- connections ---------------------------------------------------------------
    def admit(self, conn: "ClientConnection") -> bool:
        """Register a new connection, evicting the longest-idle one at the cap."""
        if len(self.connections) >= self.limits.max_client_connections:
            if not self.idle_connections:
                return False
            oldest = next(iter(self.idle_connections))
            self.idle_connections.pop(oldest)
            oldest.close()
            self.connections.discard(oldest)
        self.connections.add(conn)
        return True

    def connection_idle(self, conn: "ClientConnection") -> None:
        self.idle_connections.pop(conn, None)
        self.idle_connections[conn] = None

    def connection_busy(self, conn: "ClientConnection") -> None:
        self.idle_connections.pop(conn, None)

    def client_began_sending(self, conn: "ClientConnection") -> None:
        """``conn`` began its first keep-alive request."""
        self.sending_clients.add(conn)
        self.pool.warm_for_clients(len(self.sending_clients))

    def forget(self, conn: "ClientConnection") -> None:
        self.connections.discard(conn)
        self.sending_clients.discard(conn)
        self.idle_connections.pop(conn, None)
        for listener in self.connection_closed_listeners:
            listener(conn.record)

    def begin_shutdown(self) -> None:
        self.shutting_down = True
        self.pool.stop_keeping_warm()
        for conn in list(self.idle_connections):
            conn.close()
        self.idle_connections.clear()
