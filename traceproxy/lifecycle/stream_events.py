"""Token events in a ``text/event-stream`` body: which events carry generated output.

Theory of operation
-------------------
An LLM stream can keep sending bytes while no token comes (SSE comments, empty
deltas, keep-alive events a gateway adds), so for an event stream the stall clock
must count from the last event that carries output, not from the last byte (issue
23). ``EventScanner.feed`` takes the response body as it arrives, de-chunked, in
pieces split anywhere (inside a line, inside a CRLF, inside a JSON string), judges
each event once, when its blank line arrives, and returns the kinds of events the
piece completed, as a bit mask. It reads no clock: the caller stamps "last token at
now" when the mask holds ``OUTPUT``. The kinds:

* ``OUTPUT``: generated output. A non-empty string in ``content``,
  ``reasoning_content``, ``reasoning``, ``refusal``, ``text`` (completions) or
  ``arguments``, or a tool call with a non-empty function name (OpenAI chat and
  completions); a string ``delta``, ``partial_json`` or ``thinking`` (the Responses
  and Messages APIs' deltas). SGLang ``/generate`` events (they carry ``meta_info``):
  non-empty ``output_ids`` or ``token_ids``, a ``meta_info.completion_tokens`` above
  the last one, or, without a count, a ``text`` that changed. Any event with a
  non-null finish reason.
* ``HEARTBEAT``: an event without output. SSE comments (``: ping``), events with no
  data (``event: ping``, ``id:`` alone), blank data (``data: \\n\\n``), ``{}``, events
  named ``ping``, ``keepalive`` or ``heartbeat`` whatever their data, and events of a
  known shape (``choices``, ``meta_info`` or ``usage``) with no output: empty or
  role-only deltas, usage-only events, a repeated ``/generate`` event.
* ``DONE``: ``data: [DONE]``.
* ``ERROR``: an in-band error: JSON whose top level holds ``error`` (an object or a
  string) or is ``"object": "error"``, or an event named ``error``. smg sends
  ``data: {"error": {"message": "Stream error: ...", "type": "stream_error"}}``.

Not a heartbeat unless known to be one: data that is not JSON (plain-text streams
exist), a JSON array, JSON of no known shape, and an event too large to hold (over
``max_event_bytes``) are ``OUTPUT``. A heartbeat taken for output only delays a
stall verdict to what byte judgement gave; output taken for a heartbeat would call
a healthy stream stalled, and ``action = "abort"`` would end it. A blank line with
no event before it is not an event.

The scanner keeps the counts (``events``, ``output_events``, ``heartbeats``,
``errors``, ``last_output_event``), says whether the last event so far is
``[DONE]`` with nothing after it (``ends_with_done``), and at the end what the stream
reported (``summary``: the model, the engine's token counts, finish reasons, the
first error's message).

Events are found at ``\\n\\n`` (CRLF and CR line endings are rewritten to LF in a
piece that has a CR; a CR ending a piece is held back, as it may be half a CRLF, so
a CR-only stream completes an event one piece late). What one event's data says is
``event_payloads``' to judge, by its bytes.

Cost: the usual event judged with no call
------------------------------------------
Engines send one event per chunk, and write the same fields around the text in
every event. So once an event was judged in full, the scanner knows the bytes that
carried output (``"content":"``), where they sit from the event's start, and where
the null finish reason sits (from the start, or from the end when it follows the
text); and once such an event was counted, the bytes before its value (``data:
{"id":...,"delta":{"content":"``), which an engine repeats while its stream lasts.
A piece that is one whole event of one data line, starting with those bytes, with a
value that is not empty and the null finish reason there, is counted as output with
no call: a few byte tests, one slice and two comparisons (``feed`` for one piece,
``feed_pieces`` for all the pieces of one upstream read, which also spares a call
per piece). Python's cost per operation is the floor here, not the bytes: a method
call on bytes costs about what scanning a few hundred of them does. Any other piece
goes the general way, which learns the positions again; ``/generate`` events (they
repeat the whole text) and CRLF streams always go that way, at about three times
the cost. An event counted with no call is read no further: usage it carries
(vLLM's ``continuous_usage_stats``) is not read, the engine's last usage (in its
final or usage-only event, judged in full) is; and of a second choice in the same
event (``n > 1``) only the output is seen, not a finish reason. A partial event is
held in a ``bytearray`` until its end arrives.

It does not know the clock, the stall thresholds, the request body's ``model``, or
whether the response is an event stream at all: the caller feeds only
``text/event-stream`` bodies.
"""

from __future__ import annotations

import json
from typing import Callable, NamedTuple

from .event_payloads import DONE, ERROR, HEARTBEAT, KIND_NAMES, OUTPUT, PayloadJudge, null_at

__all__ = ["DONE", "ERROR", "HEARTBEAT", "KIND_NAMES", "OUTPUT", "EventScanner", "StreamSummary"]

# What no piece starts with: bytes.startswith(()) is False (the usual event's prefix
# until one is learnt; see EventScanner._learn_prefix).
_NO_PREFIX: tuple = ()

# An event longer than this is not held: the rest of it is skipped to its end, and it
# counts as output (not known to be a heartbeat). A /generate event repeats the whole
# text and its token ids, about 10 bytes a token.
MAX_EVENT_BYTES = 1 << 20
_HEARTBEAT_EVENT_NAMES = frozenset((b"ping", b"keepalive", b"keep-alive", b"heartbeat"))
_WHITESPACE = b" \t\r\n"
_COLON, _QUOTE, _BRACE, _BRACKET = 58, 34, 123, 91


class StreamSummary(NamedTuple):
    """What a stream held, for the span, the access log and the token metrics."""

    events: int
    output_events: int
    heartbeats: int
    errors: int
    done: bool
    model: str | None
    prompt_tokens: int | None  # the engine's own count (usage or meta_info), None if it gave none
    completion_tokens: int | None
    finish_reasons: tuple[str, ...]
    error: str | None  # the first in-band error's message
    last_output_event: int  # 1-based index among events of the last output event, 0 if none


class EventScanner:
    """One response body's events, judged as they complete. One scanner per response."""

    __slots__ = ("_payload", "_max_event_bytes", "_pending", "_held_cr", "_skipping", "_skip_after_newline",
                 "_hot", "_hot_at", "_hot_value_at", "_prefix", "_finish_null", "_finish_at", "_finish_slice",
                 "_armed", "_done_at", "events", "output_events", "heartbeats", "errors", "done", "last_output_event",
                 "oversized_events")

    def __init__(self, decode: Callable[[bytes], object] = json.loads, max_event_bytes: int = MAX_EVENT_BYTES):
        self._payload = PayloadJudge(decode)
        self._max_event_bytes = max_event_bytes
        self._pending: bytearray | None = None  # the start of an event whose end has not come
        self._held_cr = False  # the last chunk ended in CR: maybe the first half of a CRLF
        self._skipping = False  # inside an event too large to hold
        self._skip_after_newline = False
        # The inline judgement (_judged_inline): the bytes that carried output in the
        # last event judged in full, up to its value ('"content":"'), where they were
        # from the event's start, and the null finish reason seen with them and where
        # (from the event's start, or from its end when negative).
        self._hot: bytes | None = None
        self._hot_at = 0
        self._hot_value_at = 0  # _hot_at + len(_hot)
        self._finish_null = b""
        self._finish_at = 0
        self._finish_slice = slice(0, 0)  # where _finish_null sits in a piece of one event
        # The bytes of the usual event up to its value's first byte (_hot_value_at),
        # learnt from an event counted inline (see _learn_prefix).
        self._prefix: bytes | tuple = _NO_PREFIX
        self._armed: bytes | None = None  # _hot, for feed's own check, while nothing is held
        self.events = 0
        self.output_events = 0
        self.heartbeats = 0
        self.errors = 0
        self.done = False
        self.last_output_event = 0  # its 1-based index among events, 0 while none
        self.oversized_events = 0
        self._done_at = 0  # the index of the last data: [DONE]

    @property
    def error(self) -> str | None:
        """The first in-band error's message (see ERROR)."""
        return self._payload.error

    @property
    def ends_with_done(self) -> bool:
        """The last event so far is data: [DONE], and nothing of another event came after
        it (blank lines aside): a client that closed now had the whole stream."""
        pending = self._pending
        return (0 < self._done_at == self.events and not self._skipping
                and (pending is None or not pending.strip(b"\n")))

    @property
    def ended(self) -> bool:
        """The stream said it is over: data: [DONE] came, or a finish reason (engines
        that send no [DONE] end with one). Only events that ended (their blank line
        came) count: an event cut off at the body's end is not one."""
        return self.done or bool(self._payload.finish_reasons)

    def summary(self) -> StreamSummary:
        p = self._payload
        return StreamSummary(self.events, self.output_events, self.heartbeats, self.errors, self.done, p.model,
                             p.prompt_tokens, p.completion_tokens, tuple(p.finish_reasons), p.error,
                             self.last_output_event)

    # ------------------------------------------------------------------------------
    # Chunks in, events out
    # ------------------------------------------------------------------------------
    def feed_pieces(self, pieces: list[bytes]) -> int:
        """``feed`` for each of ``pieces`` in order (one upstream read's), with the usual
        events among the first of them counted in one pass; the kinds they completed."""
        usual = 0
        hot = self._armed
        if hot is not None:
            value, finish, null, prefix = self._hot_value_at, self._finish_slice, self._finish_null, self._prefix
            for data in pieces:
                # As in feed: one whole usual event, its value not empty, no finish reason.
                end = len(data) - 2
                if not (value < end and data[value] != 34 and data[-1] == 10 and data[end] == 10):
                    break
                rest = data[value:end]
                if not (10 not in rest and 13 not in rest and data[finish] == null
                        and (data.startswith(prefix) or self._learn_prefix(data, value, hot))):
                    break
                prefix = self._prefix
                usual += 1
            if usual:
                self.events = events = self.events + usual
                self.output_events += usual
                self.last_output_event = events
                if usual == len(pieces):
                    return OUTPUT
        kinds = OUTPUT if usual else 0
        for data in pieces[usual:] if usual else pieces:
            kinds |= self.feed(data)
        return kinds

    def feed(self, data: bytes) -> int:
        """Scan one chunk of the body; the kinds of events it completed (0: none)."""
        hot = self._armed
        if hot is not None:
            # The usual chunk, judged here with no call: one whole event of one data
            # line, ending in its blank line, that starts with the bytes the usual event
            # had before its value (so the pattern that carried output last time,
            # '"content":"', is where it was then), with a value that is not empty, no
            # line ending after it, and a null finish reason where it was then (see
            # _judged_inline). A CR or LF raw inside a JSON string is not valid JSON.
            end = len(data) - 2
            value = self._hot_value_at
            if value < end and data[value] != 34 and data[-1] == 10 and data[end] == 10:
                rest = data[value:end]
                if (10 not in rest and 13 not in rest and data[self._finish_slice] == self._finish_null
                        and (data.startswith(self._prefix) or self._learn_prefix(data, value, hot))):
                    self.events = events = self.events + 1
                    self.output_events += 1
                    self.last_output_event = events
                    return OUTPUT
        elif not data:
            return 0
        if self._held_cr or 13 in data:  # CR: "in" with an int is one memchr, no method call
            data = self._to_newlines(data)
        seen = 0
        if self._skipping:
            data, seen = self._skip_oversized(data)
            if not data:
                return seen
        pending = self._pending
        if pending is None:  # the usual case: the chunk starts with an event
            buf, look = data, 0
        else:
            look = len(pending) - 1  # the blank line may straddle the two
            pending += data
            buf = pending
        # Events end at a blank line: "\n\n" once line endings are LF. A newline is
        # rare inside an event, so each is found with memchr and its next byte tested.
        size, start = len(buf), 0
        while True:
            newline = buf.find(b"\n", look)
            if newline < 0 or newline + 1 >= size:
                break
            if buf[newline + 1] != 10:
                look = newline + 1
                continue
            if newline > start:  # else a blank line with no event before it: nothing happens
                seen |= self._event(buf, start, newline, look == start)
            start = look = newline + 2
            if start >= size:
                break
        if pending is None:
            if start < size:
                self._pending = bytearray(memoryview(data)[start:])
        elif start >= size:
            self._pending = None
        elif start:
            del pending[:start]
        # Held past the limit (and its blank line's first newline): skipped to its end.
        if self._pending is not None and len(self._pending) > self._max_event_bytes + 1:
            self._skip_after_newline = self._pending.endswith(b"\n")
            self._pending, self._skipping = None, True
        clean = self._pending is None and not self._held_cr and not self._skipping
        self._armed = self._hot if clean and self._finish_null and self._payload.hot is self._hot else None
        return seen

    def _learn_prefix(self, data: bytes, value: int, hot: bytes) -> bool:
        """A piece of one event line, its value not empty, no finish reason: when it is
        a data line with the pattern that carried output where it was last time, its
        bytes up to the value are the usual event's from now on (True)."""
        prefix = data[:value]
        if (prefix.startswith(b"data:") and data.startswith(hot, self._hot_at)
                and 10 not in prefix and 13 not in prefix):
            self._prefix = prefix
            return True
        return False

    def _judged_inline(self, buf, start: int, end: int, hot: bytes) -> bool:
        """The usual event, one data line in ``buf[start:end]``, judged without the
        general path: True (and counted) when it holds the pattern that carried output
        in the last event judged in full, with a value that is not empty, and no finish
        reason to read (none, or null). An engine writes the same fields around the
        text in every event, so the key sits at the same distance from the event's start
        every time, and the finish reason at the same distance from its start (before
        the text) or its end (after it): each is looked for there first, and where it
        is found is kept for the next event. The quoted key name cannot occur unescaped
        inside a string, so a match there is the key itself."""
        if hot is not self._hot:  # a new key carried output: where it sits is learnt anew
            self._hot, self._hot_at, self._hot_value_at, self._prefix = hot, 0, 0, _NO_PREFIX
        at = start + self._hot_at
        value = at + len(hot)
        if value >= end or not buf.startswith(hot, at):
            at = buf.find(hot, start, end)
            if at < 0:
                return False
            self._hot_at = at - start
            value = at + len(hot)
            self._hot_value_at = value - start
            self._prefix = _NO_PREFIX  # learnt again, for the value's new place
        if buf[value] == _QUOTE:
            return False
        null, where = self._finish_null, self._finish_at
        where = start + where if where >= 0 else end + 2 + where  # from the end: after the text
        if not (null and where >= start and buf.startswith(null, where)):
            at = buf.rfind(b'"finish_reason"', start, end)
            if at >= 0:
                if not null_at(buf, at + 15, end):
                    return False
                self._finish_null = null = bytes(buf[at:at + (21 if buf[at + 16] == 32 else 20)])
                self._finish_at = where = at - start if at < value else at - end - 2
                self._finish_slice = slice(where, (where + len(null)) or None)
        self.events += 1
        self.output_events += 1
        self.last_output_event = self.events
        return True

    def _to_newlines(self, data: bytes) -> bytes:
        """CRLF and CR line endings as LF. A CR at a chunk's end waits for the next byte."""
        if self._held_cr:
            self._held_cr = False
            if data[:1] != b"\n":  # it was a line ending by itself, not half a CRLF
                data = b"\n" + data
        if data.endswith(b"\r"):
            self._held_cr = True
            data = data[:-1]
        return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

    def _skip_oversized(self, data: bytes) -> tuple[bytes, int]:
        """Past the end of an event too large to hold: the rest of the chunk, and its kind."""
        if not data:  # a CR held back was all there was
            return data, 0
        if self._skip_after_newline and data[:1] == b"\n":
            rest = data[1:]
        else:
            end = data.find(b"\n\n")
            if end < 0:
                self._skip_after_newline = data.endswith(b"\n")
                return b"", 0
            rest = data[end + 2:]
        self._skipping = False
        self.oversized_events += 1
        return rest, self._tally(OUTPUT)

    # ------------------------------------------------------------------------------
    # One event: its fields, then its data
    # ------------------------------------------------------------------------------
    def _event(self, buf, start: int, end: int, one_line: bool) -> int:
        """Judge the event in ``buf[start:end]`` (its lines, without the blank line).
        ``one_line``: known to hold no newline (else it is looked for). Which way it is
        judged depends on its bytes and the events before it, never on how the body was
        split (what the general way reads, the inline one does not)."""
        if end - start > self._max_event_bytes:  # as if it had come in pieces: not held, not read
            self.oversized_events += 1
            return self._tally(OUTPUT)
        if one_line or buf.find(b"\n", start, end) < 0:  # one line: judged where it lies
            if buf.startswith(b"data:", start):
                hot = self._payload.hot
                if hot is not None and self._judged_inline(buf, start, end, hot):
                    return OUTPUT
                start += 5
                if buf[start] == 32:  # in bounds: the blank line follows
                    start += 1
                if start < end and buf[start] == _BRACE:
                    return self._tally(self._payload.judge(buf, start, end))
                return self._tally(self._judge_data(buf, start, end))
            if buf[start] == _COLON:
                return self._tally(HEARTBEAT)  # a comment: ": ping"
        return self._tally(self._judge_fields(bytes(buf[start:end])))

    def _judge_fields(self, block: bytes) -> int:
        """An event of several lines, or one that is not a data line (SSE field rules)."""
        name, data = None, []
        for line in block.split(b"\n"):
            if not line or line[0] == _COLON:
                continue  # a blank line, a comment
            field, colon, value = line.partition(b":")
            if colon and value[:1] == b" ":
                value = value[1:]
            if field == b"data":
                data.append(value)
            elif field == b"event":
                name = value.strip()
            # id, retry and unknown fields say nothing about output
        payload = b"\n".join(data)
        if name == b"error":
            self._payload.note_error_text(payload)
            return ERROR
        if name in _HEARTBEAT_EVENT_NAMES or not data:
            return HEARTBEAT
        return self._judge_data(payload, 0, len(payload))

    def _tally(self, kind: int) -> int:
        self.events += 1
        if kind == OUTPUT:
            self.output_events += 1
            self.last_output_event = self.events
        elif kind == HEARTBEAT:
            self.heartbeats += 1
        elif kind == DONE:
            self.done = True
            self._done_at = self.events
        elif kind == ERROR:
            self.errors += 1
        return kind

    def _judge_data(self, buf, start: int, end: int) -> int:
        while start < end and buf[start] in _WHITESPACE:
            start += 1
        if start >= end:
            return HEARTBEAT  # "data: " alone: a blank keep-alive event
        first = buf[start]
        if first == _BRACE:
            return self._payload.judge(buf, start, end)
        if first == _BRACKET and buf.startswith(b"[DONE]", start):
            return DONE
        return OUTPUT  # not JSON (plain text, an array): not known to be a heartbeat
