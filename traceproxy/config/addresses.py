"""Addresses and URLs as settings take them: HOST:PORT to listen on, the upstream's
http:// URL, the engines' metrics URLs and the OTLP collector's endpoint."""

from __future__ import annotations

import ipaddress
import urllib.parse
from dataclasses import dataclass
from typing import Any

from ..hostnames import is_hostname
from .errors import Rejected
from .kinds import Kind, require_str


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class HostPort:
    host: str  # IPv6 without brackets, ready for bind()
    port: int

    def __str__(self) -> str:
        return _join_host_port(self.host, self.port)


@dataclass(frozen=True)
class UpstreamURL:
    host: str
    port: int

    @property
    def authority(self) -> str:
        return _join_host_port(self.host, self.port)

    def __str__(self) -> str:
        return f"http://{self.authority}"


def _port(text: str, minimum: int) -> int:
    """A port as every address and URL setting takes it (``minimum`` is 0 only where the
    OS may pick one): digits, in range."""
    if not (text.isascii() and text.isdigit()):
        raise ValueError
    port = int(text)
    if not minimum <= port <= 65535:
        raise Rejected(f"port {port} is out of range {minimum}..65535")
    return port


def _split_host_port(text: str, *, default_port: int | None, min_port: int) -> tuple[str, int]:
    if text.startswith("["):
        host, closed, rest = text[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise ValueError
        ipaddress.IPv6Address(host)
        port_text = rest[1:] if rest else None
    else:
        host, colon, port_text = text.partition(":")
        if ":" in port_text:
            raise Rejected("an IPv6 address needs brackets")
        if not is_hostname(host):
            raise ValueError
        port_text = port_text if colon else None
    if port_text is None:
        if default_port is None:
            raise Rejected("missing port")
        return host, default_port
    return host, _port(port_text, min_port)


def address(*, off: bool = False) -> Kind:
    """HOST:PORT to listen on; port 0 lets the OS pick one (for tests). With `off`, "off" or None gives None."""

    def parse(raw: Any) -> HostPort | None:
        if off and (raw is None or require_str(raw).lower() == "off"):
            return None
        return HostPort(*_split_host_port(require_str(raw), default_port=None, min_port=0))

    expected = "HOST:PORT such as 127.0.0.1:8000 or [::1]:8000" + (", or off" if off else "")
    return Kind(parse, expected, "HOST:PORT")


def http_url() -> Kind:
    def parse(raw: Any) -> UpstreamURL:
        text = require_str(raw)
        scheme = text.partition("://")[0].lower()
        if scheme == "https":
            raise Rejected("TLS upstreams are not supported")
        if scheme != "http":
            raise ValueError
        authority = text[7:].removesuffix("/")
        if any(c in authority for c in "/?#@"):
            raise Rejected("only a host and port may follow http://")
        return UpstreamURL(*_split_host_port(authority, default_port=80, min_port=1))

    return Kind(parse, "http://HOST[:PORT] with no path other than / (port defaults to 80)", "URL")


def http_urls() -> Kind:
    """Zero or more http:// URLs with any path, comma-separated in a flag or env var, a list in TOML."""

    def parse(raw: Any) -> tuple[str, ...]:
        items = list(raw) if isinstance(raw, (list, tuple)) else [i for i in require_str(raw).split(",") if i.strip()]
        urls = tuple(require_str(item).strip() for item in items)
        for url in urls:
            scheme, sep, rest = url.partition("://")
            if scheme.lower() != "http" or not sep:
                raise Rejected(f"{url!r} is not an http:// URL")
            _split_host_port(rest.partition("/")[0], default_port=80, min_port=1)
        return urls

    return Kind(parse, 'a list of http:// URLs, e.g. ["http://127.0.0.1:30000/metrics"]', "URLS")


# gRPC's own target forms (unix:/path, dns:///host:port, ...), passed to it as they are.
_GRPC_TARGET_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")


def _collector_url(value: str) -> str:
    """``value`` if it is a URL the OTLP exporters can send to: what urlsplit refuses here,
    they refuse at every export (requests says "Failed to parse")."""
    try:
        parts = urllib.parse.urlsplit(value)
    except ValueError as exc:  # an unclosed [ or a bracketed host that is not IPv6
        raise Rejected(f"not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError
    port = _url_port(parts.netloc)
    if port is not None:  # judged here as the exporters' parts.port would refuse it
        _port(port, 1)
    return value


def _url_port(netloc: str) -> str | None:
    """The port's text in a URL's netloc, None when there is none: as urlsplit finds it
    (after a user's @, after an IPv6 address's ])."""
    host_and_port = netloc.rpartition("@")[2]
    if host_and_port.startswith("["):
        host_and_port = host_and_port.partition("]")[2]
    return host_and_port.partition(":")[2] or None


def collector_endpoint() -> Kind:
    """An OTLP collector's URL (http:// or https://, a host, a port if any), or for
    gRPC HOST:PORT or one of gRPC's own targets; empty for the OTEL_* variables."""

    def parse(raw: Any) -> str:
        value = require_str(raw).strip()
        if not value:
            return value
        if any(c.isspace() or not c.isprintable() for c in value):
            raise ValueError
        if value.lower().startswith(_GRPC_TARGET_SCHEMES) and value.partition(":")[2]:
            return value
        if "://" not in value:
            _split_host_port(value, default_port=None, min_port=1)
            return value
        return _collector_url(value)

    return Kind(parse, "an http(s):// URL such as http://127.0.0.1:4318; for gRPC also HOST:PORT or a gRPC "
                "target such as unix:///run/otel.sock; or empty", "URL")
