"""Responses the proxy writes itself: OpenAI-style JSON errors naming the outcome."""

from __future__ import annotations

import json

from ..lifecycle.flags import Outcome
from ..reason_phrases import reason_phrase

OUTCOME_HEADER = b"X-Traceproxy-Outcome"


def error_body(outcome: Outcome, message: str) -> bytes:
    # The shape OpenAI SDKs parse into APIError: error.message / type / code.
    payload = {"error": {"message": message, "type": outcome.name, "code": outcome.code}}
    return json.dumps(payload).encode()


def error_response(
    status: int,
    outcome: Outcome,
    message: str,
    keep_alive: bool,
    client_http11: bool = True,
    extra_lines: bytes = b"",
    head_only: bool = False,
) -> bytes:
    """The proxy's own error response. ``head_only`` for a HEAD request: the head says
    what a GET would have received (its Content-Length), and no body follows (RFC 9110
    section 9.3.2); a body would be read as the start of the next response."""
    body = error_body(outcome, message)
    version = b"HTTP/1.1" if client_http11 else b"HTTP/1.0"
    lines = [
        b"%s %d %s\r\n" % (version, status, reason_phrase(status)),
        b"Content-Type: application/json\r\n",
        b"Content-Length: %d\r\n" % len(body),
        b"%s: %s\r\n" % (OUTCOME_HEADER, outcome.code.encode()),
    ]
    lines.append(extra_lines)
    if not keep_alive:
        lines.append(b"Connection: close\r\n")
    elif not client_http11:
        lines.append(b"Connection: keep-alive\r\n")
    lines.append(b"\r\n")
    if not head_only:
        lines.append(body)
    return b"".join(lines)


def body_size(response: bytes) -> int:
    """The body bytes of a reply built here: counted as sent, like an upstream body."""
    return len(response) - response.index(b"\r\n\r\n") - 4
