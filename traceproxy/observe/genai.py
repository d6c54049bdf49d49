"""What a request says about its model and tokens: for the per-model metrics and the spans.

Theory of operation
-------------------
Read once per request, when it ends, from what the proxy kept on its record: the start
(and, past those, the end) of the request body, the last upstream reads, and for an
event stream its scanner (``lifecycle.stream_events``) and the times of its first and
last output events. Nothing here runs per chunk.

* ``request_model``: the request body's top-level ``model``. A body kept whole is
  decoded (orjson, about 1 to 4 us for the bodies that fit the kept head); a longer one,
  of which only its start and end were kept, is searched for a ``"model": "..."`` field
  with a string value, first at its very start (where curl and most harnesses write it),
  then in its kept end (where the OpenAI SDKs write it, after the messages), then in the
  rest of its start. Text inside a message cannot match: its quotes are escaped.
* ``ModelLabels``: that name as the ``model`` label, bounded (``metrics.max_models``
  names, the first ones seen; the rest ``other``; no name or a body that is not JSON,
  ``unknown``).
* ``usage_in_body``: the engine's token counts in a response that is not an event
  stream: the last ``"prompt_tokens"`` and ``"completion_tokens"`` integers in the end
  of the body (OpenAI ``usage``, SGLang ``meta_info``). An event stream's counts are
  its scanner's (the last usage event, or ``/generate``'s ``meta_info``).
* ``token_counts``: which of those a request's counts come from, and otherwise its
  output events counted.

Imports ``lifecycle`` only (and orjson); the span side of GenAI is in ``genai_spans``.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import orjson

UNKNOWN = "unknown"  # the label of a request whose body names no model (or is not JSON)
OTHER = "other"  # the label of the names past the cap
MAX_MODEL_CHARS = 256  # a longer name is not a label of its own: it counts as other
DEFAULT_MAX_MODELS = 32
_HEAD_START = 512  # where a body that opens with its model has it
_USAGE_TAIL_BYTES = 8192  # of a response body, searched for its usage

# A "model" field whose value is a string: a tool's JSON schema naming a property
# "model" has an object there, and a message's text has its quotes escaped.
_MODEL_FIELD = re.compile(rb'"model"\s*:\s*"((?:[^"\\]|\\.)*)"')
_COUNT_AFTER_KEY = re.compile(rb"\s*:\s*(\d+)")  # after a "prompt_tokens" or "completion_tokens" key

# Where a request's token counts came from (the span attribute traceproxy.usage.source).
SOURCE_USAGE = "usage"  # the engine's own counts
SOURCE_COUNTED = "counted"  # output events counted by the proxy: the engine gave none


def request_model(head: bytes, tail: bytes, body_bytes: int) -> str | None:
    """The request body's top-level model, None when it names none or is not JSON.
    ``head``/``tail``: the kept start and end of the body; ``body_bytes``: its length."""
    if not head:
        return None
    if body_bytes == len(head):  # kept whole
        try:
            body = orjson.loads(head)
        except orjson.JSONDecodeError:
            return None
        model = body.get("model") if isinstance(body, dict) else None
        return model if isinstance(model, str) and model else None
    match = _MODEL_FIELD.search(head, 0, _HEAD_START) or (tail and _MODEL_FIELD.search(tail)) \
        or _MODEL_FIELD.search(head)
    return json_string(match.group(1)) if match else None


def json_string(raw: bytes) -> str | None:
    """The text of a JSON string's inside (its escapes undone), None if it is empty or broken."""
    if b"\\" not in raw:
        text = raw.decode("utf-8", "replace")
    else:
        try:
            text = orjson.loads(b'"' + raw + b'"')
        except orjson.JSONDecodeError:
            return None
    return text or None


def usage_in_body(reads: tuple[bytes, ...]) -> tuple[int | None, int | None]:
    """(prompt tokens, completion tokens) in the end of a response body kept as its last
    ``reads``: the last of each found, None for one not found."""
    end = last_bytes(reads, _USAGE_TAIL_BYTES)
    return _last_count(end, b'"prompt_tokens"'), _last_count(end, b'"completion_tokens"')


def _last_count(end: bytes, key: bytes) -> int | None:
    """The integer after the last ``key`` that has one. Searched from the end (memchr
    speed): the usage is at a body's end, and this runs for every JSON response, where
    a regular expression over the whole tail cost three times as much."""
    at = end.rfind(key)
    while at >= 0:
        count = _COUNT_AFTER_KEY.match(end, at + len(key))
        if count:
            return int(count.group(1))
        at = end.rfind(key, 0, at)
    return None


def last_bytes(reads: tuple[bytes, ...], size: int) -> bytes:
    """The last ``size`` bytes of what ``reads`` carried, in order, copying no more than that."""
    pieces, need = [], size
    for read in reversed(reads):
        if not read:
            continue
        piece = read[-need:]
        pieces.append(piece)
        need -= len(piece)
        if need <= 0:
            break
    return pieces[0] if len(pieces) == 1 else b"".join(reversed(pieces))


class TokenCounts(NamedTuple):
    prompt: int | None
    generated: int | None
    source: str  # SOURCE_USAGE or SOURCE_COUNTED ("" when neither is known)


def token_counts(stream, response_tail: tuple[bytes, ...]) -> TokenCounts:
    """A finished request's token counts. ``stream``: an event stream's ``StreamSummary``
    (its engine's counts, else its output events counted), or None for any other
    response (the engine's counts in the body's end, else none)."""
    if stream is not None:
        if stream.completion_tokens is not None:
            return TokenCounts(stream.prompt_tokens, stream.completion_tokens, SOURCE_USAGE)
        return TokenCounts(stream.prompt_tokens, stream.output_events, SOURCE_COUNTED)
    prompt, completion = usage_in_body(response_tail)
    return TokenCounts(prompt, completion, SOURCE_USAGE if prompt is not None or completion is not None else "")


class ModelLabels:
    """The ``model`` label of a name: the name itself for the first ``max_models``
    distinct names seen (kept for the process's life, so a series never moves), the
    rest ``other``; no name, ``unknown``. Bounded, whatever the clients send."""

    __slots__ = ("max_models", "admitted")

    def __init__(self, max_models: int = DEFAULT_MAX_MODELS) -> None:
        self.max_models = max_models
        self.admitted: set[str] = set()

    def label(self, name: str | None) -> str:
        if name is None:
            return UNKNOWN
        admitted = self.admitted
        if name in admitted:
            return name
        if len(admitted) >= self.max_models or len(name) > MAX_MODEL_CHARS:
            return OTHER
        admitted.add(name)
        return name
