"""Pure header rules: framing checks, hop-by-hop removal, forwarding headers.

Headers are lists of ``(name, value)`` byte pairs as they came off the wire
(original case, original order). Nothing here touches a socket; every rule is a
function of its inputs, so the table-driven tests can cover each RFC point.
"""

from __future__ import annotations

from dataclasses import dataclass

Headers = list[tuple[bytes, bytes]]

# RFC 9110 section 7.6.1 plus the legacy connection-specific names that proxies
# have always removed. Names listed in a Connection header are added per message.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"proxy-connection",
        b"keep-alive",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"proxy-authenticate",
        b"proxy-authorization",
    }
)

# Framing is recomputed by the proxy for each hop, so these never pass verbatim.
_FRAMING = frozenset({b"content-length"})
_FORWARDED = frozenset({b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host"})


class BadRequest(Exception):
    """A request the proxy must refuse rather than forward; ``reason`` goes to the client."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class RequestFraming:
    chunked: bool
    content_length: int | None  # None with chunked; 0 when the request has no body


def _tokens(value: bytes) -> list[bytes]:
    return [t.strip().lower() for t in value.split(b",") if t.strip()]


def connection_tokens(headers: Headers) -> set[bytes]:
    tokens: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            tokens.update(_tokens(value))
    return tokens


def request_framing(headers: Headers, http_version: str = "1.1") -> RequestFraming:
    """How the request body is delimited, refusing anything ambiguous (RFC 9112 section 6)."""
    lengths: list[bytes] = []
    codings: list[bytes] = []
    for name, value in headers:
        lname = name.lower()
        if lname == b"content-length":
            lengths.extend(v.strip() for v in value.split(b","))
        elif lname == b"transfer-encoding":
            codings.extend(_tokens(value))
    if lengths and codings:
        raise BadRequest(400, "both Content-Length and Transfer-Encoding are present")
    if codings:
        if http_version != "1.1":
            # RFC 9112 section 6.1: chunked framing from an HTTP/1.0 sender is faulty.
            raise BadRequest(400, "Transfer-Encoding in an HTTP/1.0 request")
        if codings != [b"chunked"]:
            shown = b", ".join(codings).decode("latin-1")
            raise BadRequest(400, f"unsupported Transfer-Encoding {shown!r}: only 'chunked' is accepted")
        return RequestFraming(chunked=True, content_length=None)
    if not lengths:
        return RequestFraming(chunked=False, content_length=0)
    if len(set(lengths)) != 1 or not lengths[0].isdigit():
        raise BadRequest(400, "invalid or conflicting Content-Length values")
    return RequestFraming(chunked=False, content_length=int(lengths[0]))


def check_host(headers: Headers, http_version: str) -> bytes | None:
    """The Host value; exactly one is required in HTTP/1.1 (RFC 9112 section 3.2)."""
    hosts = [value for name, value in headers if name.lower() == b"host"]
    if len(hosts) > 1:
        raise BadRequest(400, "more than one Host header")
    if not hosts and http_version == "1.1":
        raise BadRequest(400, "missing Host header")
    return hosts[0] if hosts else None


def end_to_end(headers: Headers) -> Headers:
    """Headers minus hop-by-hop ones, minus names listed in Connection, minus framing."""
    listed = connection_tokens(headers)
    drop = HOP_BY_HOP | _FRAMING | listed
    return [(n, v) for n, v in headers if n.lower() not in drop]


@dataclass(frozen=True, slots=True)
class ForwardingContext:
    client_ip: str
    scheme: str  # what the client spoke to us: "http"
    upstream_authority: bytes  # host:port of the upstream, for Host when not preserved
    preserve_host: bool
    x_forwarded: bool


def upstream_request_head(
    method: str,
    target: bytes,
    headers: Headers,
    framing: RequestFraming,
    ctx: ForwardingContext,
    extra: Headers = (),
) -> bytes:
    """The request head sent upstream: always HTTP/1.1, keep-alive, framing recomputed."""
    out = end_to_end(headers)
    host = next((v for n, v in headers if n.lower() == b"host"), None)
    if not ctx.preserve_host or host is None:
        out = [(n, v) for n, v in out if n.lower() != b"host"]
        out.insert(0, (b"Host", ctx.upstream_authority))
    if ctx.x_forwarded:
        out = _append_forwarded(out, ctx, host)
    out.extend(extra)
    if framing.chunked:
        out.append((b"Transfer-Encoding", b"chunked"))
    elif framing.content_length or method in ("POST", "PUT", "PATCH"):
        out.append((b"Content-Length", str(framing.content_length or 0).encode()))
    lines = [b"%s %s HTTP/1.1\r\n" % (method.encode("ascii"), target)]
    lines.extend(b"%s: %s\r\n" % pair for pair in out)
    lines.append(b"\r\n")
    return b"".join(lines)


def _append_forwarded(out: Headers, ctx: ForwardingContext, host: bytes | None) -> Headers:
    """Append to X-Forwarded-* (comma-joined, like nginx's $proxy_add_x_forwarded_for)."""
    existing = {b"x-forwarded-for": [], b"x-forwarded-proto": [], b"x-forwarded-host": []}
    kept: Headers = []
    for name, value in out:
        lname = name.lower()
        if lname in _FORWARDED:
            existing[lname].append(value)
        else:
            kept.append((name, value))
    ours = {
        b"x-forwarded-for": ctx.client_ip.encode("ascii"),
        b"x-forwarded-proto": ctx.scheme.encode("ascii"),
        b"x-forwarded-host": host,
    }
    for lname, display in ((b"x-forwarded-for", b"X-Forwarded-For"),
                           (b"x-forwarded-proto", b"X-Forwarded-Proto"),
                           (b"x-forwarded-host", b"X-Forwarded-Host")):
        values = existing[lname] + ([ours[lname]] if ours[lname] is not None else [])
        if values:
            kept.append((display, b", ".join(values)))
    return kept


class ResponseFraming:
    """How the proxy delimits a response body towards the client."""

    LENGTH = "length"  # Content-Length forwarded from the upstream
    CHUNKED = "chunked"  # re-chunked by the proxy, each upstream read one chunk
    CLOSE = "close"  # no length: the client connection closes after the body (HTTP/1.0 clients)
    NONE = "none"  # no body: HEAD, 204, 304


def response_framing(
    status: int, request_method: str, upstream_headers: Headers, upstream_chunked: bool, client_http11: bool
) -> tuple[str, bytes | None]:
    """(framing, content-length value) for the response to the client."""
    length = next((v.strip() for n, v in upstream_headers if n.lower() == b"content-length"), None)
    if request_method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return ResponseFraming.NONE, length if request_method == "HEAD" or status == 304 else None
    if length is not None and not upstream_chunked:
        return ResponseFraming.LENGTH, length
    return (ResponseFraming.CHUNKED if client_http11 else ResponseFraming.CLOSE), None


def client_response_head(
    status: int,
    reason: bytes,
    upstream_headers: Headers,
    framing: str,
    content_length: bytes | None,
    keep_alive: bool,
    client_http11: bool,
    extra: Headers = (),
    keepalive_timeout: int | None = None,
) -> bytes:
    version = b"HTTP/1.1" if client_http11 else b"HTTP/1.0"
    lines = [b"%s %d %s\r\n" % (version, status, reason)]
    lines.extend(b"%s: %s\r\n" % pair for pair in end_to_end(upstream_headers))
    lines.extend(b"%s: %s\r\n" % pair for pair in extra)
    if content_length is not None:
        lines.append(b"Content-Length: %s\r\n" % content_length)
    if framing == ResponseFraming.CHUNKED:
        lines.append(b"Transfer-Encoding: chunked\r\n")
    lines.append(_connection_line(keep_alive, client_http11, keepalive_timeout))
    lines.append(b"\r\n")
    return b"".join(lines)


def _connection_line(keep_alive: bool, client_http11: bool, keepalive_timeout: int | None) -> bytes:
    if not keep_alive:
        return b"Connection: close\r\n"
    hint = b"Keep-Alive: timeout=%d\r\n" % keepalive_timeout if keepalive_timeout else b""
    return hint if client_http11 else b"Connection: keep-alive\r\n" + hint


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"
