"""Fresh identifiers: W3C trace and span ids (never zero) and request ids."""

from __future__ import annotations

import random

_rand = random.getrandbits


def new_trace_id() -> int:
    return _rand(128) or 1


def new_span_id() -> int:
    return _rand(64) or 1


def new_request_id() -> str:
    """32 lowercase hex digits, like a uuid4 without dashes."""
    return _rand(128).to_bytes(16, "big").hex()  # faster than "%032x" formatting
