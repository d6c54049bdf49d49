"""A chunked body's trailer section, sized from the reads (both sides).

Theory of operation
-------------------
``limits.max_header_bytes`` holds a trailer section as it holds a head: httptools
gathers each trailer field until its line ends (and the request side keeps them all).
What counts is the section's field lines as llhttp reads them (``name: value`` and
CRLF, as ``field_size``: the whitespace before a value, which llhttp drops, is not
counted), and nothing else. The chunk framing before it (chunk sizes, extensions, the
CRLF after each chunk's data, the last chunk's ``0`` line) never counts: llhttp keeps
none of it, and the proxy re-chunks bodies and drops extensions. So the answer
depends on the section alone, never on how the reads cut it.

llhttp gives no offsets, and the reads that carry body data are not looked at (the
hot path), so where the section begins is found from the bytes:

* When the body ends, from its end (``section_at_end``): the section is the field
  lines before the empty line that ends the message, back to the first line that is
  not one. That line is the last chunk's: a chunk line never starts with a token and a
  colon, and the lines between it and the end are all field lines.
* Between body reads, a ``TrailerWatch`` follows the reads that carry no body data,
  from the last read that did (its ``tail``), one line at a time, and tells how much
  of a section has certainly come: a limit passed there cannot wait for the end (the
  httptools buffer). A line that began in the tail may be that read's body data (the
  read ended at the data's end, or with its CR): it counts only once a later line
  shows it was framing.

Hazard: a line of hex digits alone that spans reads may be a chunk size or the name
of a trailer field, when the line before it may be a last chunk's or a field line but
may also be body data. As a name it would grow httptools' buffer without bound, so it
is held to the limit then (as a trailer line of that name). Only a chunk size padded
with that many zeros, behind body data whose last line looks like a last chunk's or a
field line, is refused for it.
"""

from __future__ import annotations

import re

# RFC 9110 section 5.6.2: a field name is a token; a line that starts with one and a
# colon is a field line (a chunk line never is: its size is followed by ";" or its end).
_TOKEN_PREFIX = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]*")
_HEX_DIGITS = re.compile(rb"[0-9A-Fa-f]*")
# llhttp reads a chunk size of at most 16 significant hex digits (64 bits); more is an
# error, so a longer run of them can only be a field name.
_MAX_SIZE_DIGITS = 16

# What a line read so far (without its CR) can be.
_FIELD = 0  # a field line: a token and a colon
_NAME = 1  # token characters that no chunk size has: a field name still coming
_DIGITS = 2  # hex digits alone: a chunk size, or a field name still coming (see Hazard)
_NOT_FIELD = 3  # anything else: a chunk line, the empty line, a line of body data

# How a read that ends a body without trailers ends: with a last line "0" (the field
# lines before the empty line at the end are the trailer section, and "0" is none);
# or, the usual last read of its own, with that line alone.
NO_TRAILERS_END = b"\r\n0\r\n\r\n"
_LAST_CHUNK_ALONE = b"0\r\n\r\n"


def field_size(content: bytes) -> int:
    """A field line (or its first bytes) as llhttp reads it: ``name: value`` and CRLF."""
    name, _, value = content.partition(b":")
    return len(name) + len(value.lstrip(b" \t")) + 4


def _kind(content: bytes, whole: bool) -> int:
    """What ``content`` (a line without its CRLF, or the start of one) is."""
    name_end = _TOKEN_PREFIX.match(content).end()
    if name_end < len(content):
        return _FIELD if name_end and content[name_end] == 0x3A else _NOT_FIELD  # 0x3A: ":"
    if whole or not content:
        return _NOT_FIELD  # no colon in the whole line: a chunk size, or empty
    digits = content.lstrip(b"0")
    if len(digits) > _MAX_SIZE_DIGITS or _HEX_DIGITS.match(digits).end() < len(digits):
        return _NAME
    return _DIGITS


def _is_last_chunk(content: bytes) -> bool:
    size = content.partition(b";")[0]
    return bool(size) and not size.strip(b"0")


def _may_precede_a_field(content: bytes) -> bool:
    """A trailer line follows only a last chunk's line or another trailer line."""
    return _kind(content, True) == _FIELD or _is_last_chunk(content)


def _kept(partial: bytes) -> bytes:
    """What the line read so far needs to keep, so that no line grows memory: a field
    line without the whitespace llhttp drops before its value; a chunk line (or other
    line that is no field) up to its first character past the size, which tells a last
    chunk's line. Field names and digits are bounded by the limit, or a chunk size's by
    its 16 digits (see TrailerWatch.read)."""
    ended = partial.endswith(b"\r")
    content = partial[:-1] if ended else partial
    kind = _kind(content, ended)
    if kind == _FIELD:
        name, _, value = content.partition(b":")
        content = name + b":" + value.lstrip(b" \t")
    elif kind == _NOT_FIELD:
        content = content[:_TOKEN_PREFIX.match(content).end() + 1]
    return content + b"\r" if ended else content


class TrailerWatch:
    """Reads of a chunked body that carried no body data, after ``tail``, the last read
    that did (or that ended the head). See the module's theory of operation."""

    __slots__ = ("_tail", "_tail_end", "_tail_lines", "_partial", "_tail_line_open", "_lines", "_back_to_tail",
                 "_in_section", "_after_section_line")

    def __init__(self, tail: bytes) -> None:
        self._tail = tail
        self._tail_end = tail.rfind(b"\n") + 1  # the tail's whole lines end here
        self._tail_lines: int | None = None  # the field lines they end with (see _tail_section)
        self._partial = _kept(tail[self._tail_end:])  # the line read so far
        # The line read so far began in the tail and framing reads added no more than
        # its CR to it: it may be the tail's body data (see the module docstring).
        self._tail_line_open = self._tail_end < len(tail)
        self._lines = 0  # field lines read whole since the last line that was none
        self._back_to_tail = True  # no such line yet: the field lines may go on in the tail
        self._in_section = False  # a line read whole showed the trailer section has begun
        # The line before the one read so far looks like a last chunk's or a field line,
        # so a trailer line may follow it (see Hazard): the tail's last whole line.
        line_end = self._tail_end - 1
        last_line = tail[tail.rfind(b"\n", 0, line_end) + 1:line_end].removesuffix(b"\r")
        self._after_section_line = line_end < 0 or _may_precede_a_field(last_line)

    def read(self, data: bytes) -> int:
        """Goes on with ``data`` (a read with no body data); returns the bytes of the
        trailer section that certainly came so far (see Hazard for a line of digits)."""
        self._take(data)
        partial = self._partial
        ended = partial.endswith(b"\r")
        content = partial[:-1] if ended else partial
        kind = _kind(content, ended)
        if not (self._in_section or (kind in (_FIELD, _NAME) and not self._tail_line_open)):
            if kind != _DIGITS:
                return 0
            if self._after_section_line:
                return field_size(content)
            if content.startswith(b"00"):  # a chunk size: its padding need not be kept
                self._partial = b"0" + content.lstrip(b"0")
            return 0
        return self._lines + (field_size(content) if kind != _NOT_FIELD else 0) + self._tail_section()

    def at_end(self, data: bytes) -> int:
        """The trailer section's size, ``data`` being what ends the body (after the
        reads ``read`` took), up to the message's end."""
        self._take(data[:len(data.rstrip(b"\r\n"))])  # the empty line that ends it (and any CRLF after)
        content = self._partial.rstrip(b"\r")
        if not content:  # the last line came whole before
            return self._lines + self._tail_section()
        if _kind(content, True) != _FIELD:
            return 0  # the last chunk's line: no trailers
        return self._lines + field_size(content) + self._tail_section()

    # -- internals ---------------------------------------------------------------
    def _take(self, data: bytes) -> None:
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            line = self._partial + data[start:end]
            framing = not (self._tail_line_open and data[start:end] in (b"", b"\r"))
            self._line_read(line[:-1] if line.endswith(b"\r") else line, framing)
            self._partial, self._tail_line_open = b"", False
            start = end + 1
        rest = data[start:]
        if rest:
            if self._tail_line_open and rest != b"\r":
                self._tail_line_open = False  # framing bytes go on with it: it is framing
            self._partial = _kept(self._partial + rest)

    def _line_read(self, content: bytes, framing: bool) -> None:
        self._after_section_line = _may_precede_a_field(content)
        if _kind(content, True) == _FIELD:
            self._lines += field_size(content)
            self._in_section = self._in_section or framing
        else:
            self._lines, self._back_to_tail = 0, False
            if framing and _is_last_chunk(content):
                self._in_section = True

    def _tail_section(self) -> int:
        """The field lines the tail ends with (asked only once the section has begun,
        so they go back to the last chunk's line, which is after the tail's body data)."""
        if not self._back_to_tail:
            return 0
        if self._tail_lines is not None:
            return self._tail_lines
        tail, total, end = self._tail, 0, self._tail_end - 1
        while end > 0:
            start = tail.rfind(b"\n", 0, end) + 1
            content = tail[start:end - 1] if tail[end - 1:end] == b"\r" else tail[start:end]
            if not start or _kind(content, True) != _FIELD:
                break
            total += field_size(content)
            end = start - 1
        self._tail_lines = total
        return total


def section_at_end(last_read: bytes, since_body: bytes | TrailerWatch, carried_body: bool) -> int:
    """The trailer section's size when ``last_read`` ended a chunked body at its end.
    ``carried_body``: it carried body data (or ended the head), so the whole section is
    in it; else ``since_body`` is the last read that did, or the watch that followed it."""
    if last_read == _LAST_CHUNK_ALONE:
        if since_body.__class__ is bytes and since_body.endswith(b"\n"):
            return 0  # its "0" line begins where the last body read ended: a line of its own
    elif last_read.endswith(NO_TRAILERS_END):
        return 0
    if carried_body:  # its last line read so far, and the lines before it walked back
        return TrailerWatch(last_read[:len(last_read.rstrip(b"\r\n"))]).at_end(b"")
    watch = since_body if since_body.__class__ is TrailerWatch else TrailerWatch(since_body)
    return watch.at_end(last_read)
