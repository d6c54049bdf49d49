"""A request's head as the proxy carries it, and the head each upstream attempt sends.

``RequestHead`` is built once, when the head is complete and passed every check
(``downstream``); ``upstream_head`` renders it for one attempt, with that attempt's
span as the traceparent parent (a resend sends a head of its own).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..lifecycle.timeline import Attempt, RequestRecord
from . import headers as H
from . import tracecontext as tc

if TYPE_CHECKING:
    from .context import ServerContext


class RequestHead:
    __slots__ = ("method", "target", "parts", "framing", "http11", "keep_alive", "expect_continue", "generated_id")

    def __init__(self, method, target, parts, http11, keep_alive, expect_continue, generated_id=False):
        self.method: str = method
        self.target: bytes = target
        self.parts: H.RequestParts = parts
        self.framing: H.RequestFraming = parts.framing
        self.http11: bool = http11
        self.keep_alive: bool = keep_alive
        self.expect_continue: bool = expect_continue
        self.generated_id: bool = generated_id  # the request id is ours: send it upstream

    def with_length(self, length: int) -> None:
        """The body was rewritten (see bodies): it goes with this Content-Length."""
        self.parts = dataclasses.replace(self.parts, framing=H.RequestFraming(False, length))
        self.framing = self.parts.framing


def upstream_head(ctx: "ServerContext", head: RequestHead, record: RequestRecord, attempt: Attempt,
                  forwarding: H.ForwardingContext) -> bytes:
    extra = b"traceparent: %s\r\n" % tc.format_traceparent(record.trace_id, attempt.span_id, record.sampled)
    if record.tracestate:
        extra += b"tracestate: %s\r\n" % record.tracestate
    if head.generated_id:
        extra += b"%s: %s\r\n" % (ctx.request_id_header, record.request_id.encode("latin-1"))
    return H.upstream_request_head(head.method, head.target, head.parts, forwarding, extra)
