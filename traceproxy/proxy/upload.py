"""What of one request is owed to its upstream, and what is kept to send it again.

Theory of operation
-------------------
One ``Upload`` per request, across its attempts; it holds bytes, never a connection,
and writes nothing itself (the exchange does). Request bytes pass through it:

* held (``hold``) while no upstream connection is ready, up to ``PENDING_HIGH_WATER``,
  past which the client is paused rather than buffered;
* gathered (``send``) into what one client read produced for the upstream (``out``),
  which the exchange writes in one call when the read is parsed (one write per read);
* logged for a resend (``sent_log``) up to ``pool.retry_buffer_bytes``. A request is
  resent only if every byte sent on its failed attempt is still held: the log is None
  past the limit, and once the upstream answered.

An attempt's head is not logged: each attempt builds its own, with its own span as
the traceparent parent. With rid injection (``bodies``) the body is held whole in
``rewrite`` until it ends, then rewritten, and only then is a connection taken.
"""

from __future__ import annotations

from ..lifecycle.timeline import RequestRecord

# Request bytes held while no upstream connection is ready yet; past this the
# client is paused rather than buffered.
PENDING_HIGH_WATER = 256 * 1024
# The start of the request body kept for span attributes (model, stream, max_tokens).
BODY_HEAD_BYTES = 8192


class Upload:
    __slots__ = ("held", "held_size", "sent_log", "sent_size", "out", "rewrite", "_retry_limit")

    def __init__(self, retry_limit: int, rewrite: bool) -> None:
        self.held: list[bytes] | None = None  # made when needed: most bodies find a connection ready
        self.held_size = 0
        self.sent_log: list[bytes] | None = [] if retry_limit else None  # 0: never resend
        self.sent_size = 0
        self.out: list[bytes] = []
        self.rewrite: list[bytes] | None = [] if rewrite else None
        self._retry_limit = retry_limit

    def hold(self, data: bytes) -> bool:
        """Keep ``data`` until a connection is ready; True when the client should pause."""
        if self.held is None:
            self.held = []
        self.held.append(data)
        self.held_size += len(data)
        return self.held_size > PENDING_HIGH_WATER

    def release_held(self) -> bytes:
        held, self.held, self.held_size = self.held, None, 0
        return b"".join(held)

    def send(self, data: bytes) -> None:
        self.sent_size += len(data)
        log = self.sent_log
        if log is not None:
            if self.sent_size <= self._retry_limit:
                log.append(data)
            else:
                self.sent_log = None
        self.out.append(data)

    def resend(self) -> None:
        """Everything the lost connection was given goes again, first, and once."""
        self.held = self.sent_log + (self.held or [])
        self.held_size = sum(len(b) for b in self.held)
        self.sent_log, self.sent_size, self.out = [], 0, []


def keep_body_evidence(record: RequestRecord, data: bytes, tail_bytes: int) -> None:
    """Keep the body's first bytes and (``tail_bytes``, when spans are on) its last: the
    top-level fields an SDK writes after a long messages list (model, stream,
    max_tokens) are near the end."""
    room = BODY_HEAD_BYTES - len(record.request_body_head)
    if room > 0:
        record.request_body_head += data[:room]
    if len(data) > room and tail_bytes:
        record.request_body_tail = (record.request_body_tail + data[-tail_bytes:])[-tail_bytes:]
