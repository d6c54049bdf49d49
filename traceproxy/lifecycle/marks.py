"""Every timestamp name of a request's life, in one grammar.

Theory of operation
-------------------
A mark is the moment an edge was crossed: ``first``/``last`` x ``downstream``
(the client side) / ``upstream`` (the router or engine side) x ``rx`` (received by
the proxy) / ``tx`` (sent by the proxy), plus the upstream pool marks and the
moment either side's connection closed under the request. The grammar
follows Envoy's ``UpstreamTiming`` so that an operator who knows one knows the other.

A phase is the gap between two marks (see ``machine``), so "stuck in phase X"
always means "mark Y has not arrived yet".

Request marks live on the request (``timeline.RequestRecord``); upstream marks live
on each upstream attempt (``timeline.Attempt``), because a request resent after a
stale pooled connection has two sets of them.
"""

from __future__ import annotations

import enum


class Mark(enum.IntEnum):
    # Downstream: the client's request coming in.
    FIRST_DOWNSTREAM_RX_BYTE = 0
    LAST_DOWNSTREAM_RX_HEADER_BYTE = 1
    LAST_DOWNSTREAM_RX_BYTE = 2
    # Pool: waiting for and getting an upstream connection.
    POOL_QUEUED = 3
    POOL_ACQUIRED = 4
    # Upstream: the request going out, the response coming back.
    FIRST_UPSTREAM_TX_BYTE = 5
    LAST_UPSTREAM_TX_BYTE = 6
    FIRST_UPSTREAM_RX_BYTE = 7
    LAST_UPSTREAM_RX_HEADER_BYTE = 8
    FIRST_UPSTREAM_RX_BODY_BYTE = 9
    LAST_UPSTREAM_RX_BYTE = 10
    # Downstream: the response going out to the client.
    FIRST_DOWNSTREAM_TX_BYTE = 11
    FIRST_DOWNSTREAM_TX_BODY_BYTE = 12
    LAST_DOWNSTREAM_TX_BYTE = 13
    # Disconnects: a connection that ended while a request or attempt was still on
    # it. The client's, stamped on the request; the upstream's (by either side:
    # the engine closed or reset it, or the proxy let go of it), on the attempt.
    DOWNSTREAM_CLOSED = 14
    UPSTREAM_CLOSED = 15

    @property
    def label(self) -> str:
        """The exported name, e.g. ``first_upstream_rx_byte``."""
        return self.name.lower()

    @property
    def is_upstream(self) -> bool:
        return self in UPSTREAM_MARKS


# The same members as plain class attributes, for code that runs on every
# request. On CPython 3.11 ``EnumType`` defines ``__getattr__``, which sends every
# attribute read on an enum class (``Mark.POOL_ACQUIRED``) through a slow hook:
# about 80 ns, against 10 on a plain class, and the request path reads some thirty
# marks per request. ``MARK.X is Mark.X``.
MARK = type("MARK", (), {"__slots__": (), **{member.name: member for member in Mark}})

UPSTREAM_MARKS = frozenset(
    {
        Mark.POOL_QUEUED,
        Mark.POOL_ACQUIRED,
        Mark.FIRST_UPSTREAM_TX_BYTE,
        Mark.LAST_UPSTREAM_TX_BYTE,
        Mark.FIRST_UPSTREAM_RX_BYTE,
        Mark.LAST_UPSTREAM_RX_HEADER_BYTE,
        Mark.FIRST_UPSTREAM_RX_BODY_BYTE,
        Mark.LAST_UPSTREAM_RX_BYTE,
        Mark.UPSTREAM_CLOSED,
    }
)

DOWNSTREAM_MARKS = frozenset(set(Mark) - UPSTREAM_MARKS)
