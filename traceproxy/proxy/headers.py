"""Pure header rules: framing checks, hop-by-hop removal, forwarding headers.

Headers are lists of ``(name, value)`` byte pairs as they came off the wire
(original case, original order). Nothing here touches a socket; every rule is a
function of its inputs, so the table-driven tests can cover each RFC point.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

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


class BadResponse(Exception):
    """An upstream response the proxy must not pass on (a 502 if nothing was sent yet);
    its text says why, as the client's error message will."""


# RFC 9112 section 4: reason-phrase = *( HTAB / SP / VCHAR / obs-text )
_REASON_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
# Empty lines llhttp skips before a request line or a status line (RFC 9112 section 2.2).
EMPTY_LINES = re.compile(rb"[\r\n]*")


def check_status_line(status: int, reason: bytes) -> None:
    """Refuses what llhttp lets through: a status outside 100..599 (``000`` parses as
    0, and would be written back as ``0``) and control characters in the reason."""
    if not 100 <= status <= 599:
        raise BadResponse(f"malformed response: status code {status:03d} is outside 100..599")
    if reason and _REASON_CONTROL.search(reason):
        raise BadResponse(f"malformed response: control character in the reason phrase {reason!r}")


@dataclass(frozen=True, slots=True)
class RequestFraming:
    chunked: bool
    content_length: int | None  # None with chunked; 0 when the request has no body

    @property
    def has_body(self) -> bool:
        return self.chunked or bool(self.content_length)


def _tokens(value: bytes) -> list[bytes]:
    return [t.strip().lower() for t in value.split(b",") if t.strip()]


def header_lines(headers: Headers) -> bytes:
    """``name: value`` lines, each ended by CRLF, in order."""
    return b"".join([b"%s: %s\r\n" % pair for pair in headers])


# Connection values that list no other header: nearly every message carries one.
_PLAIN_CONNECTION = frozenset({b"keep-alive", b"close", b"Keep-Alive", b"Close"})


def _connection_listed(listed: set[bytes] | None, value: bytes) -> set[bytes] | None:
    """Add the header names one Connection value lists to ``listed`` (None until one does)."""
    if value in _PLAIN_CONNECTION:
        return listed
    if listed is None:
        listed = set()
    listed.update(_tokens(value))
    return listed


@dataclass(slots=True)
class RequestParts:
    """What one pass over the request headers found (see ``parse_request_headers``)."""

    framing: RequestFraming
    host: bytes | None
    expect: bytes | None
    # End-to-end headers in order: no hop-by-hop, framing, Expect or X-Forwarded-*.
    end_to_end: Headers
    forwarded: Headers  # the client's own X-Forwarded-* headers, as sent
    traceparents: list[bytes]  # removed from end_to_end: the proxy sends its own
    tracestates: list[bytes]  # removed from end_to_end: forwarded only with a valid traceparent
    request_id: bytes | None  # the first configured request-id header present (kept in end_to_end)
    user_agent: bytes | None
    conversation_id: str = ""  # the conversation id header's (see parse_request_headers), "" without one


# Connection tokens that never name another header field.
_NOT_NAMES = HOP_BY_HOP | {b"close"}
_TRACE = frozenset({b"traceparent", b"tracestate"})
_REQUEST_SPECIAL = HOP_BY_HOP | _FRAMING | _FORWARDED | _TRACE | {b"host", b"expect"}
# Fields the proxy reads, writes or replaces itself (framing, the connection, routing,
# tracing): never free to carry a request id.
PROXY_MANAGED = _REQUEST_SPECIAL | {b"traceresponse"}
DEFAULT_REQUEST_ID_NAMES = (b"x-request-id",)
_NONE: list = []  # shared "none seen" sentinel, compared by identity, never appended to
_OWS = b" \t"


def parse_request_headers(
    headers: Headers, http_version: str = "1.1", request_id_names: tuple[bytes, ...] = DEFAULT_REQUEST_ID_NAMES,
    conversation_id_name: bytes = b"",
) -> RequestParts:
    """One pass over the request headers; raises ``BadRequest`` for anything ambiguous.

    ``conversation_id_name`` (lower case, ``tracing.conversation_id_header``; b"": none)
    is the end-to-end header whose first non-empty value is the conversation id.

    Framing follows RFC 9112 section 6: Content-Length with Transfer-Encoding,
    conflicting lengths, any coding but a lone ``chunked``, and chunked from an
    HTTP/1.0 sender are all refused. Exactly one Host is required in HTTP/1.1.
    """
    # Runs for every request: the lists for rare headers are shared empty
    # sentinels until one is seen (only the framing ones; the rest are returned).
    kept: Headers = []
    lengths: list[bytes] = _NONE
    codings: list[bytes] = _NONE
    hosts: list[bytes] = []
    listed: set[bytes] | None = None
    forwarded: Headers = []
    traceparents: list[bytes] = []
    tracestates: list[bytes] = []
    request_ids: dict[bytes, bytes] | None = None
    expect = user_agent = conversation = None
    # llhttp strips the whitespace before a field value but keeps what follows it, which
    # RFC 9112 section 5 says is not the value's: stripped here from the values the
    # proxy reads (Host, request ids, trace context, the conversation id); the others
    # pass as they came.
    for name, value in headers:
        lname = name.lower()
        if lname not in _REQUEST_SPECIAL:
            if lname == conversation_id_name and conversation is None:
                conversation = value.strip(_OWS) or None  # an empty line is no id
            if lname in request_id_names:
                value = value.rstrip(_OWS)
                if not value:
                    continue  # an empty id is no id: one is generated, and this line dropped
                if request_ids is None:
                    request_ids = {}
                request_ids.setdefault(lname, value)
            elif lname == b"user-agent":
                user_agent = value
            kept.append((name, value))
        elif lname == b"host":
            value = value.rstrip(_OWS)
            hosts.append(value)
            kept.append((name, value))
        elif lname == b"content-length":
            if lengths is _NONE:
                lengths = []
            if b"," in value:
                lengths.extend(v.strip() for v in value.split(b","))
            else:
                lengths.append(value.strip())
        elif lname == b"traceparent":
            traceparents.append(value.rstrip(_OWS))
        elif lname == b"tracestate":
            tracestates.append(value.rstrip(_OWS))
        elif lname == b"transfer-encoding":
            if codings is _NONE:
                codings = []
            codings.extend(_tokens(value))
        elif lname == b"connection":
            listed = _connection_listed(listed, value)
        elif lname == b"expect":
            # Every line counts: 100-continue then foo is as unsupported as foo alone.
            expect = value if expect is None else expect + b", " + value
        elif lname in _FORWARDED:
            forwarded.append((name, value))
    if listed is not None and not listed <= _NOT_NAMES:
        # Hop-by-hop by the client's say, so not forwarded: also the headers the
        # proxy set aside to send its own version of. Host is the exception: every
        # HTTP/1.1 request needs one, so naming it in Connection does not remove it.
        listed.discard(b"host")
        kept = [(n, v) for n, v in kept if n.lower() not in listed]
        forwarded = [(n, v) for n, v in forwarded if n.lower() not in listed]
        if b"traceparent" in listed:
            traceparents = []
        if b"tracestate" in listed:
            tracestates = []
        if request_ids is not None:
            request_ids = {n: v for n, v in request_ids.items() if n not in listed}
        if conversation_id_name in listed:
            conversation = None
    if len(hosts) > 1:
        raise BadRequest(400, "more than one Host header")
    if not hosts and http_version == "1.1":
        raise BadRequest(400, "missing Host header")
    if hosts and hosts[0] not in _VALID_HOSTS:
        check_host(hosts[0])
    framing = _framing(lengths, codings, http_version)
    request_id = _first_request_id(request_ids, request_id_names) if request_ids is not None else None
    return RequestParts(framing, hosts[0] if hosts else None, expect, kept, forwarded,
                        traceparents, tracestates, request_id, user_agent,
                        _conversation_id(conversation) if conversation is not None else "")


MAX_CONTENT_LENGTH = 2**63 - 1  # as nginx's off_t


def _framing(lengths: list[bytes], codings: list[bytes], http_version: str) -> RequestFraming:
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
        return _NO_BODY
    if (len(lengths) != 1 and len(set(lengths)) != 1) or not lengths[0].isdigit():
        raise BadRequest(400, "invalid or conflicting Content-Length values")
    framing = _LENGTH_FRAMINGS.get(lengths[0])
    if framing is None:
        length = int(lengths[0])
        if length > MAX_CONTENT_LENGTH:
            # An upstream that reads it into a signed 64-bit integer would see another length.
            raise BadRequest(400, f"Content-Length {length} is larger than {MAX_CONTENT_LENGTH}")
        framing = RequestFraming(chunked=False, content_length=length)
        if len(_LENGTH_FRAMINGS) < 4096:  # immutable, so shared; bounded
            _LENGTH_FRAMINGS[lengths[0]] = framing
    return framing


# RFC 9112 section 3.2: Host = uri-host [ ":" port ], where uri-host is an IP
# literal in brackets, or a reg-name of unreserved, percent-encoded and sub-delims
# characters (an IPv4 address is one). Empty is allowed (a target with no authority).
_HOST = re.compile(rb"(\[[0-9A-Fa-f:.]+\]|\[v[0-9A-Fa-f]+\.[A-Za-z0-9\-._~!$&'()*+,;=:]+\]"
                   rb"|[A-Za-z0-9\-._~!$&'()*+,;=%]*)(:[0-9]*)?")
_VALID_HOSTS: set[bytes] = set()  # values already checked: most requests repeat one


def check_host(value: bytes) -> None:
    """Raises ``BadRequest`` (400, RFC 9112 section 3.2) for a Host that is not a
    host and port: a path, a user, spaces, anything the upstream might read another way."""
    if _HOST.fullmatch(value) is None:
        shown = value[:100].decode("latin-1")
        raise BadRequest(400, f"invalid Host header {shown!r}: expected host[:port]")
    if len(_VALID_HOSTS) < 4096:  # bounded: a client inventing hosts cannot grow it
        _VALID_HOSTS.add(value)


def _authority_end(rest: bytes) -> int:
    """Where the authority of ``rest`` (a URI after its ``scheme://``) ends: at the
    first ``/``, ``?`` or ``#`` (RFC 3986 section 3.2)."""
    end = len(rest)
    for stop in (b"/", b"?", b"#"):
        found = rest.find(stop)
        if 0 <= found < end:
            end = found
    return end


def shown_target(target: bytes) -> str:
    """A request target as logs and spans show it: as sent, except the user information
    of an absolute-form or authority-form target (``http://user:password@host/``),
    which is dropped."""
    if target[:1] == b"/":
        return target.decode("latin-1")
    scheme, sep, rest = target.partition(b"://")
    if not sep:
        return target.rpartition(b"@")[2].decode("latin-1")
    end = _authority_end(rest)
    authority = rest[:end].rpartition(b"@")[2]
    return (scheme + sep + authority + rest[end:]).decode("latin-1")


def split_absolute_form(target: bytes) -> tuple[bytes, bytes] | None:
    """``(authority, origin-form target)`` of an absolute-form target
    (``http://host:port/path?q``), or None for any other form. RFC 9112 section
    3.2.2: the authority replaces the Host header, and the upstream is sent the path."""
    scheme, sep, rest = target.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https"):
        return None
    end = _authority_end(rest)
    authority, path = rest[:end], rest[end:].partition(b"#")[0]
    if not authority or b"@" in authority:
        # RFC 9110 section 4.2.4: userinfo in an http URI is to be treated as an error.
        raise BadRequest(400, "absolute-form target without a host, or with user information")
    check_host(authority)
    return authority, (path if path.startswith(b"/") else b"/" + path)


def _first_request_id(found: dict[bytes, bytes], names: tuple[bytes, ...]) -> bytes | None:
    """The request id under the first configured name present: the order of
    ``request_id.headers`` decides, not the order of the lines."""
    return next((found[name] for name in names if name in found), None)


MAX_CONVERSATION_ID_CHARS = 256  # a conversation id longer than this is cut here (see _conversation_id)


def _conversation_id(value: bytes) -> str:
    """A conversation id header's value as the request's conversation id: latin-1 as the
    request id, at most ``MAX_CONVERSATION_ID_CHARS`` characters (a longer one keeps its
    start, so its requests still group together)."""
    return value[:MAX_CONVERSATION_ID_CHARS].decode("latin-1")


def ids_only(headers: Headers, request_id_names: tuple[bytes, ...] = DEFAULT_REQUEST_ID_NAMES) -> RequestParts:
    """The trace context, request id and user agent of a head that is being refused,
    without judging the rest: the refusal then carries the client's own ids."""
    traceparents, tracestates, request_ids, user_agent = [], [], {}, None
    for name, value in headers:
        lname = name.lower()
        if lname == b"traceparent":
            traceparents.append(value.rstrip(_OWS))
        elif lname == b"tracestate":
            tracestates.append(value.rstrip(_OWS))
        elif lname == b"user-agent":
            user_agent = value
        elif lname in request_id_names and value.strip():
            request_ids.setdefault(lname, value.rstrip(_OWS))
    request_id = _first_request_id(request_ids, request_id_names)
    return RequestParts(_NO_BODY, None, None, [], [], traceparents, tracestates, request_id, user_agent)


def with_host(parts: RequestParts, host: bytes) -> RequestParts:
    """``parts`` with ``host`` as its Host, in place of the one the client sent."""
    kept = [(n, v) for n, v in parts.end_to_end if n.lower() != b"host"]
    return dataclasses.replace(parts, host=host, end_to_end=[(b"Host", host), *kept])


def only_offers_h2c(headers: Headers) -> bool:
    """The request's Upgrade offers HTTP/2 over cleartext and nothing else: a server
    may answer it as if Upgrade were absent (RFC 9113 section 3.2, RFC 9110 section 7.8)."""
    offers = {token.strip().lower() for name, value in headers if name.lower() == b"upgrade"
              for token in value.split(b",")}
    return offers == {b"h2c"}


_NO_BODY = RequestFraming(chunked=False, content_length=0)
_LENGTH_FRAMINGS: dict[bytes, RequestFraming] = {}


@dataclass(frozen=True, slots=True)
class ForwardingContext:
    client_ip: str
    scheme: str  # what the client spoke to us: "http"
    upstream_authority: bytes  # host:port of the upstream, for Host when not preserved
    preserve_host: bool
    x_forwarded: bool
    # The X-Forwarded-For and -Proto lines for a client that sent none of its own:
    # the same for every request on the connection, so formatted once.
    own_forwarded_lines: bytes = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "own_forwarded_lines", b"X-Forwarded-For: %s\r\nX-Forwarded-Proto: %s\r\n"
                           % (self.client_ip.encode("ascii"), self.scheme.encode("ascii")))


_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def upstream_request_head(
    method: str,
    target: bytes,
    parts: RequestParts,
    ctx: ForwardingContext,
    extra_lines: bytes = b"",
) -> bytes:
    """The request head sent upstream: always HTTP/1.1, keep-alive, framing recomputed."""
    out = parts.end_to_end
    if not ctx.preserve_host or parts.host is None:
        out = [(b"Host", ctx.upstream_authority)] + [(n, v) for n, v in out if n.lower() != b"host"]
    forwarded = _forwarded_lines(parts, ctx) if ctx.x_forwarded else header_lines(parts.forwarded)
    framing = parts.framing
    if framing.chunked:
        length = b"Transfer-Encoding: chunked\r\n"
    elif framing.content_length or method in _BODY_METHODS:
        length = b"Content-Length: %d\r\n" % (framing.content_length or 0)
    else:
        length = b""
    return b"%s %s HTTP/1.1\r\n%s%s%s%s\r\n" % (
        method.encode("ascii"), target, header_lines(out), forwarded, extra_lines, length)


def _forwarded_lines(parts: RequestParts, ctx: ForwardingContext) -> bytes:
    """Append to X-Forwarded-* (comma-joined, like nginx's $proxy_add_x_forwarded_for)."""
    if not parts.forwarded:  # the common case: the client sent none of its own
        if parts.host is None:
            return ctx.own_forwarded_lines
        return b"%sX-Forwarded-Host: %s\r\n" % (ctx.own_forwarded_lines, parts.host)
    existing: dict[bytes, list[bytes]] = {}
    for name, value in parts.forwarded:
        existing.setdefault(name.lower(), []).append(value)
    ours = (
        (b"X-Forwarded-For", b"x-forwarded-for", ctx.client_ip.encode("ascii")),
        (b"X-Forwarded-Proto", b"x-forwarded-proto", ctx.scheme.encode("ascii")),
        (b"X-Forwarded-Host", b"x-forwarded-host", parts.host),
    )
    lines = []
    for display, lname, value in ours:
        values = existing.get(lname, []) + ([value] if value is not None else [])
        if values:
            lines.append(b"%s: %s\r\n" % (display, b", ".join(values)))
    return b"".join(lines)


@dataclass(frozen=True, slots=True)
class ResponseParts:
    """What one pass over a response head found. Frozen: the pool hands the same
    result to every response that repeats the head byte for byte."""

    chunked: bool
    content_length: bytes | None
    end_to_end: Headers
    event_stream: bool  # Content-Type: text/event-stream (SSE)
    end_to_end_lines: bytes  # end_to_end, formatted as header lines
    # A Content-Encoding other than identity (gzip, ...) is kept: the body's bytes are
    # not its events, so they cannot be read as they pass.
    coded: bool = False


def parse_response_headers(headers: Headers, replaced: frozenset[bytes] = frozenset()) -> ResponseParts:
    """One pass over the upstream's response headers; ``replaced`` names headers the
    proxy sets itself on every response, so the upstream's copies are dropped.

    Raises ``BadResponse`` for a Transfer-Encoding other than a lone ``chunked``:
    llhttp hands such a body over still coded, and the coding would go with the
    hop-by-hop header, so the client would get it without being told.
    """
    kept: Headers = []
    event_stream = coded = False
    length = None
    codings: list[bytes] | None = None
    listed: set[bytes] | None = None
    for name, value in headers:
        lname = name.lower()
        if lname not in HOP_BY_HOP and lname != b"content-length":
            if lname in replaced:
                continue
            kept.append((name, value))
            if lname == b"content-type":
                event_stream = b"text/event-stream" in value.lower()
            elif lname == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
                coded = True
        elif lname == b"content-length":
            length = value.strip()
        elif lname == b"transfer-encoding":
            if codings is None:
                codings = []
            codings.extend(_tokens(value))
        elif lname == b"connection":
            listed = _connection_listed(listed, value)
    if listed is not None and not listed <= _NOT_NAMES:
        kept = [(n, v) for n, v in kept if n.lower() not in listed]
        coded = coded and b"content-encoding" not in listed
    if codings is not None and codings != [b"chunked"]:
        shown = b", ".join(codings).decode("latin-1")
        raise BadResponse(f"unsupported response: Transfer-Encoding {shown!r}: only 'chunked' is passed on")
    if length is not None and len(length) >= 19 and int(length) > MAX_CONTENT_LENGTH:  # llhttp checked the digits
        raise BadResponse(f"malformed response: Content-Length {length.decode()} is larger than {MAX_CONTENT_LENGTH}")
    return ResponseParts(codings is not None, length, kept, event_stream, header_lines(kept), coded)


class ResponseFraming:
    """How the proxy delimits a response body towards the client."""

    LENGTH = "length"  # Content-Length forwarded from the upstream
    CHUNKED = "chunked"  # re-chunked by the proxy, each upstream read one chunk
    CLOSE = "close"  # no length: the client connection closes after the body (HTTP/1.0 clients)
    NONE = "none"  # no body: HEAD, 204, 304


def response_framing(
    status: int, request_method: str, parts: ResponseParts, client_http11: bool
) -> tuple[str, bytes | None]:
    """(framing, content-length value) for the response to the client."""
    length = parts.content_length
    if request_method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return ResponseFraming.NONE, length if request_method == "HEAD" or status == 304 else None
    if length is not None and not parts.chunked:
        return ResponseFraming.LENGTH, length
    return (ResponseFraming.CHUNKED if client_http11 else ResponseFraming.CLOSE), None


def client_response_head(
    status: int,
    reason: bytes,
    end_to_end_lines: bytes,
    framing: str,
    content_length: bytes | None,
    keep_alive: bool,
    client_http11: bool,
    extra_lines: bytes = b"",
    keepalive_timeout: int | None = None,
) -> bytes:
    version = b"HTTP/1.1" if client_http11 else b"HTTP/1.0"
    lines = [b"%s %d %s\r\n" % (version, status, reason), end_to_end_lines, extra_lines]
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


def chunk_pieces(data: bytes) -> tuple[bytes, bytes, bytes]:
    """``chunk`` as size line, data and CRLF, for a writer that joins its pieces
    once anyway: the data is then copied once instead of twice."""
    return b"%x\r\n" % len(data), data, b"\r\n"


LAST_CHUNK = b"0\r\n\r\n"
