"""The reason phrase of every status line traceproxy writes itself: the proxy's own
error replies, the admin server's answers and the engine span receiver's.

A leaf module (the standard library only), so that the proxy and the observers, which
may not import each other, write one status the same way. The phrases are RFC 9110's
(413 is "Content Too Large" there, no longer "Payload Too Large"); the standard
library's ``http.HTTPStatus`` is not used because its phrases change between Python
versions. A client must ignore the phrase, but people read it in captures and logs.
"""

from __future__ import annotations

REASON_PHRASES: dict[int, bytes] = {
    200: b"OK",
    400: b"Bad Request",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Content Too Large",
    414: b"URI Too Long",
    415: b"Unsupported Media Type",
    417: b"Expectation Failed",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    501: b"Not Implemented",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
    505: b"HTTP Version Not Supported",
}


def reason_phrase(status: int) -> bytes:
    """RFC 9110's phrase, or one that says only what class of answer it is."""
    return REASON_PHRASES.get(status) or (b"Error" if status >= 400 else b"Unknown")
