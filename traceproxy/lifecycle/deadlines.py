"""Request deadlines: which ``[timeouts]`` limit ends a request next, and how.

Theory of operation
-------------------
Four limits can end a request in flight, each bounding one side's silence:

* ``upstream_headers`` (UT): no response head within the limit of the client's
  last request byte. Still queued for a pool slot when it passes, it is the
  proxy's own cap instead (PWS).
* ``client_body`` (DBT): the client silent mid-body.
* ``upstream_read`` (SI): the response started, then the upstream fell silent.
* ``client_send`` (DNR): the client's connection full, and the client taking
  none of the response.

``next_deadline`` answers "what is the next deadline, and what ends the request
then?" from the request's marks, flags and the limits (0: off). The proxy aims one
timer at it and asks again when the timer fires, since the marks may have moved
the deadline on; past it, ``client_took_more`` and ``expiry`` say what firing
means. ``next_deadline`` runs at every request's start and response head: it takes
scalars and keeps the earliest deadline as it goes, building nothing.

Invariants
----------
* Silence counts only while it is that side's turn. A pipelined request's wait
  for its turn is not the client's silence: its clock starts at the request's
  start. While the proxy is not reading the body (the upstream not taking it, no
  connection yet), the body wait is the upstream's: the body deadline stays a
  full limit ahead and the header deadline runs. While the proxy has paused
  upstream reads because the client is not reading, the upstream is not silent.
* The header deadline counts from the client's last request byte: the client's
  own upload time is never the upstream's, and the body deadline covers it.
* A tie between the body and header deadlines is the client's: it went silent
  first. Otherwise, of equal deadlines, the one listed first above wins.
* The send deadline counts from when the client last took any of the response:
  a slow reader keeps its connection full for long, and is still reading.

It does not know the clock, timers, sockets, or how the bytes the client took
are counted (the kernel's unsent queue): the proxy reads those and passes them
in. The stall watchdog (``stall``, ``attribution``) reports waits without ending
them, with its own thresholds.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from .flags import Flag, Outcome
from .marks import Mark
from .timeline import RequestRecord


class TimeoutLimits(Protocol):
    """The ``[timeouts]`` limits a request is held to, in nanoseconds (0: off)."""

    upstream_headers_ns: int
    client_body_ns: int
    upstream_read_ns: int
    client_send_ns: int


def next_deadline(
    now: int, limits: TimeoutLimits, *, started_ns: int, last_client_byte_ns: int | None, expects_body: bool,
    request_complete: bool, reading_paused: bool, response_started: bool, response_complete: bool,
    last_upstream_byte_ns: int | None, upstream_paused_by_client: bool, client_paused: bool, client_taken_ns: int,
) -> tuple[int, Outcome] | None:
    """(deadline ns, outcome) of the limit that expires first, of those that apply; None when none does.

    ``reading_paused``: the proxy is not reading the client (the upstream not taking
    the body, or no connection yet). ``client_paused``: the client's connection is
    full. ``client_taken_ns``: when the client last took any of the response.
    """
    due, outcome = 0, None
    # The time a pipelined request waited for its turn (the proxy not reading) is nobody's silence.
    silent_since = last_client_byte_ns or 0
    if silent_since < started_ns:
        silent_since = started_ns
    client_body_ns = limits.client_body_ns
    owes_body = client_body_ns and expects_body and not request_complete
    waits_on_us = owes_body and reading_paused  # the body wait is the upstream's, not the client's
    upstream_headers_ns = limits.upstream_headers_ns
    if upstream_headers_ns and not response_started and (not owes_body or waits_on_us):
        due, outcome = silent_since + upstream_headers_ns, Flag.UT
    if owes_body:
        body_due = (now if waits_on_us else silent_since) + client_body_ns
        if outcome is None or body_due <= due:  # a tie is the client's: it went silent first
            due, outcome = body_due, Flag.DBT
    upstream_read_ns = limits.upstream_read_ns
    if upstream_read_ns and response_started and not response_complete:
        read_due = (now if upstream_paused_by_client else last_upstream_byte_ns) + upstream_read_ns
        if outcome is None or read_due < due:
            due, outcome = read_due, Flag.SI
    client_send_ns = limits.client_send_ns
    if client_send_ns and client_paused:
        send_due = client_taken_ns + client_send_ns
        if outcome is None or send_due < due:
            due, outcome = send_due, Flag.DNR
    return None if outcome is None else (due, outcome)


def client_took_more(taken: int, taken_before: int) -> bool:
    """At the send deadline: the client took some of the response since it was set, so
    the deadline moves on instead of ending the request. Byte counts as acknowledged
    by the client; -1 when unknown, which is never progress."""
    return taken > taken_before


class Expiry(NamedTuple):
    outcome: Outcome
    detail: str  # for the error reply, the log and the span
    client_kept: bool  # False: the client's connection closes after this, whatever else allows it


def expiry(expired: Outcome, due_ns: int, now: int, record: RequestRecord, limits: TimeoutLimits,
           where: str, max_connections: int) -> Expiry:
    """What a passed deadline ends the request with. ``expired`` and ``due_ns`` are what
    ``next_deadline`` gave; ``where`` names the upstream side ("upstream host:port on
    reused connection #3 ..."); ``max_connections`` is the pool's cap."""
    if expired is Flag.UT:
        return _upstream_headers_expired(record, limits, where, max_connections)
    if expired is Flag.DBT:
        # due = the silence's start + the limit
        silent = (now - due_ns + limits.client_body_ns) / 1e9
        return Expiry(Flag.DBT, f"request body silent for {silent:.1f} s after "
                                f"{record.downstream_rx_body_bytes} bytes", client_kept=False)
    if expired is Flag.SI:
        silent = (now - record.last_upstream_rx_ns) / 1e9
        return Expiry(Flag.SI, f"{where}: response body silent for {silent:.1f} s "
                               f"after {record.upstream_rx_body_bytes} bytes", client_kept=True)
    if expired is Flag.DNR:
        return Expiry(Flag.DNR, f"the client took none of the response for {limits.client_send_ns / 1e9:g} s "
                                f"after {record.downstream_tx_body_bytes} body bytes", client_kept=False)
    raise ValueError(f"{expired.code} is not a deadline's outcome")


def _upstream_headers_expired(record: RequestRecord, limits: TimeoutLimits, where: str,
                              max_connections: int) -> Expiry:
    waited = limits.upstream_headers_ns / 1e9
    if record.has(Mark.POOL_QUEUED) and not record.has(Mark.POOL_ACQUIRED):
        # Still queued for a connection at pool.max_connections: the proxy's own limit.
        return Expiry(Flag.PWS, f"no upstream connection free within {waited:g} s: pool.max_connections "
                                f"({max_connections}) reached", client_kept=True)
    return Expiry(Flag.UT, f"{where}: no response headers within {waited:g} s of the client's last request byte",
                  client_kept=True)
