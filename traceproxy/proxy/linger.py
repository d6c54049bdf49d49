"""Lingering: reading on after an answer that went out before the client finished sending.

Theory of operation
-------------------
The proxy can answer while the client is still sending: an error before the end of
the request body, a refusal in the middle of a head. Closing then, with the client's
bytes unread, makes the kernel reset the connection, and a reset destroys what the
client has not read yet: the answer. So the client connection reads on and throws
away what still comes (``downstream.ClientConnection``), in at most two stages of
``LINGER_SECONDS`` each, as nginx's discarded body and lingering close do:

1. Draining: the rest of the request body the answer came before is still parsed (to
   find its end) and thrown away. If it ends within the time and ``LINGER_MAX_BYTES``,
   the connection carries on with the next request, as the answer's keep-alive said.
2. Closing: the proxy's FIN is out. Everything is thrown away unparsed until the
   client's FIN, then the connection closes; with part of the answer still unsent
   after the time, it is reset, so that the client sees it cut.

A drain that does not end in time goes on as a lingering close. The exchange that
answered decides whether its connection may be kept (``drainable``) before it writes
the answer, which says so.
"""

from __future__ import annotations

from .headers import RequestFraming

LINGER_SECONDS = 2.0  # each stage
LINGER_MAX_BYTES = 8 * 1024 * 1024  # the most of a body drained to keep the connection


def drainable(framing: RequestFraming, received: int) -> bool:
    """Whether the rest of a request body, ``received`` bytes of it read, can be drained
    to keep the connection (a chunked body's rest is bounded while it is drained)."""
    return framing.chunked or framing.content_length - received <= LINGER_MAX_BYTES
