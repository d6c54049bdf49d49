"""The one request-body rewrite the proxy can do, off by default: SGLang ``rid``.

SGLang takes its request id from the body field ``rid`` only, and the router keeps
``rid`` on ``/generate`` (it strips it on the OpenAI chat route), so setting it lets
the engines' own logs carry the proxy's request id.
"""

from __future__ import annotations

import json

# Only bodies up to this size are rewritten; the body is held until complete.
REWRITE_MAX_BYTES = 1024 * 1024


def wants_rid(method: str, target: bytes, content_length: int | None) -> bool:
    return (method == "POST" and target.partition(b"?")[0] == b"/generate"
            and content_length is not None and 0 < content_length <= REWRITE_MAX_BYTES)


def inject_rid(body: bytes, request_id: str) -> bytes:
    """The body with ``rid`` set when it is a JSON object without one; else unchanged."""
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body
    if not isinstance(document, dict) or "rid" in document:
        return body
    document["rid"] = request_id
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()
