"""Counting the bytes of request heads and trailers, which llhttp does not report.

Theory of operation
-------------------
httptools concatenates a header value until it ends, so a client streaming one
endless header (or trailer) would grow memory; and llhttp gives no offsets, so how
many bytes a head took is not known from its callbacks. A ``HeadMeter`` (one per
client connection) counts them from the reads themselves:

* Only bytes known to be the head's count: a read that began it at its first byte,
  or one wholly inside it. A head that began behind a pipelined request's body in the
  same read is counted from the next read on (at most one read uncounted), so that
  body is never taken for head bytes; where such a head began is known only when the
  request before it began in the same read at a known place and had no chunked body
  (``head_begins``).
* A head still incomplete at the end of a read is held to ``limits.max_header_bytes``
  there (``head_too_long``). A head that ends in the read it began in is sized only
  when that read is longer than the limit (``head_exceeds``): most heads never are.
* A chunked body's trailer section is held to the same limit by its field lines
  alone, never its chunk framing (see trailers.py): at the body's end by the lines
  llhttp handed over (``trailers_exceed``), and between body reads by a
  ``TrailerWatch`` over the reads that carry no body data (``trailers_too_long``),
  since httptools gathers a field until its line ends.
* The request line is kept while a head spans reads, so that a line without a version
  (HTTP/0.9's) is refused where it ends, and what ends the line when it is not
  ``HTTP/`` is found (``unexpected_protocol``).

The client connection tells it where reads, heads and bodies begin (``read_begins``,
``head_begins``, ``in_head``, ``chunked_body_begins``, ``body_seen``, ``chunked``) and
which read last carried body data (``since_body``); it never sees the parser. The
header lines and target it needs are passed in.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from . import headers as H
from .trailers import TrailerWatch

if TYPE_CHECKING:
    from .forward import Exchange

# RFC 9110 section 5.6.2: a method is a token (bounded here: it is quoted back).
_METHOD_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,32}")


def field_lines_size(fields: H.Headers) -> int:
    """``name: value`` lines as llhttp read them, CRLF-ended (without the whitespace it
    strips before a value: as trailers.field_size counts them from the bytes)."""
    return sum(len(name) + len(value) + 4 for name, value in fields)


class HeadMeter:
    __slots__ = ("max_head_bytes", "_line_room", "data", "begun", "_at_request_start", "_continued", "in_head",
                 "head_bytes", "_head_tail", "line", "head_start", "body_seen", "chunked", "since_body",
                 "_head_fields")

    def __init__(self, max_head_bytes: int, max_target_bytes: int) -> None:
        self.max_head_bytes = max_head_bytes
        self._line_room = max_target_bytes + 64
        # The read being fed: its bytes, the requests begun in it, and whether it began
        # at a request's first byte, or inside a head begun in an earlier read.
        self.data = b""
        self.begun = 0
        self._at_request_start = False
        self._continued = False
        # The head being read: between a request's first byte and its complete head.
        self.in_head = False
        self.head_bytes = 0  # counted so far (see head_too_long)
        self._head_tail = b""  # the last bytes of the last read counted into it
        self.line = b""  # the request line's bytes from earlier reads, when it spans reads
        # Where it began in the read it began in; None: not known (see head_begins).
        self.head_start: int | None = 0
        # A chunked body being read: whether the read being fed carried body bytes (or
        # ended its head); the last read that did (set by the reader at the end of such a
        # read), or the watch over the reads of chunk framing or trailers alone since
        # then; and the head's header lines (what llhttp hands over after them are trailers).
        self.body_seen = False
        self.chunked = False
        self.since_body: bytes | TrailerWatch = b""
        self._head_fields = 0

    # -- what the client connection reports ------------------------------------------
    def read_begins(self, data: bytes, parsing: bool) -> None:
        """A read is about to be fed; ``parsing``: a request was in progress before it."""
        self._continued = parsing and self.in_head
        self._at_request_start = not parsing
        self.data, self.begun, self.body_seen = data, 0, False

    def head_begins(self, before: Exchange | None, sequence: int) -> None:
        """A request's first byte, request number ``sequence``; ``before``: the exchange of
        the request before it on this connection, if any is still here."""
        self.begun += 1
        self.head_bytes, self.line, self.in_head = 0, b"", True
        # At the read's first byte, or found behind the request before it.
        self.head_start = 0 if self._at_request_start and self.begun == 1 else self._where_head_begins(
            before, sequence)

    def chunked_body_begins(self, fields: int) -> None:
        """The head passed, with ``fields`` header lines, and a chunked body follows (until
        the message completes: ``chunked`` is cleared then). The read that ended the head
        is where its framing is looked for from (as one that carried body bytes)."""
        self.chunked, self.body_seen, self._head_fields = True, True, fields

    # -- heads -----------------------------------------------------------------------
    def head_too_long(self) -> bool:
        """Counts the bytes of a head still incomplete at the end of the read (and keeps
        its request line's bytes, for the protocol check when the head is complete)."""
        data = self.data
        if self._continued and not self.begun:
            self.head_bytes += len(data)  # the whole read belongs to the head begun earlier
            if self.line and b"\n" not in self.line:
                self.line += data[:self._line_room]
        elif self.begun and self.head_start is not None:
            start = self._past_empty_lines(self.head_start)
            self.head_bytes = len(data) - start  # it began in this read
            self.line = data[start:start + self._line_room]
        else:
            return False  # it began behind other requests' bytes: counted from the next read on
        self._head_tail = data[-3:]  # the empty line that ends the head may straddle reads
        return self.head_bytes > self.max_head_bytes

    def line_without_version(self) -> bool:
        """The request line of a head still incomplete ended without a version: HTTP/0.9's,
        which has no header section. llhttp reads on for headers, so the header timeout
        would answer it 30 s later; it is refused where the line ends. Decided only on
        a whole line (a read may end anywhere in ``GET / HTTP/1.1``), and only for a
        head whose start is known (see head_too_long; else the header timeout answers)."""
        line, ended, _ = self.line.partition(b"\n")
        # llhttp refused any other shape: METHOD SP target, then SP protocol or the end.
        return bool(ended) and b" " not in line.partition(b" ")[2]

    def head_exceeds(self, method: str, url: bytes, headers: H.Headers) -> bool:
        """The complete head is larger than the limit. The reads counted can exceed it
        only if the head could; a head begun behind other bytes of a read was not
        counted in that read, so it is always sized."""
        return ((self.head_start is None or self.head_bytes + len(self.data) > self.max_head_bytes)
                and self._head_size(method, url, headers) > self.max_head_bytes)

    def _head_size(self, method: str, url: bytes, headers: H.Headers) -> int:
        """The head's size: exact when its start is known (see _where_head_begins) and it
        ends in this read, or it began in earlier reads all counted whole (it ends at the
        first empty line). Otherwise its start is not known: it is at least its request
        line and header lines as llhttp read them (only optional whitespace around values,
        which llhttp strips, goes uncounted), and at least what later reads held of it."""
        start = self.head_start
        lines_size = len(method) + len(url) + 12 + field_lines_size(headers) + 2
        if self.begun and start is not None:
            start = self._past_empty_lines(start)
            end = self.data.find(b"\r\n\r\n", start)
            if end >= 0:
                return end + 4 - start
        elif self._continued and not self.begun and self.head_bytes:
            # Begun in earlier reads, counted (whole, or from the read after its first): it
            # ends at the first empty line here.
            end = (self._head_tail + self.data).find(b"\r\n\r\n")
            if end >= 0:
                counted = self.head_bytes - len(self._head_tail) + end + 4
                return counted if self.head_start is not None else max(counted, lines_size)
        return lines_size

    def _where_head_begins(self, before: Exchange | None, sequence: int) -> int | None:
        """Where in the read a head begun behind another request starts: right after the
        request before it, when that one began in this read at a known place (the read's
        first byte, or found the same way) and had no chunked body; else not known
        (llhttp gives no offsets). That request began and ended in this read: its body
        is all here."""
        previous_start = self.head_start
        if self.begun < 2 or previous_start is None:
            return None
        if before is None or before.record.sequence != sequence - 1 or before.head.framing.chunked:
            return None  # refused, or answered already; or chunk framing of unknown size
        end = self.data.find(b"\r\n\r\n", self._past_empty_lines(previous_start))
        return end + 4 + before.record.downstream_rx_body_bytes if end >= 0 else None

    def _past_empty_lines(self, offset: int) -> int:
        """Where a request line begins: llhttp skips the empty lines before one (RFC 9112
        section 2.2); they are not head, and their CRLFs are not its end."""
        return H.EMPTY_LINES.match(self.data, offset).end()

    def unexpected_protocol(self, method: bytes, url: bytes) -> bytes | None:
        """What ends the request line when it is not ``HTTP/`` (llhttp also reads RTSP and
        ICE request lines), else None. The line is ``METHOD SP target SP protocol``, found
        from where the head began. For a head begun at an unknown place in this read (behind
        a chunked body), the read's ``METHOD target`` lines: refused only when none of them
        goes on with ``HTTP/``, since a body before it may hold the same words. Not checked:
        a head begun at an unknown place in an earlier read."""
        data, line_start = self.data, method + b" " + url + b" "
        if self.begun and self.head_start is not None:
            start = self._past_empty_lines(self.head_start)
            return _protocol_unless_http(data, start + len(line_start))
        if not self.begun and self.line:
            line = self.line + data[:len(line_start) + 16]  # the line may end in this read
            return _protocol_unless_http(line, len(line_start))
        first_found, at = None, data.find(line_start) if self.begun else -1
        while at >= 0:
            found = _protocol_unless_http(data, at + len(line_start))
            if found is None:
                return None
            first_found = first_found or found
            at = data.find(line_start, at + len(line_start))
        return first_found

    def unknown_method(self) -> str | None:
        """The method of a request llhttp does not know, when it is a well-formed token
        at the read's first byte (not garbage, not behind other requests in the read)."""
        if not (self._at_request_start and self.begun == 1):
            return None
        method = self.data.partition(b" ")[0]
        return method.decode("ascii") if _METHOD_TOKEN.fullmatch(method) else None

    # -- chunked bodies ----------------------------------------------------------------
    def trailers_too_long(self) -> bool:
        """A read of a chunked body that carried no body bytes: the trailer section so
        far is past the limit (chunk sizes and extensions never count: see trailers.py)."""
        watch = self.since_body
        if watch.__class__ is bytes:
            watch = self.since_body = TrailerWatch(watch)
        return watch.read(self.data) > self.max_head_bytes

    def trailers_exceed(self, headers: H.Headers) -> bool:
        """The trailer section is past the limit, by the field lines llhttp handed over
        (the same count as trailers_too_long's). Asked at the end of a chunked body."""
        return (len(headers) > self._head_fields
                and field_lines_size(headers[self._head_fields:]) > self.max_head_bytes)


def _protocol_unless_http(data: bytes, at: int) -> bytes | None:
    if data.startswith(b"HTTP/", at) or len(data) < at + 5:  # too short to tell: not refused
        return None
    return data[at:at + 16].partition(b"\r")[0]
