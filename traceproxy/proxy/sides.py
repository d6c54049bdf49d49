"""What each side of a request needs from the other, declared once.

Theory of operation
-------------------
A request crosses three objects. The client connection (``downstream.ClientConnection``)
reads it and writes its response; the exchange (``forward.Exchange``) carries it from
the pool to its end; an upstream connection (``upstream.UpstreamConnection``) sends it
and parses the response. The pool (``upstream.UpstreamPool``) hands out connections.
None of them reaches into another's fields or transport: each uses only what is
declared here.

* ``ClientSide``: what an exchange needs of its client connection.
* ``UpstreamSide``: what an exchange needs of the upstream connection it was given.
* ``UpstreamUser``: what an upstream connection reports to the request it carries
  (the exchange's ``relay.ResponseRelay``).
* ``ConnectionWaiter``: what the pool needs of whoever asks it for a connection. The
  pool calls back once, with a connection or with a failure, and knows nothing else
  of requests.

What the watchdog may do to a request in flight is ``lifecycle.timeline.RequestOwner``.

The protocols are structural: no class inherits from them, and a test double needs
only these members. Hazard: a callback here can run inside another's parser callback
(an upstream read ends a response, which hands the client connection back, which
starts the next pipelined request); each side re-checks its own state (``finished``,
``closing``) on entry instead of assuming the order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..lifecycle.timeline import UpstreamConnectionRecord
    from .headers import ForwardingContext, ResponseParts
    from .timer import ExchangeTimer


class ClientSide(Protocol):
    """The client connection, as the exchange being answered on it sees it."""

    forwarding: ForwardingContext  # this connection's X-Forwarded-* lines, formatted once
    feeding: bool  # inside a client read: upstream writes wait for the read's end (one write per read)
    closing: bool  # the connection is closing: no response goes out keep-alive
    write_paused: bool  # the client's transport is full
    exchange_timer: ExchangeTimer  # the connection's, aimed by the exchange it is answering

    @property
    def reading_paused(self) -> bool: ...

    def write(self, data: bytes) -> None: ...

    def reset(self) -> None:
        """Close with RST: a response cut short must not read as complete."""

    def unsent(self) -> int | None:
        """Bytes written that the client has not acknowledged yet; None if unknown."""

    def pause_reading(self, reason: str) -> None: ...

    def resume_reading(self, reason: str) -> None: ...

    def exchange_finished(self, exchange: object, keep_alive: bool, drain: bool = False) -> None:
        """The exchange ended: the connection is the next request's, or closes. With
        ``drain`` (an answer before the end of the request body), the rest of the body
        is read and thrown away first (see linger.py)."""


class UpstreamSide(Protocol):
    """An upstream connection, as the exchange it was given to sees it."""

    record: UpstreamConnectionRecord
    write_paused: bool  # outlives a request: the next one on this connection starts paused

    def begin_response(self, user: UpstreamUser, head_only: bool) -> None: ...

    def send(self, data: bytes) -> None: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> bool:
        """Resume reading; False (and nothing done) when the connection is closing."""


class UpstreamUser(Protocol):
    """The request an upstream connection carries: told of every parse event, in order."""

    def upstream_first_byte(self) -> None:
        """A response head began in a read that did not complete it."""

    def upstream_response_head(self, status: int, reason: bytes, parts: ResponseParts) -> None: ...

    def upstream_response_body(self, data: bytes) -> None: ...

    def upstream_response_complete(self, reusable: bool) -> None:
        """Called after the read that completed it was parsed in full, never inside the parser."""

    def flush_client(self) -> None:
        """The read is parsed: write what it produced for the client in one call."""

    def upstream_lost(self, exc: BaseException | None, bytes_received: int) -> None: ...

    def upstream_protocol_error(self, detail: str) -> None: ...

    def upstream_write_paused(self) -> None: ...

    def upstream_write_resumed(self) -> None: ...


class ConnectionWaiter(Protocol):
    """Whoever asks the pool for a connection. Exactly one of ``connection_ready`` and
    ``connection_failed`` is called, unless the waiter gives up first (``UpstreamPool.give_up``)."""

    def connection_ready(self, conn: UpstreamSide, reused: bool) -> None: ...

    def connection_failed(self, error: str) -> None: ...

    def connection_queued(self) -> None:
        """Waiting for a slot at ``pool.max_connections``."""

    def connection_opening(self) -> None:
        """A connect started for it, after it waited for a slot."""
