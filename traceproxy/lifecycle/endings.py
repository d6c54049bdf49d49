"""How a request's ending is judged: the rules the exchange asks at its end.

Theory of operation
-------------------
``proxy.forward.Exchange.end`` ends every exchange once, with a reason
(``proxy.endings.Ending``) and an outcome; these rules decide the outcome where the
reason alone does not:

* a response that ended cleanly is checked against the proxy's own framing (PFE) and,
  for an event stream, against what its events said (``judge_clean_ending``): an
  in-band error is an upstream failure (USE), a stream that never said it was over
  ([DONE] or a finish reason) is NDN;
* a client that left once the upstream had said in band that the response failed did
  not fail it (``judge_client_leaving``): the request is USE, not DC, and not OK when
  it left at [DONE];
* a client that closed may have had its whole stream (``had_the_whole_stream``);
* a lost upstream connection is resent, or is UC, URX or SRC (``lost_connection``).

What an event stream said is its scanner's (``record.stream_events``, fed every
piece of the body as it came, however the reads split it), never the last bytes
read. A response whose body is coded (Content-Encoding) has no scanner: its end is
not judged by its events. Pure: the record and what the I/O knows come in as
arguments; no socket, no clock.
"""

from __future__ import annotations

from .flags import Flag, Outcome
from .timeline import Attempt, RequestRecord


def judge_clean_ending(record: RequestRecord, declared_length: int | None) -> tuple[Outcome, str | None]:
    """A response that ended cleanly: checked against our own framing, and an event
    stream against what its events said."""
    if declared_length is not None and record.downstream_tx_body_bytes != declared_length:
        return Flag.PFE, f"wrote {record.downstream_tx_body_bytes} body bytes under Content-Length {declared_length}"
    events = record.stream_events
    if events is None or record.status != 200:
        return Flag.OK, None
    if events.errors:
        return Flag.USE, stream_error(record)
    if not events.ended:
        return Flag.NDN, (f"SSE stream of {events.events} events ({record.upstream_rx_chunks} chunks) ended without "
                          f"data: [DONE] or a finish reason")
    return Flag.OK, None


def judge_client_leaving(record: RequestRecord, outcome: Outcome, detail: str | None) -> tuple[Outcome, str | None]:
    """A client that left (DC), or left with its whole stream (OK): after an in-band
    error the upstream had said the response failed, so the request is USE, blame
    engine, with what the client did after it. The openai SDK, for one, raises at the
    error event and closes; smg sends [DONE] after it."""
    events = record.stream_events
    if events is None or not events.errors or record.status != 200:
        return outcome, detail
    then = f"; then {detail}" if detail else "; then the client closed the connection after data: [DONE]"
    return Flag.USE, stream_error(record) + then


def stream_error(record: RequestRecord) -> str:
    """The error of a stream whose upstream reported one in band (see ``Flag.USE``)."""
    events = record.stream_events
    message = events.error if events is not None else None
    return (f"the upstream reported in its event stream that the response failed: "
            f"{message if message is not None else 'an error event'}")


def had_the_whole_stream(record: RequestRecord, unsent: int | None) -> bool:
    """The client, closing, had its whole event stream but the chunked terminator:
    data: [DONE] was the last event (with nothing after it), and it acknowledged every
    byte written (``unsent`` is 0). Not a finish reason, which one choice of several
    may send mid-stream."""
    events = record.stream_events
    return events is not None and record.status == 200 and events.ends_with_done and unsent == 0


def lost_connection(attempt: Attempt, bytes_received: int, resendable: bool, sent_size: int, retry_limit: int,
                    where: str, why: str) -> tuple[Outcome | None, str]:
    """What an upstream connection lost under a request means: (None, detail) to resend
    the request on a fresh connection, else its outcome and error. Resent only from a
    reused connection that failed before any response byte, once, and only if every
    byte sent is still held (``resendable``; see proxy/forward.py, Hazards: Retry safety)."""
    if bytes_received == 0 and attempt.reused and attempt.index == 0:
        if resendable:
            return None, f"{where}: {why} before any response byte"
        reason = (f"request of at least {sent_size} bytes exceeds pool.retry_buffer_bytes ({retry_limit})"
                  if retry_limit else "resending is off (pool.retry_buffer_bytes = 0)")
        return Flag.SRC, f"{where}: {why} before any response byte; {reason}, not resent"
    if attempt.index > 0 and bytes_received == 0:
        return Flag.URX, f"{where}: {why} before any response byte, after a resend"
    return Flag.UC, f"{where}: {why}, {bytes_received} bytes of the response read"


def where(authority: str, attempt: Attempt | None) -> str:
    """The upstream side of an error: "upstream host:port on reused connection #3 (idle 4.8 s, request 2)"."""
    if attempt is None or attempt.connection is None:
        return f"upstream {authority}"
    conn = attempt.connection
    kind = (f"reused connection #{conn.id} (idle {attempt.idle_age_ns / 1e9:.1f} s, "
            f"request {attempt.connection_request_number})" if attempt.reused else f"new connection #{conn.id}")
    return f"upstream {authority} on {kind}"


def close_reason(exc: BaseException | None) -> str:
    if exc is None:
        return "peer closed the connection"
    return f"connection error ({exc.strerror or exc})" if isinstance(exc, OSError) else f"connection error ({exc})"
