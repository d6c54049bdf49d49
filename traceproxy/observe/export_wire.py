"""What the proxy process and its exporter process agree on: settings, framing, stats.

Parent -> child, on the child's stdin: frames of a 4-byte big-endian length followed
by a pickle (protocol 5) of a list of ``SpanData``. EOF on stdin means "drain what
you have, flush, exit".

Child -> parent, on an inherited file descriptor: JSON lines of cumulative counters,
``{"exported": n, "failed": n}``. Counters only grow, so a late or repeated line is
harmless; each line is far below PIPE_BUF, so one ``os.write`` never interleaves.

Standard library only: the exporter process imports this before anything heavy, and
the parent never unpickles anything the child sends.
"""

from __future__ import annotations

import json
import pickle
import struct
from dataclasses import asdict, dataclass, field
from typing import BinaryIO

FRAME_HEADER = struct.Struct("!I")
# A frame is one batch of a few hundred spans; anything near this is a broken stream.
MAX_FRAME_BYTES = 1 << 28

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
        if self.flush_interval <= 0 or self.export_timeout <= 0:
            raise ValueError("flush_interval and export_timeout must be positive")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ExportConfig":
        return cls(**json.loads(text))


def encode_frame(spans: list) -> bytes:
    payload = pickle.dumps(spans, protocol=5)
    return FRAME_HEADER.pack(len(payload)) + payload


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
    return pickle.loads(payload)


def stats_line(exported: int, failed: int) -> bytes:
    return json.dumps({"exported": exported, "failed": failed}).encode() + b"\n"


def parse_stats_line(line: bytes) -> dict[str, int] | None:
    try:
        stats = json.loads(line)
        return {"exported": int(stats["exported"]), "failed": int(stats["failed"])}
    except (ValueError, KeyError, TypeError):
        return None
