"""What the proxy process and its exporter process agree on: settings, framing, stats.

Parent -> child, on the child's stdin: frames of a 4-byte big-endian length followed
by one ``marshal`` dump of a list of items, each a ``SpanData``, a request summary
(``spans.RequestSummary``, for a request whose spans are kept), an engine's export
request relayed as it came (``RawSpans``) or the access log lines made since the last
frame (``AccessLines``, at most one a frame), flattened to plain tuples (``flatten``). EOF on stdin means "drain
what you have, flush, exit".

Why marshal and not pickle: it is 2.5 times faster both ways for these tuples of
ints, strings and bytes, and the parent pays for the dump on its event loop. Its
format is specific to the Python version, which is safe here: the child is always
started with the parent's own interpreter (``sys.executable``).

Child -> parent, on an inherited file descriptor: JSON lines of cumulative counters,
``{"exported": n, "failed": n, "access_log_lost": n}`` (spans delivered and not,
access log lines that could not be written). Counters only grow, so a late or
repeated line is harmless; each line is far below PIPE_BUF, so one ``os.write``
never interleaves.

Standard library and our own plain types only: the exporter process imports this
before anything heavy, and the parent never decodes anything the child sends but
the stats lines.
"""

from __future__ import annotations

import json
import marshal
import signal
import struct
from dataclasses import asdict, dataclass, field
from typing import BinaryIO, NamedTuple

from .spandata import SpanData, SpanEvent
from .spans import AttemptSummary, RequestSummary

FRAME_HEADER = struct.Struct("!I")
# A frame is one batch of a few hundred spans; anything near this is a broken stream.
MAX_FRAME_BYTES = 1 << 28

# The parent's "stop now" to the exporter child, once its orderly stop (EOF on the
# child's stdin) has overrun; the child ignores SIGINT and SIGTERM (see exporter_main).
STOP_NOW = signal.SIGUSR1
EXPORTERS = ("otlp", "file", "console", "off")
PROTOCOLS = ("grpc", "http/protobuf")


@dataclass(frozen=True)
class ExportConfig:
    exporter: str  # "otlp" | "file" | "console" | "off" (already resolved by the caller)
    otlp_endpoint: str  # "" = the OTel SDK exporter reads OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT
    otlp_protocol: str  # "grpc" | "http/protobuf"
    file_path: str  # for "file": OTLP/JSON lines, appended
    service_name: str  # resource service.name
    resource_attributes: dict[str, str] = field(default_factory=dict)
    queue_spans: int = 8192  # spans waiting in the parent before new ones are dropped
    batch_spans: int = 512  # spans per pipe message (at most queue_spans)
    flush_interval: float = 0.2  # seconds before a partial batch is sent
    export_timeout: float = 5.0  # per export call in the child
    access_log_path: str = ""  # "" off, "-" the child's stdout (the proxy's), else a file
    genai_provider: str = ""  # gen_ai.provider.name (tracing.genai_provider); "" detects it per response
    nice: int = 10  # added to the child's CPU niceness: proxying wins when the cores are busy

    @property
    def needs_process(self) -> bool:
        return self.exporter != "off" or bool(self.access_log_path)

    def __post_init__(self) -> None:
        if self.exporter not in EXPORTERS:
            raise ValueError(f"exporter must be one of {EXPORTERS}, not {self.exporter!r}")
        if self.exporter == "otlp" and self.otlp_protocol not in PROTOCOLS:
            raise ValueError(f"otlp_protocol must be one of {PROTOCOLS}, not {self.otlp_protocol!r}")
        if self.exporter == "file" and not self.file_path:
            raise ValueError("the file exporter needs file_path")
        if self.batch_spans < 1 or self.queue_spans < 1:
            raise ValueError("batch_spans and queue_spans must be at least 1")
        if not 0 <= self.nice <= 19:
            raise ValueError("nice must be from 0 to 19")
        if self.flush_interval <= 0 or self.export_timeout <= 0:
            raise ValueError("flush_interval and export_timeout must be positive")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ExportConfig":
        return cls(**json.loads(text))


class RawSpans(NamedTuple):
    """An encoded ``ExportTraceServiceRequest`` an engine sent the proxy's receiver, relayed
    byte for byte (``payload``); ``spans``: how many spans it holds, for the counts."""

    payload: bytes
    spans: int


class AccessLines(NamedTuple):
    """Access log lines made on the proxy's loop (``accesslog.access_line``), each ended
    by its newline, for the exporter process to append as they are; ``count``: how many."""

    data: bytes
    count: int


# Flattened items: a kind, then the fields in order, the nested tuples made plain (a
# summary's fields in two slices around its attempts, see flatten).
_SPAN, _SUMMARY, _RAW, _LINES = 0, 1, 2, 3
_EVENTS = SpanData._fields.index("events")
_ATTEMPTS = RequestSummary._fields.index("attempts")


def frame(flat_items: list[tuple]) -> tuple[bytes, int]:
    """One frame of flattened items, and how many of them were left out: a value
    marshal cannot write (an odd attribute type) costs only its own item. The
    whole list is dumped at once; only when that fails is each item tried alone."""
    try:
        payload = marshal.dumps(flat_items)
        left_out = 0
    except ValueError:
        writable = [flat for flat in flat_items if _writable(flat)]
        payload, left_out = marshal.dumps(writable), len(flat_items) - len(writable)
    return FRAME_HEADER.pack(len(payload)) + payload, left_out


def encode_frame(items: list) -> bytes:
    return frame([flatten(item) for item in items])[0]


def _writable(flat: tuple) -> bool:
    try:
        marshal.dumps(flat)
    except ValueError:
        return False
    return True


def flatten(item) -> tuple:
    """A summary (one per request, on the proxy's loop) as its fields before and after
    its attempts, two plain slices: half the cost of one flat tuple, to make and to dump."""
    if type(item) is RequestSummary:
        return (_SUMMARY, item[:_ATTEMPTS], tuple([tuple(attempt) for attempt in item[_ATTEMPTS]]),
                item[_ATTEMPTS + 1:])
    if isinstance(item, SpanData):
        return (_SPAN, *item[:_EVENTS], tuple(map(tuple, item.events)), *item[_EVENTS + 1:])
    if type(item) is AccessLines:
        return flatten_lines(*item)
    raise TypeError(f"not a span, a request summary or access log lines: {type(item).__name__}")


def flatten_raw(raw: RawSpans) -> tuple:
    """``flatten`` for a relayed request (kept apart: ``flatten`` runs for every kept request)."""
    return (_RAW, *raw)


def flatten_lines(data: bytes | bytearray, count: int) -> tuple:
    """``flatten`` for a frame's access log lines."""
    return (_LINES, data, count)


# Named tuples made from their fields as they are, without the generated __new__ and its
# forty-odd arguments: the exporter restores one summary per request. Safe because a
# flattened item always holds every field, in order (flatten writes them all).
_as = tuple.__new__


def _restore(flat: tuple):
    kind = flat[0]
    if kind == _SUMMARY:
        _, before, attempts, after = flat
        return _as(RequestSummary, (*before, tuple([_as(AttemptSummary, attempt) for attempt in attempts]), *after))
    if kind == _RAW:
        return RawSpans(*flat[1:])
    if kind == _LINES:
        return AccessLines(*flat[1:])
    events = tuple(SpanEvent(*event) for event in flat[_EVENTS + 1])
    return SpanData(*flat[1:_EVENTS + 1], events, *flat[_EVENTS + 2:])


def read_frame(stream: BinaryIO) -> bytes | None:
    """The next frame's payload from a blocking stream, or None at EOF (a cut-off frame is EOF too)."""
    header = stream.read(FRAME_HEADER.size)
    if len(header) < FRAME_HEADER.size:
        return None
    (length,) = FRAME_HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"span frame of {length} bytes: the stream is corrupt")
    payload = stream.read(length)
    if len(payload) < length:
        return None
    return payload


def decode_frame(payload: bytes) -> list:
    return [_restore(flat) for flat in marshal.loads(payload)]


STATS = ("exported", "failed", "access_log_lost")


def stats_line(exported: int, failed: int, access_log_lost: int) -> bytes:
    return json.dumps({"exported": exported, "failed": failed, "access_log_lost": access_log_lost}).encode() + b"\n"


def parse_stats_line(line: bytes) -> dict[str, int] | None:
    try:
        stats = json.loads(line)
        return {name: int(stats[name]) for name in STATS}
    except (ValueError, KeyError, TypeError):
        return None
