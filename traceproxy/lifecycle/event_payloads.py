"""What one event's JSON data says, judged by its bytes: output or not, and what it reports.

Theory of operation
-------------------
``PayloadJudge.judge`` takes the data of one event (``stream_events`` finds the
events) where it lies in the buffer, and answers with its kind: ``OUTPUT`` when it
carries generated output (see ``stream_events`` for the list), ``HEARTBEAT`` when
it is of a known shape (``choices``, ``meta_info``, ``usage``) and carries none,
``ERROR`` for an in-band error, and ``OUTPUT`` again for JSON of no known shape
(not known to be a heartbeat). On the way it keeps what the stream reports:
the response ``model``, the engine's token counts (``usage``, or SGLang's
``meta_info``), finish reasons, the first error's message.

It judges with ``bytes.find`` and byte comparisons, never decoding on the usual
path. A key's quoted name cannot occur unescaped inside a JSON string, so on
valid JSON a find of ``"content"`` followed by a colon is the key itself (keys
spelled with ``\\u`` escapes are not recognised; the engines write none). The
decoder is called for an event that names ``"error"`` and carries no output (is
the error top-level, or nested in some field?), and for a string holding escapes
that is kept (a model name, a finish reason).

Per stream it learns: which shape the events have (OpenAI-shaped or SGLang
``/generate``, from the first event that tells), which output key came last (it is
tried first), and, for ``/generate``, the last ``completion_tokens`` and text (new
output is a higher count, or a changed text). One judge per response.
"""

from __future__ import annotations

import json
import re
from typing import Callable

# The kinds of events, as bits: feed() returns those its chunk completed, OR-ed.
OUTPUT = 1
HEARTBEAT = 2
DONE = 4
ERROR = 8
KIND_NAMES = {OUTPUT: "output", HEARTBEAT: "heartbeat", DONE: "done", ERROR: "error"}

MAX_FINISH_REASONS = 8  # distinct reasons kept (n > 1 choices may each end differently)
MAX_NAME_CHARS = 256  # model names and finish reasons longer than this are cut
MAX_ERROR_CHARS = 512

# Keys whose non-empty string value is generated output, in the order tried while
# no key has carried output yet.
_OUTPUT_KEYS = (b'"content"', b'"reasoning_content"', b'"reasoning"', b'"text"', b'"arguments"', b'"refusal"',
                b'"delta"', b'"partial_json"', b'"thinking"')
_TOOL_CALL_KEYS = (b'"tool_calls"', b'"function_call"')
_WHITESPACE = b" \t\r\n"
_DIGITS = re.compile(rb"\d+")
_COLON, _QUOTE, _BRACE, _BRACKET, _CLOSE_BRACKET, _N = 58, 34, 123, 91, 93, 110


class PayloadJudge:
    """The data of one stream's events, judged one event at a time, in order."""

    __slots__ = ("_decode", "_keys", "_generate", "_last_generated", "_text_signature", "hot",
                 "model", "prompt_tokens", "completion_tokens", "finish_reasons", "error")

    def __init__(self, decode: Callable[[bytes], object] = json.loads):
        self._decode = decode
        self._keys = _OUTPUT_KEYS
        self._generate: bool | None = None  # SGLang /generate events (None: not known yet)
        self._last_generated = -1  # the highest meta_info.completion_tokens so far
        self._text_signature: tuple[int, bytes] | None = None
        # The bytes that carried output when an OpenAI-shaped event was last judged
        # here, up to the value's opening quote ('"content":"'): the scanner judges the
        # events that follow with them where it can, without calling judge.
        self.hot: bytes | None = None
        self.model: str | None = None
        self.prompt_tokens: int | None = None  # the engine's own counts, None if it gave none
        self.completion_tokens: int | None = None
        self.finish_reasons: list[str] = []
        self.error: str | None = None  # the first in-band error's message

    def judge(self, buf, start: int, end: int) -> int:
        """The kind of the event whose JSON data is ``buf[start:end]`` (it opens with ``{``)."""
        generate = self._generate
        if generate is None:
            generate = self._generate = self._dialect(buf, start, end)
            if generate:
                self.hot = None  # /generate events are judged in full, every one
        if self.model is None and not generate:  # (a /generate event names none)
            self._look_for_model(buf, start, end)
        if generate:
            kind = self._judge_generate(buf, start, end)
        else:
            # OpenAI-shaped: the key that last carried output first, written
            # "content":"x or (json.dumps) "content": "x, with no call; then the finish
            # reason and usage, near the end, where null is the usual value.
            kind = 0
            key = self._keys[0]
            at = buf.find(key, start, end)
            if at >= 0:
                value = at + len(key)
                if value + 3 < end and buf[value] == _COLON:
                    value += 2 if buf[value + 1] == 32 else 1
                    if buf[value] == _QUOTE and buf[value + 1] != _QUOTE:
                        kind = OUTPUT
                        if self.hot is None or not buf.startswith(self.hot, at):
                            self.hot = bytes(buf[at:value + 1])
            if not kind:
                kind = self._output_field(buf, start, end)
            at = buf.rfind(b'"finish_reason"', start, end)
            if at >= 0 and not null_at(buf, at + 15, end) and self._note_finish_reasons(buf, at, start, end):
                kind = OUTPUT
            at = buf.rfind(b'"usage"', start, end)
            if at >= 0 and not null_at(buf, at + 7, end):
                self._note_usage(buf, at + 7, end)
        if kind:
            return kind
        if buf.find(b'"error"', start, end) >= 0 and self._is_error(buf, start, end):
            return ERROR
        if generate or _find_any(buf, (b'"choices"', b'"usage"', b'"meta_info"'), start, end):
            return HEARTBEAT
        if buf.find(b'"', start, end) < 0:  # no key at all: "{}" is a keep-alive
            return HEARTBEAT if bytes(buf[start:end]).strip() == b"{}" else OUTPUT
        return OUTPUT  # JSON of no known shape: not known to be a heartbeat

    @staticmethod
    def _dialect(buf, start: int, end: int) -> bool | None:
        """True: SGLang /generate events; False: OpenAI-shaped; None: not known from this one."""
        if buf.find(b'"meta_info"', start, end) >= 0:
            return True
        if buf.find(b'"choices"', start, end) >= 0:
            return False
        return None

    # ------------------------------------------------------------------------------
    # OpenAI-shaped events (chat, completions) and others
    # ------------------------------------------------------------------------------
    def _output_field(self, buf, start: int, end: int) -> int:
        """OUTPUT when some output key has a non-empty string, or a tool call a name."""
        keys = self._keys
        for key in keys:
            if _has_text(buf, key, start, end):
                if key is not keys[0]:  # try it first from now on
                    self._keys = (key,) + tuple(k for k in _OUTPUT_KEYS if k is not key)
                return OUTPUT
        return OUTPUT if self._has_tool_call_name(buf, start, end) else 0

    def _note_finish_reasons(self, buf, last: int, start: int, end: int) -> bool:
        """Every non-null finish reason (one per choice), from the last one back."""
        found = False
        while last >= 0:
            if self._note_finish(buf, last + 15, end):
                found = True
            last = buf.rfind(b'"finish_reason"', start, last)
        return found

    @staticmethod
    def _has_tool_call_name(buf, start: int, end: int) -> bool:
        """A tool call's first delta: its function name (its arguments may still be empty)."""
        for key in _TOOL_CALL_KEYS:
            at = buf.find(key, start, end)
            if at >= 0:
                value = _value_at(buf, at + len(key), end)
                if value < end and buf[value] != _N and _has_text(buf, b'"name"', value, end):
                    return True
        return False

    def _note_usage(self, buf, at: int, end: int) -> None:
        value = _value_at(buf, at, end)
        if value >= end or buf[value] != _BRACE:
            return  # "usage": null
        prompt = _int_after(buf, b'"prompt_tokens"', value, end)
        if prompt is not None:
            self.prompt_tokens = prompt
        completion = _int_after(buf, b'"completion_tokens"', value, end)
        if completion is not None:
            self.completion_tokens = completion

    def _look_for_model(self, buf, start: int, end: int) -> None:
        at = buf.find(b'"model"', start, end)
        if at >= 0:
            value = _value_at(buf, at + 7, end)
            if value < end and buf[value] == _QUOTE:
                self.model = self._string_at(buf, value, end)

    # ------------------------------------------------------------------------------
    # SGLang /generate events: the whole text so far, token ids, meta_info
    # ------------------------------------------------------------------------------
    def _judge_generate(self, buf, start: int, end: int) -> int:
        kind = 0
        for key in (b'"output_ids"', b'"token_ids"'):
            at = buf.find(key, start, end)
            if at >= 0:
                value = _value_at(buf, at + len(key), end)
                if value < end and buf[value] == _BRACKET:
                    first = _value_at(buf, value + 1, end, colon=False)
                    if first < end and buf[first] != _CLOSE_BRACKET:
                        kind = OUTPUT
                        break
        meta = buf.find(b'"meta_info"', start, end)
        counted = False
        if meta >= 0:
            completion = _int_after(buf, b'"completion_tokens"', meta, end)
            if completion is not None:
                counted = True
                self.completion_tokens = completion
                if completion > self._last_generated:
                    self._last_generated = completion
                    kind = OUTPUT
            if self.prompt_tokens is None:
                self.prompt_tokens = _int_after(buf, b'"prompt_tokens"', meta, end)
            at = buf.find(b'"finish_reason"', meta, end)
            if at >= 0 and self._note_finish(buf, at + 15, end):
                kind = OUTPUT
        if not counted and self._text_changed(buf, start, end):
            # Without a token count, the text (whole so far, or the new piece) tells.
            kind = OUTPUT
        return kind

    def _text_changed(self, buf, start: int, end: int) -> bool:
        """The text differs from the last event's, by its length and last bytes."""
        at = buf.find(b'"text"', start, end)
        if at < 0:
            return False
        value = _value_at(buf, at + 6, end)
        if value >= end or buf[value] != _QUOTE:
            return False
        close = string_end(buf, value, end)
        signature = (close - value, bytes(buf[max(value + 1, close - 16):close]))
        changed = signature != self._text_signature and close > value + 1
        self._text_signature = signature
        return changed

    # ------------------------------------------------------------------------------
    # Finish reasons, errors, strings
    # ------------------------------------------------------------------------------
    def _note_finish(self, buf, at: int, end: int) -> bool:
        """After a ``"finish_reason"`` key: True when it is not null (and the reason kept)."""
        value = _value_at(buf, at, end)
        if value >= end or buf[value] == _N:
            return False
        if buf[value] == _BRACE:  # /generate: {"type": "length", "length": 16}
            kind = buf.find(b'"type"', value, end)
            value = _value_at(buf, kind + 6, end) if kind >= 0 else end
        reason = self._string_at(buf, value, end) if value < end and buf[value] == _QUOTE else "unknown"
        if reason not in self.finish_reasons and len(self.finish_reasons) < MAX_FINISH_REASONS:
            self.finish_reasons.append(reason)
        return True

    def _is_error(self, buf, start: int, end: int) -> bool:
        """The event's top level is an error (decoded: the key may be nested elsewhere)."""
        try:
            doc = self._decode(bytes(buf[start:end]))
        except (ValueError, TypeError):
            return False
        if not isinstance(doc, dict):
            return False
        error = doc.get("error")
        if isinstance(error, dict):
            message = error.get("message") or error.get("type") or json.dumps(error)
        elif isinstance(error, str):
            message = error
        elif doc.get("object") == "error":
            message = doc.get("message") or "error"
        else:
            return False
        if self.error is None:
            self.error = str(message)[:MAX_ERROR_CHARS]
        return True

    def note_error_text(self, payload: bytes) -> None:
        """An event named error: its message, from JSON when it is."""
        if payload.lstrip()[:1] == b"{" and self._is_error(payload, 0, len(payload)):
            return
        if self.error is None:
            self.error = payload.decode("utf-8", "replace")[:MAX_ERROR_CHARS] or "error event"

    def _string_at(self, buf, quote: int, end: int) -> str:
        """The JSON string that opens at ``buf[quote]``, cut to MAX_NAME_CHARS."""
        close = string_end(buf, quote, end)
        raw = bytes(buf[quote + 1:min(close, quote + 1 + 4 * MAX_NAME_CHARS)])
        if b"\\" in raw:
            try:
                return str(self._decode(b'"' + raw + b'"'))[:MAX_NAME_CHARS]
            except (ValueError, TypeError):
                pass
        return raw.decode("utf-8", "replace")[:MAX_NAME_CHARS]


# ----------------------------------------------------------------------------------
# Byte helpers: positions in buf[start:end], nothing copied
# ----------------------------------------------------------------------------------
def _value_at(buf, at: int, end: int, colon: bool = True) -> int:
    """Where the value after a key ending at ``at`` begins, past the colon and any
    whitespace; ``end`` when no colon follows (a string value that reads like a key)."""
    while at < end and buf[at] in _WHITESPACE:
        at += 1
    if colon:
        if at >= end or buf[at] != _COLON:
            return end
        at += 1
        while at < end and buf[at] in _WHITESPACE:
            at += 1
    return at


def null_at(buf, at: int, end: int) -> bool:
    """The value after a key ending at ``at`` is null, written ":null" or ": null"
    (other spacing reads as not null, and is then looked at closely)."""
    if at + 5 < end and buf[at] == _COLON:
        return buf[at + 2] == _N if buf[at + 1] == 32 else buf[at + 1] == _N
    return False


def _has_text(buf, key: bytes, start: int, end: int) -> bool:
    """Some ``key`` in buf[start:end] has a non-empty string value."""
    at = buf.find(key, start, end)
    while at >= 0:
        value = at + len(key)
        # "key":"x or "key": "x is the usual case: a few byte tests, no call.
        if value + 3 < end and buf[value] == _COLON and buf[value + 1] in b' "':
            value += 2 if buf[value + 1] == 32 else 1
            if buf[value] == _QUOTE and buf[value + 1] != _QUOTE:
                return True
        else:
            value = _value_at(buf, value, end)
            if value + 1 < end and buf[value] == _QUOTE and buf[value + 1] != _QUOTE:
                return True
        at = buf.find(key, value, end)
    return False


def _int_after(buf, key: bytes, start: int, end: int) -> int | None:
    at = buf.find(key, start, end)
    if at < 0:
        return None
    found = _DIGITS.match(buf, _value_at(buf, at + len(key), end), end)
    return int(found.group()) if found else None


def string_end(buf, quote: int, end: int) -> int:
    """The index of the quote closing the string opened at ``quote`` (``end`` if none)."""
    at = buf.find(b'"', quote + 1, end)
    while at >= 0:
        backslashes = 0
        while buf[at - 1 - backslashes] == 92:
            backslashes += 1
        if backslashes % 2 == 0:
            return at
        at = buf.find(b'"', at + 1, end)
    return end


def _find_any(buf, keys: tuple[bytes, ...], start: int, end: int) -> bool:
    return any(buf.find(key, start, end) >= 0 for key in keys)
