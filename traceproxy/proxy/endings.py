"""How an exchange ends: the reasons, and the rules that judge an ending.

Theory of operation
-------------------
Every exchange ends exactly once, through ``forward.Exchange.end``, with an ``Ending``
(why it ends) and an outcome from the flag table. The reason alone decides what the
client is sent and what becomes of the upstream connection; the caller decides
nothing else. ``Exchange.end`` reads these from the table below.

The functions are the rules the exchange asks at its end: whether a response that
ended cleanly is whole (``judge_clean_ending``), whether a client that closed may have
had its whole stream (``last_event_is_done``), what a lost upstream connection means
(``lost_connection``), and how the upstream side is named in an error (``where``).
They read the record and take what the I/O knows as arguments: no socket, no clock.
"""

from __future__ import annotations

import enum
import re

from ..lifecycle.flags import Flag, Outcome
from ..lifecycle.timeline import Attempt, RequestRecord

_FINISH_REASON = re.compile(rb'"finish_reason"\s*:\s*"')


class Ending(enum.Enum):
    """Why an exchange ends: what its client is sent, and what becomes of its upstream connection."""

    # The response was complete upstream and the client took it: OK, or PFE (our own
    # framing came out short or long) or NDN (an event stream without its end).
    # The upstream connection was released (to the pool, or closed) when it completed.
    COMPLETE = ("the whole response", "released when the response completed", True)
    # A failure, a timeout, an abort: the client gets an error reply, or sees its
    # response cut (no clean end). The upstream connection is reset, so that the engine
    # sees it at once, even behind request bytes it has not read.
    FAILED = ("an error reply, or its response cut", "reset", True)
    # The client closed (DC): nothing can be sent. The upstream connection is reset.
    CLIENT_LEFT = ("nothing: it is gone", "reset", True)
    # The client left once it had its stream's end (data: [DONE]): OK, as judged when it
    # left. Whatever happens after is nobody's response; the upstream connection is
    # pooled if its last bytes came in time, else closed.
    CLIENT_HAD_ITS_STREAM = ("nothing more: it had the whole stream", "pooled if its last bytes came, else closed", True)
    # A pipelined request whose turn never came (the connection is closing): nothing of
    # it was sent anywhere, and nothing is written for it (bytes after a response that
    # ended the connection would be read as part of that response).
    NOT_STARTED = ("nothing: its turn never came", "none was taken", False)

    def __init__(self, client_is_sent: str, upstream_connection: str, hands_back: bool) -> None:
        self.client_is_sent = client_is_sent
        self.upstream_connection = upstream_connection
        self.resets_upstream = upstream_connection == "reset"
        # The client connection is handed back (the next request's turn, or its close);
        # a request that never had the turn has none to hand back.
        self.hands_back = hands_back


# The same members as plain class attributes, for code that runs on every request:
# on CPython 3.11 an enum class sends every attribute read through a slow hook (about
# 80 ns against 10; see lifecycle.marks.MARK). ``END.X is Ending.X``.
END = type("END", (), {"__slots__": (), **{member.name: member for member in Ending}})


def judge_clean_ending(record: RequestRecord, declared_length: int | None, event_stream: bool) -> tuple[Outcome, str | None]:
    """A response that ended cleanly: checked against our own framing, and for SSE completeness."""
    if declared_length is not None and record.downstream_tx_body_bytes != declared_length:
        return Flag.PFE, f"wrote {record.downstream_tx_body_bytes} body bytes under Content-Length {declared_length}"
    if event_stream and record.status == 200 and not _stream_ended(record):
        return Flag.NDN, (f"SSE stream of {record.upstream_rx_chunks} chunks ended without "
                          f"data: [DONE] or a finish reason")
    return Flag.OK, None


def _stream_ended(record: RequestRecord) -> bool:
    """The stream's last reads hold data: [DONE] or a finish reason (a stream that
    ended: no choice is left unfinished)."""
    _, previous, last = record.response_tail
    # The usual ending is found in the last read's last 2 KiB, without copying them.
    if last.find(b"[DONE]", -2048) >= 0:
        return True
    tail = previous[-512:] + last[-2048:]
    return b"[DONE]" in tail or _FINISH_REASON.search(tail) is not None


def last_event_is_done(record: RequestRecord) -> bool:
    """The event stream's last event so far is data: [DONE]. A client that closed had
    its whole stream when this holds and it acknowledged every byte written. Not a
    finish reason, which one choice of several may send mid-stream."""
    _, previous, last = record.response_tail
    tail = previous[-18:] + last[-18:]  # the event may be split across reads
    return tail.endswith((b"data: [DONE]\n\n", b"data: [DONE]\r\n\r\n"))


def lost_connection(attempt: Attempt, bytes_received: int, resendable: bool, sent_size: int, retry_limit: int,
                    where: str, why: str) -> tuple[Outcome | None, str]:
    """What an upstream connection lost under a request means: (None, detail) to resend
    the request on a fresh connection, else its outcome and error. Resent only from a
    reused connection that failed before any response byte, once, and only if every
    byte sent is still held (``resendable``; see forward.py, Hazards: Retry safety)."""
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
