"""How an exchange ends: the reasons, and what each one does.

Theory of operation
-------------------
Every exchange ends exactly once, through ``forward.Exchange.end``, with an ``Ending``
(why it ends) and an outcome from the flag table. The reason alone decides what the
client is sent and what becomes of the upstream connection; the caller decides
nothing else. ``Exchange.end`` reads these from the table below.

The rules that judge an ending (whether a response that ended cleanly is whole, what
a client that left had, what a lost upstream connection means) are pure, and live in
``lifecycle.endings``.
"""

from __future__ import annotations

import enum


class Ending(enum.Enum):
    """Why an exchange ends: what its client is sent, and what becomes of its upstream connection."""

    # The response was complete upstream and the client took it: OK, or PFE (our own
    # framing came out short or long), NDN (an event stream without its end) or USE
    # (an event stream whose upstream said in band that it failed).
    # The upstream connection was released (to the pool, or closed) when it completed.
    COMPLETE = ("the whole response", "released when the response completed", True)
    # A failure, a timeout, an abort: the client gets an error reply, or sees its
    # response cut (no clean end). The upstream connection is reset, so that the engine
    # sees it at once, even behind request bytes it has not read.
    FAILED = ("an error reply, or its response cut", "reset", True)
    # The client closed (DC; USE after an in-band error): nothing can be sent. The
    # upstream connection is reset.
    CLIENT_LEFT = ("nothing: it is gone", "reset", True)
    # The client left once it had its stream's end (data: [DONE]): OK (USE after an
    # in-band error), as judged when it left. Whatever happens after is nobody's
    # response; the upstream connection is pooled if its last bytes came in time, else
    # closed.
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
