"""Phases of a request, as a table of "what we are waiting for".

Theory of operation
-------------------
A request's phase is not stored: it is derived from which marks are set. Each row
of ``PHASES`` names a phase for the mark that ends it, in the order a healthy
request crosses them. Edges can come out of that order, so ``phase_of`` reads the
response side first (an upstream that answers 413 before the request body is
complete is streaming its response, whatever the request body is doing), then the
first request-side edge not crossed yet (a body that arrived before the upstream
connection leaves the request waiting for the connection).

This module knows nothing about time limits or blame; ``stall`` and
``attribution`` build on the phase it reports.
"""

from __future__ import annotations

import enum

from .marks import Mark
from .timeline import RequestRecord


class Phase(str, enum.Enum):
    AWAITING_REQUEST_HEADERS = "awaiting_request_headers"
    AWAITING_UPSTREAM_CONNECTION = "awaiting_upstream_connection"
    AWAITING_REQUEST_BODY = "awaiting_request_body"
    SENDING_REQUEST_UPSTREAM = "sending_request_upstream"
    AWAITING_UPSTREAM_HEADERS = "awaiting_upstream_headers"
    STREAMING_RESPONSE = "streaming_response"
    DRAINING_TO_CLIENT = "draining_to_client"
    DONE = "done"


# (phase, the mark that ends it). Read top to bottom: the life of a healthy request.
PHASES: tuple[tuple[Phase, Mark | None], ...] = (
    (Phase.AWAITING_REQUEST_HEADERS, Mark.LAST_DOWNSTREAM_RX_HEADER_BYTE),
    (Phase.AWAITING_UPSTREAM_CONNECTION, Mark.POOL_ACQUIRED),
    (Phase.AWAITING_REQUEST_BODY, Mark.LAST_DOWNSTREAM_RX_BYTE),
    (Phase.SENDING_REQUEST_UPSTREAM, Mark.LAST_UPSTREAM_TX_BYTE),
    (Phase.AWAITING_UPSTREAM_HEADERS, Mark.LAST_UPSTREAM_RX_HEADER_BYTE),
    (Phase.STREAMING_RESPONSE, Mark.LAST_UPSTREAM_RX_BYTE),
    (Phase.DRAINING_TO_CLIENT, Mark.LAST_DOWNSTREAM_TX_BYTE),
    (Phase.DONE, None),
)

AWAITED_MARK: dict[Phase, Mark | None] = dict(PHASES)


# Rows from the response side: once the upstream answered, what the request side is
# still doing no longer decides the phase.
_RESPONSE_SIDE = (
    (Mark.LAST_UPSTREAM_RX_BYTE, Phase.DRAINING_TO_CLIENT),
    (Mark.LAST_UPSTREAM_RX_HEADER_BYTE, Phase.STREAMING_RESPONSE),
)


# What a pipelined request in flight is doing while the responses before it finish:
# nobody owes it a byte yet (shown beside the phases, in /debug/inflight and metrics).
WAITING_TURN = "waiting_turn"


def in_flight_phase(record: RequestRecord) -> str:
    """The phase a request in flight is shown in: its own, or waiting its turn."""
    return WAITING_TURN if record.waiting_turn else phase_of(record).value


def phase_of(record: RequestRecord) -> Phase:
    if record.finished:
        return Phase.DONE
    if not record.has(Mark.LAST_DOWNSTREAM_RX_HEADER_BYTE):
        return Phase.AWAITING_REQUEST_HEADERS
    for mark, phase in _RESPONSE_SIDE:
        if record.has(mark):
            return phase
    # Request side: the first edge not crossed yet. The body may finish before a
    # connection is ready (the phase is then still the connection), and a connection
    # may be ready before the body (the phase is the body).
    for phase, ends_with in PHASES[1:5]:
        if not record.has(ends_with):
            return phase
    return Phase.AWAITING_UPSTREAM_HEADERS
