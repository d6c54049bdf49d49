"""Plain span data: what the proxy process hands to the exporter process.

The proxy's event loop must not pay for OTLP encoding (the SDK's protobuf encoder
costs more per request than proxying it), so spans cross a pipe to a separate
exporter process as these small tuples, marshalled in batches. Only the standard
library is needed to build them; the exporter process turns them into OTLP.
"""

from __future__ import annotations

from typing import NamedTuple, Union

AttributeValue = Union[str, int, float, bool]

# OTLP SpanKind and StatusCode values.
KIND_INTERNAL, KIND_SERVER, KIND_CLIENT = 1, 2, 3
STATUS_UNSET, STATUS_OK, STATUS_ERROR = 0, 1, 2


class SpanEvent(NamedTuple):
    name: str
    time_unix_ns: int
    attributes: dict[str, AttributeValue] | None = None


class SpanData(NamedTuple):
    trace_id: int  # 128-bit, never 0
    span_id: int  # 64-bit, never 0
    parent_span_id: int  # 0 for a root span
    name: str
    kind: int
    start_unix_ns: int
    end_unix_ns: int
    attributes: dict[str, AttributeValue]
    events: tuple[SpanEvent, ...] = ()
    status_code: int = STATUS_UNSET
    status_message: str = ""
    trace_state: str = ""  # the W3C tracestate value to keep on this span, as received
    sampled: bool = True
    parent_is_remote: bool = False  # the parent came over the wire (a client's traceparent)
