"""Typed traceproxy settings from flags, TRACEPROXY_* environment variables, a TOML file and defaults.

Precedence, highest first: flags, environment, file, defaults. The file is read only when named by
--config or TRACEPROXY_CONFIG. Flags, environment names, TOML keys and the shipped default file are
all derived from SCHEMA. Loading has no side effects beyond reading that one file.
"""

from __future__ import annotations

import argparse
import difflib
import ipaddress
import math
import os
import re
import socket
import textwrap
import tomllib
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from .hostnames import is_hostname
from .lifecycle.stall import STALL_KINDS

ENV_PREFIX = "TRACEPROXY_"
CONFIG_ENV = "TRACEPROXY_CONFIG"


class ConfigError(Exception):
    """An invalid setting; the message names the key, its source, the bad value and the expected form."""


class _Rejected(ValueError):
    """A parser's specific reason, shown before the expected form. Any other ValueError shows only the form."""


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


@dataclass(frozen=True)
class Timeouts:
    connect: float
    upstream_headers: float
    upstream_read: float
    client_headers: float
    client_body: float
    client_send: float
    client_keepalive: float
    shutdown_grace: float


@dataclass(frozen=True)
class Pool:
    idle_timeout: float
    keep_warm: float  # 0: off
    max_connections: int
    retry_buffer_bytes: int


@dataclass(frozen=True)
class Limits:
    max_client_connections: int
    max_header_bytes: int
    max_target_bytes: int
    # A default so code that builds Limits by hand keeps working; it must equal the schema's.
    client_half_close: str = "abort"  # abort | answer


@dataclass(frozen=True)
class Forwarding:
    preserve_host: bool
    x_forwarded: bool


@dataclass(frozen=True)
class RequestIds:
    headers: tuple[str, ...]  # lower-case header names, first one used when generating
    inject_rid: bool


@dataclass(frozen=True)
class Tracing:
    exporter: str  # auto | otlp | file | console | off
    otlp_endpoint: str
    otlp_protocol: str  # "" | grpc | http/protobuf
    file_path: str
    service_name: str
    healthy_sample_ratio: float | None  # None: from OTEL_TRACES_SAMPLER, else 1.0
    healthy_max_per_second: int  # 0: no ceiling
    queue_spans: int
    exporter_nice: int


@dataclass(frozen=True)
class Stall:
    client_headers: float
    client_body: float
    pool_wait: float
    first_byte: float
    stream_gap: float
    client_drain: float
    action: str  # observe | abort
    abort_on: tuple[str, ...]  # stall kinds that abort even when action = observe


@dataclass(frozen=True)
class AccessLog:
    path: str  # "" off, "-" stdout, else a file


@dataclass(frozen=True)
class Engines:
    metrics_urls: tuple[str, ...]  # empty: the scraper does not start
    scrape_interval: float
    scrape_timeout: float
    orphan_after: float
    probe_on_stall: bool = False
    probe_path: str = "/health"
    probe_timeout: float = 2.0


@dataclass(frozen=True)
class Settings:
    listen: HostPort
    upstream: UpstreamURL
    admin: HostPort | None  # None: admin listener disabled
    admin_public: bool
    workers: int
    log_level: str
    timeouts: Timeouts
    pool: Pool
    limits: Limits
    forwarding: Forwarding
    request_id: RequestIds
    tracing: Tracing
    stall: Stall
    access_log: AccessLog
    # A default so code that builds Settings by hand (tests) keeps working; it must equal
    # the [engines] schema defaults below (off: no URLs).
    engines: Engines = Engines(metrics_urls=(), scrape_interval=5.0, scrape_timeout=2.0, orphan_after=30.0)
    # Where each key's value came from ("default", "flag --admin", "env TRACEPROXY_ADMIN",
    # "file F"): errors found after loading (a path that cannot be written) name it too.
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def source(self, dotted: str) -> str:
        return self.sources.get(dotted, "the settings")

    def replace(self, **dotted_overrides: Any) -> Settings:
        """A copy with some keys changed, e.g. replace(**{"timeouts.connect": 1.0}); validated like any source."""
        return self.replace_from(dotted_overrides, "replace()")

    def replace_from(self, dotted_overrides: Mapping[str, Any], source: str) -> Settings:
        """``replace`` with the overrides' origin named in errors (e.g. a command-line option)."""
        raw = {s.dotted: (_as_raw(s.value_in(self)), self.source(s.dotted)) for s in SCHEMA}
        for dotted, value in dotted_overrides.items():
            if dotted not in _BY_DOTTED:
                raise _unknown("key", dotted, _BY_DOTTED, source)
            raw[dotted] = (_as_raw(value), source)
        return _build(raw)


# --- kinds: how a raw value (a TOML value, or a string from a flag or env var) becomes a typed one ---


@dataclass(frozen=True)
class Kind:
    parse: Callable[[Any], Any]  # raises ValueError on a bad value
    expected: str  # the accepted form, quoted in errors, --help and the default file
    metavar: str


def _number(raw: Any, cast: type) -> Any:
    # bool is an int subclass, and int(2.5) would silently truncate
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)) or (cast is int and isinstance(raw, float)):
        raise ValueError
    value = cast(raw)
    if not math.isfinite(value):
        raise ValueError
    return value


def _str(raw: Any) -> str:
    if not isinstance(raw, str):
        raise ValueError
    return raw


# Durations are turned into integer nanoseconds and timer delays: past this, a finite
# value would overflow them, and no timeout or window of a proxy needs more.
MAX_SECONDS = 365 * 24 * 3600


def seconds(*, zero: str | None = None) -> Kind:
    """Finite seconds, at most a year: > 0, or >= 0 when `zero` says what 0 means."""

    def parse(raw: Any) -> float:
        value = _number(raw, float)
        if value < 0 or (value == 0 and zero is None) or value > MAX_SECONDS:
            raise ValueError
        return value

    lower = f">= 0 (0 = {zero})" if zero else "> 0"
    return Kind(parse, f"a number of seconds {lower}, at most {MAX_SECONDS} (a year)", "SECONDS")


def integer(minimum: int, maximum: int | None = None, *, zero: str | None = None) -> Kind:
    def parse(raw: Any) -> int:
        value = _number(raw, int)
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError
        return value

    if maximum is not None:
        expected = f"an integer from {minimum} to {maximum}"
    else:
        expected = f"an integer >= {minimum}" + (f" (0 = {zero})" if zero else "")
    return Kind(parse, expected, "N")


_BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True}
_BOOL_WORDS |= {"false": False, "0": False, "no": False, "off": False}


def boolean() -> Kind:
    def parse(raw: Any) -> bool:
        if isinstance(raw, bool):
            return raw
        word = _str(raw).lower()
        if word not in _BOOL_WORDS:
            raise ValueError
        return _BOOL_WORDS[word]

    return Kind(parse, "true or false (also 1/0, yes/no, on/off)", "BOOL")


def _port(text: str, minimum: int) -> int:
    if not (text.isascii() and text.isdigit()):
        raise ValueError
    port = int(text)
    if not minimum <= port <= 65535:
        raise _Rejected(f"port {port} is out of range {minimum}..65535")
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
            raise _Rejected("an IPv6 address needs brackets")
        if not is_hostname(host):
            raise ValueError
        port_text = port_text if colon else None
    if port_text is None:
        if default_port is None:
            raise _Rejected("missing port")
        return host, default_port
    return host, _port(port_text, min_port)


def address(*, off: bool = False) -> Kind:
    """HOST:PORT to listen on; port 0 lets the OS pick one (for tests). With `off`, "off" or None gives None."""

    def parse(raw: Any) -> HostPort | None:
        if off and (raw is None or _str(raw).lower() == "off"):
            return None
        return HostPort(*_split_host_port(_str(raw), default_port=None, min_port=0))

    expected = "HOST:PORT such as 127.0.0.1:8000 or [::1]:8000" + (", or off" if off else "")
    return Kind(parse, expected, "HOST:PORT")


# --- the same forms as argparse types, for the other commands' flags ---


def _argument(kind: Kind, text: str) -> Any:
    try:
        return kind.parse(text.strip())
    except ValueError as exc:
        reason = f"{exc}; " if isinstance(exc, _Rejected) else ""
        raise argparse.ArgumentTypeError(f"{reason}expected {kind.expected}, got {text!r}") from None


def listen_argument(text: str) -> HostPort:
    """HOST:PORT to listen on (port 0: a free one), as the ``listen`` key takes it."""
    return _argument(address(), text)


def seconds_argument(zero: str) -> Any:
    """Seconds >= 0 (0 = ``zero``), at most a year, as the config's durations."""
    kind = seconds(zero=zero)
    return lambda text: _argument(kind, text)


def http_url() -> Kind:
    def parse(raw: Any) -> UpstreamURL:
        text = _str(raw)
        scheme = text.partition("://")[0].lower()
        if scheme == "https":
            raise _Rejected("TLS upstreams are not supported")
        if scheme != "http":
            raise ValueError
        authority = text[7:].removesuffix("/")
        if any(c in authority for c in "/?#@"):
            raise _Rejected("only a host and port may follow http://")
        return UpstreamURL(*_split_host_port(authority, default_port=80, min_port=1))

    return Kind(parse, "http://HOST[:PORT] with no path other than / (port defaults to 80)", "URL")


_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def header_names() -> Kind:
    """One or more HTTP header names, comma-separated in a flag or env var, a list in TOML."""

    def parse(raw: Any) -> tuple[str, ...]:
        items = list(raw) if isinstance(raw, (list, tuple)) else _str(raw).split(",")
        names = tuple(_str(item).strip().lower() for item in items)
        if not names or not all(_HEADER_NAME.fullmatch(n) for n in names):
            raise ValueError
        return names

    return Kind(parse, 'one or more header names, e.g. ["x-request-id", "x-correlation-id"]', "NAMES")


def http_urls() -> Kind:
    """Zero or more http:// URLs with any path, comma-separated in a flag or env var, a list in TOML."""

    def parse(raw: Any) -> tuple[str, ...]:
        items = list(raw) if isinstance(raw, (list, tuple)) else [i for i in _str(raw).split(",") if i.strip()]
        urls = tuple(_str(item).strip() for item in items)
        for url in urls:
            scheme, sep, rest = url.partition("://")
            if scheme.lower() != "http" or not sep:
                raise _Rejected(f"{url!r} is not an http:// URL")
            _split_host_port(rest.partition("/")[0], default_port=80, min_port=1)
        return urls

    return Kind(parse, 'a list of http:// URLs, e.g. ["http://127.0.0.1:30000/metrics"]', "URLS")


def url_path() -> Kind:
    def parse(raw: Any) -> str:
        value = _str(raw).strip()
        # Sent as is on a request line: printable ASCII only (RFC 3986; anything else
        # would be percent-encoded by the operator, as a URL in a request line must be).
        if not value.startswith("/") or not all(c.isascii() and c.isprintable() and not c.isspace() for c in value):
            raise _Rejected(f"{value!r} is not a path starting with / in printable ASCII (percent-encode the rest)")
        return value

    return Kind(parse, "a URL path starting with /, e.g. /health", "PATH")


def choice(*options: str) -> Kind:
    def parse(raw: Any) -> str:
        value = _str(raw).strip().lower()
        if value not in options:
            raise ValueError
        return value

    return Kind(parse, "one of " + ", ".join(repr(o) for o in options), "|".join(o or '""' for o in options))


def stall_kinds() -> Kind:
    """Stall kinds, as lifecycle.stall declares them; comma-separated in a flag or env var, a list in TOML."""

    def parse(raw: Any) -> tuple[str, ...]:
        items = list(raw) if isinstance(raw, (list, tuple)) else [i for i in _str(raw).split(",") if i.strip()]
        kinds = tuple(_str(item).strip().lower() for item in items)
        if not all(k in STALL_KINDS for k in kinds):
            raise ValueError
        return kinds

    return Kind(parse, "a list of stall kinds from " + ", ".join(STALL_KINDS), "KINDS")


def text() -> Kind:
    return Kind(lambda raw: _str(raw).strip(), "a string", "TEXT")


def file_path() -> Kind:
    """A path the proxy opens (the keys' own help says what - or empty means). A NUL
    cannot be in a path: open() would refuse it at startup, as a traceback."""

    def parse(raw: Any) -> str:
        value = _str(raw).strip()
        if "\0" in value:
            raise ValueError
        return value

    return Kind(parse, "a file path", "PATH")


# gRPC's own target forms (unix:/path, dns:///host:port, ...), passed to it as they are.
_GRPC_TARGET_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")


def collector_endpoint() -> Kind:
    """An OTLP collector's URL (http:// or https://, a host, a port if any), or for
    gRPC HOST:PORT or one of gRPC's own targets; empty for the OTEL_* variables."""

    def parse(raw: Any) -> str:
        value = _str(raw).strip()
        if not value:
            return value
        if any(c.isspace() or not c.isprintable() for c in value):
            raise ValueError
        if value.lower().startswith(_GRPC_TARGET_SCHEMES) and value.partition(":")[2]:
            return value
        if "://" not in value:
            _split_host_port(value, default_port=None, min_port=1)
            return value
        parts = urllib.parse.urlsplit(value)  # ValueError for an unclosed IPv6 bracket
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port == 0:
            raise ValueError  # (parts.port itself raises ValueError for a port out of range)
        return value

    return Kind(parse, "an http(s):// URL such as http://127.0.0.1:4318; for gRPC also HOST:PORT or a gRPC "
                "target such as unix:///run/otel.sock; or empty", "URL")


def ratio(*, empty: str) -> Kind:
    def parse(raw: Any) -> float | None:
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            return None
        value = _number(raw, float)
        if not 0.0 <= value <= 1.0:
            raise ValueError
        return value

    return Kind(parse, f'a number from 0 to 1, or "" ({empty})', "RATIO")


# --- the schema ---


@dataclass(frozen=True)
class Setting:
    section: str  # "" for a top-level key
    key: str
    kind: Kind
    default: Any  # in TOML form; parsed like any other source
    meaning: str

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.key}" if self.section else self.key

    @property
    def flag(self) -> str:
        return "--" + self.dotted.replace(".", "-").replace("_", "-")

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dotted.replace(".", "_").upper()

    def value_in(self, settings: Settings) -> Any:
        return getattr(getattr(settings, self.section) if self.section else settings, self.key)


# Hazard: top-level keys must come first and each section's rows must be contiguous, or the
# rendered default file stops being valid TOML once its keys are uncommented.
SCHEMA: tuple[Setting, ...] = (
    Setting("", "listen", address(), "127.0.0.1:8000", "Address the proxy listens on for clients. Port 0 takes any free port (the "
            "startup log names it; only with workers = 1)."),
    Setting("", "upstream", http_url(), "http://127.0.0.1:30000",
            "Base URL of the router or engine that requests are forwarded to."),
    Setting("", "admin", address(off=True), "127.0.0.1:9464",
            "Address of the read-only admin listener; off disables it. Port 0 as for listen."),
    Setting("", "admin_public", boolean(), False, "Allow the admin listener on a non-loopback address."),
    Setting("", "workers", integer(1, 64), 1, "Number of processes sharing the listen port (SO_REUSEPORT)."),
    Setting("", "log_level", choice("debug", "info", "warning", "error"), "info",
            "Level of the proxy's own log messages (stderr)."),
    Setting("timeouts", "connect", seconds(), 5.0, "Connecting to the upstream."),
    Setting("timeouts", "upstream_headers", seconds(zero="off"), 600.0,
            "From the client's last request byte (the end of its head, or the last body byte "
            "received) to the response headers, else 504 (UT; PWS if no connection was free under "
            "pool.max_connections). Long because a long prefill is normal."),
    Setting("timeouts", "upstream_read", seconds(zero="off"), 600.0,
            "Longest silence between upstream response body bytes before the response is aborted."),
    Setting("timeouts", "client_headers", seconds(), 30.0,
            "Receiving a complete request head, counted from its first byte."),
    Setting("timeouts", "client_body", seconds(zero="off"), 60.0,
            "Longest silence between request body bytes, else 408."),
    Setting("timeouts", "client_send", seconds(zero="off"), 60.0,
            "Longest time a client whose connection is full takes none of the response before the "
            "request is cut (DNR), freeing its upstream connection, as nginx's send_timeout."),
    Setting("timeouts", "client_keepalive", seconds(), 75.0,
            "An idle client keep-alive connection is closed after this."),
    Setting("timeouts", "shutdown_grace", seconds(zero="stop at once"), 30.0,
            "On SIGTERM or SIGINT, in-flight streams get this long to finish, and slow clients to "
            "take what was written to them; what is left then is cut with a reset."),
    Setting("pool", "idle_timeout", seconds(), 4.0,
            "An idle upstream keep-alive connection is closed after this; kept below the 5 s idle "
            "timeout of uvicorn-based engines so a connection the engine is closing is not reused."),
    Setting("pool", "keep_warm", seconds(zero="off"), 60.0,
            "The pool keeps as many connections open as were in use at once during the last this many "
            "seconds, replacing each idle one with a fresh one before idle_timeout, so a burst after a "
            "pause finds them ready instead of opening them all at once. Also, as a keep-alive client "
            "connection sends its first request, one connection is opened ahead while fewer are open "
            "than such client connections, so clients that each sent a request, then burst within "
            "idle_timeout, find them ready too. Nothing is renewed while the "
            "upstream closes idle connections before idle_timeout (traceproxy_upstream_keepalive_misaligned "
            "is 1): their replacements would be closed the same way."),
    Setting("pool", "max_connections", integer(0, zero="unlimited"), 1024,
            "Upstream connections open at once, per worker; further requests wait."),
    Setting("pool", "retry_buffer_bytes", integer(0, zero="never retry"), 1048576,
            "Request bytes kept so a request that failed on a stale reused connection can be resent "
            "once on a fresh one; larger requests are not retried."),
    Setting("limits", "max_client_connections", integer(1), 10000,
            "Open client connections, per worker; at the cap the longest-idle keep-alive connection is closed "
            "to make room. Lowered at startup, with a warning, to what the open-file limit can hold."),
    Setting("limits", "max_header_bytes", integer(1024), 65536,
            "A request head larger than this gets 431; a response head or trailer section larger than "
            "this from the upstream is a 502."),
    Setting("limits", "max_target_bytes", integer(64), 8192, "A request target longer than this gets 414."),
    Setting("limits", "client_half_close", choice("abort", "answer"), "abort",
            "A client that half-closes (a FIN: shutdown(SHUT_WR), nc -N, some health checkers) after sending "
            "a complete request, before its response is complete. abort: taken as leaving, as nginx and "
            "Envoy take it: the request ends DC (blame client) and its upstream connection is closed, so "
            "the engine stops work nobody will read. answer: the response is still sent, then the "
            "connection closed; a client that in fact left is found at the first write (a reset). A FIN "
            "before the request is complete is a disconnect (DC) either way."),
    Setting("forwarding", "preserve_host", boolean(), True,
            "Forward the client's Host header; false sends the upstream's host:port instead."),
    Setting("forwarding", "x_forwarded", boolean(), True,
            "Append X-Forwarded-For, X-Forwarded-Proto and X-Forwarded-Host."),
    Setting("request_id", "headers", header_names(), ["x-request-id"],
            "Headers that carry the client's request id (like the router's --request-id-headers); "
            "the first one is generated when none is present, and returned on every response. Not a header "
            "the proxy manages itself (framing, connection, forwarding, tracing)."),
    Setting("request_id", "inject_rid", boolean(), False,
            "For JSON bodies of SGLang /generate, set the body field rid to the request id when absent, "
            "so the engines' own logs carry it (the router keeps rid on /generate, strips it on chat)."),
    Setting("tracing", "exporter", choice("auto", "otlp", "file", "console", "off"), "auto",
            "Where spans go: auto = otlp when OTEL_EXPORTER_OTLP_ENDPOINT or otlp_endpoint is set, "
            "else the local file."),
    Setting("tracing", "otlp_endpoint", collector_endpoint(), "",
            "OTLP endpoint; empty = OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT."),
    Setting("tracing", "otlp_protocol", choice("", "grpc", "http/protobuf"), "",
            "OTLP protocol; empty = OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL, "
            "else http/protobuf."),
    Setting("tracing", "file_path", file_path(), "traceproxy-data/spans.jsonl",
            "The local span file (OTLP/JSON lines, as the OpenTelemetry Collector's file exporter "
            "writes and its file receiver reads)."),
    Setting("tracing", "service_name", text(), "",
            "Resource service.name; empty = OTEL_SERVICE_NAME, else traceproxy."),
    Setting("tracing", "healthy_sample_ratio", ratio(empty="from OTEL_TRACES_SAMPLER, else 1"), "",
            "Fraction of healthy requests whose trace is kept; requests that errored or stalled are "
            "always kept. Decided when the request ends."),
    Setting("tracing", "healthy_max_per_second", integer(0, zero="no ceiling"), 250,
            "At most this many healthy requests' traces kept per second (per worker), in bursts of up "
            "to one second's worth; beyond it they are shed (counted). Bounds what tracing costs under a "
            "flood; far above LLM request rates, where every trace is kept. Errored and stalled "
            "requests are always kept."),
    Setting("tracing", "queue_spans", integer(64), 8192,
            "Spans waiting for the exporter process; beyond this new spans are dropped and counted. "
            "Past half of it the exporter is behind: healthy requests' spans are shed (counted), "
            "errored and stalled ones still queue."),
    Setting("tracing", "exporter_nice", integer(0, 19), 10,
            "Added to the exporter process's CPU niceness, so that on saturated cores proxying gets "
            "the CPU first and the span queue absorbs the lag (0 = same priority as the proxy)."),
    Setting("stall", "client_headers", seconds(zero="off"), 10.0,
            "A request head started and not finished for this long is a stall (blame client)."),
    Setting("stall", "client_body", seconds(zero="off"), 30.0,
            "A request body the client stopped sending for this long is a stall (blame client)."),
    Setting("stall", "pool_wait", seconds(zero="off"), 5.0,
            "Waiting this long for an upstream connection (pool cap: proxy; connecting: engine) is a stall."),
    Setting("stall", "first_byte", seconds(zero="off"), 120.0,
            "The request sent and no response header for this long is a stall (blame engine: router "
            "queue or prefill). Long because a long prefill under load is normal."),
    Setting("stall", "stream_gap", seconds(zero="off"), 30.0,
            "The upstream silent this long between response chunks is a stall (blame engine: decode)."),
    Setting("stall", "client_drain", seconds(zero="off"), 30.0,
            "Response bytes waiting this long because the client is not reading is a stall (blame client)."),
    Setting("stall", "action", choice("observe", "abort"), "observe",
            "observe: report stalls (log, metric, stall span) and let the request go on; abort: also end "
            "the request (504 with the outcome if no response started, else a cut stream)."),
    Setting("stall", "abort_on", stall_kinds(), [],
            "Stall kinds that abort even when action is observe, e.g. [\"first_byte\", \"stream_gap\"]."),
    Setting("access_log", "path", file_path(), "-",
            "One JSON line per finished request: - for stdout, a file path, or empty to turn it off."),
    Setting("engines", "metrics_urls", http_urls(), [],
            "Prometheus /metrics URLs of the router and the prefill and decode workers; when empty "
            "nothing is scraped and nothing is correlated."),
    Setting("engines", "scrape_interval", seconds(), 5.0, "Seconds between scrapes of every metrics URL."),
    Setting("engines", "scrape_timeout", seconds(), 2.0,
            "A scrape that takes longer fails (counted and shown); so does an answer over 4 MiB or "
            "without Prometheus samples. Proxying never waits for it."),
    Setting("engines", "orphan_after", seconds(), 30.0,
            "Engine work that no proxied request explains for this long is reported as an orphan (EOR)."),
    Setting("engines", "probe_on_stall", boolean(), False,
            "When a request stalls waiting on the upstream (FBS, MSS, UCS), send GET probe_path on a fresh "
            "connection to the same upstream (never from the pool, at most one at a time) and record whether "
            "it answered: a connection-state fault (fresh works) or an unresponsive engine (fresh hangs too)."),
    Setting("engines", "probe_path", url_path(), "/health", "The path the stall probe requests."),
    Setting("engines", "probe_timeout", seconds(), 2.0,
            "A stall probe that has no response status line within this long counts as hanging."),
)

_SECTIONS: dict[str, tuple[type, str]] = {
    "timeouts": (Timeouts, "Timeouts, in seconds."),
    "pool": (Pool, "Upstream connection pool."),
    "limits": (Limits, "Limits on clients and requests."),
    "forwarding": (Forwarding, "Headers sent to the upstream."),
    "request_id": (RequestIds, "Request ids."),
    "stall": (Stall, "Stall detection: how long a wait may last before the watchdog reports it, in seconds "
              "(0 = off). Stalls are verdicts on live requests; the hard limits are under [timeouts]."),
    "access_log": (AccessLog, "The access log."),
    "engines": (Engines, "Correlation with the engines: their /metrics gauges, scraped in the background."),
    "tracing": (Tracing, "OpenTelemetry tracing. The standard OTEL_* environment variables apply "
                "where a key is left empty."),
}
_BY_DOTTED = {s.dotted: s for s in SCHEMA}
_BY_ENV = {s.env: s for s in SCHEMA}
_TOP_LEVEL = {s.key for s in SCHEMA if not s.section}

Raw = dict[str, tuple[Any, str]]  # dotted key -> (raw value, where it came from)


# --- building Settings ---


def _as_raw(value: Any) -> Any:
    return str(value) if isinstance(value, (HostPort, UpstreamURL)) else value


def _unknown(what: str, name: str, known: Iterable[str], where: str = "") -> ConfigError:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.8)
    place = f" in {where}" if where else ""
    hint = f"; did you mean {close[0]}?" if close else ""
    return ConfigError(f"unknown {what} {name}{place}{hint}")


def _parse(setting: Setting, raw: Any, source: str) -> Any:
    try:
        return setting.kind.parse(raw.strip() if isinstance(raw, str) else raw)
    except ValueError as e:
        reason = f"{e}; " if isinstance(e, _Rejected) else ""
        message = f"{setting.dotted} = {raw!r} (from {source}): {reason}expected {setting.kind.expected}"
        raise ConfigError(message) from None


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # other hostnames: resolving them here would be a side effect


def _check_admin_exposure(admin: HostPort | None, admin_public: bool, source: str) -> None:
    if admin is None or admin_public or _is_loopback(admin.host):
        return
    raise ConfigError(
        f"admin = {str(admin)!r} (from {source}): {admin.host} is not a loopback address; expected a "
        "loopback HOST:PORT (127.0.0.1, [::1] or localhost) or off, or set admin_public = true"
    )


def _check_shared_ports(values: dict[str, Any], raw: Raw) -> None:
    """Workers share their ports through SO_REUSEPORT, which needs one known port:
    with port 0 each worker would be given a different one."""
    if values["workers"] <= 1:
        return
    for key in ("listen", "admin"):
        address = values[key]
        if address is not None and address.port == 0:
            raise ConfigError(
                f"{key} = {str(address)!r} (from {raw[key][1]}): port 0 picks a free port per process, so "
                f"the {values['workers']} workers (from {raw['workers'][1]}) would not share one; expected "
                "a fixed port with workers > 1"
            )


def _bound_addresses(host: str) -> set:
    """The addresses a listener on ``host`` binds, as far as is known without a lookup:
    an IP in any spelling inet_aton takes (127.1, 0), a zone kept only where it tells
    addresses apart (link-local), and localhost as both loopbacks. Another name is
    compared by name; a clash through it shows when the ports are bound (see
    app._check_port_bindable), where resolving it costs nothing extra."""
    name = host.lower()
    if name == "localhost":
        return {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if ":" in host:
            return {name}
        try:
            return {ipaddress.ip_address(socket.inet_ntoa(socket.inet_aton(host)))}
        except OSError:
            return {name}
    if address.version == 6 and address.scope_id and not address.is_link_local:
        address = ipaddress.ip_address(host.partition("%")[0])
    return {address}


def _overlap(a, b) -> bool:
    """Two bound addresses take the same connections: equal, or one is the wildcard of
    the other's family (IPv6 listeners are IPv6-only, so :: does not cover IPv4)."""
    if a == b:
        return True
    if isinstance(a, str) or isinstance(b, str) or a.version != b.version:
        return False
    return a.is_unspecified or b.is_unspecified


def _check_distinct_ports(values: dict[str, Any], raw: Raw) -> None:
    """The proxy and the admin listener on one address: with workers > 1 (SO_REUSEPORT)
    both would bind and the kernel would split connections between them."""
    listen, admin = values["listen"], values["admin"]
    if admin is None or admin.port == 0 or admin.port != listen.port:
        return
    if any(_overlap(a, b) for a in _bound_addresses(admin.host) for b in _bound_addresses(listen.host)):
        raise ConfigError(
            f"admin = {str(admin)!r} (from {raw['admin'][1]}) is the listen address {str(listen)!r} (from "
            f"{raw['listen'][1]}); expected another port for the admin listener, or off"
        )


def _reaches(destination, listener) -> bool:
    """A connection to ``destination`` lands on a listener bound to ``listener``, as far
    as is known without a lookup: the same address, a loopback or unspecified destination
    (which the kernel sends to this host) at a wildcard or loopback listener, and the
    same name. A specific address at a wildcard listener may be this host's or another's:
    not judged."""
    if destination == listener:
        return True
    if isinstance(destination, str) or isinstance(listener, str) or destination.version != listener.version:
        return False
    local = destination.is_loopback or destination.is_unspecified
    return local and (listener.is_unspecified or listener.is_loopback and destination.is_unspecified)


def _check_upstream_not_self(values: dict[str, Any], raw: Raw) -> None:
    """An upstream that is the proxy's own listener sends every request back in, until
    the pool is full and every client waits: refused at startup rather than found then."""
    upstream = values["upstream"]
    for key in ("listen", "admin"):
        address = values[key]
        if address is None or address.port != upstream.port:
            continue
        if any(_reaches(u, a) for u in _bound_addresses(upstream.host) for a in _bound_addresses(address.host)):
            raise ConfigError(
                f"upstream = {str(upstream)!r} (from {raw['upstream'][1]}) is this proxy's own {key} address "
                f"{str(address)!r} (from {raw[key][1]}); expected the router's or engine's address"
            )


def _build(raw: Raw) -> Settings:
    values = {s.dotted: _parse(s, *raw[s.dotted]) for s in SCHEMA}
    _check_admin_exposure(values["admin"], values["admin_public"], raw["admin"][1])
    _check_shared_ports(values, raw)
    _check_distinct_ports(values, raw)
    _check_upstream_not_self(values, raw)
    sections = {
        name: cls(**{s.key: values[s.dotted] for s in SCHEMA if s.section == name})
        for name, (cls, _) in _SECTIONS.items()
    }
    return Settings(**{key: values[key] for key in _TOP_LEVEL}, **sections,
                    sources={dotted: source for dotted, (_, source) in raw.items()})


def _defaults() -> Raw:
    return {s.dotted: (s.default, "default") for s in SCHEMA}


def default_settings() -> Settings:
    return _build(_defaults())


# --- sources ---


def _read_toml(path: str, source: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} (from {source}) does not exist") from None
    except OSError as e:
        raise ConfigError(f"config file {path} (from {source}) cannot be read: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def _file_values(doc: Mapping[str, Any], where: str) -> Raw:
    raw: Raw = {}
    for name, value in doc.items():
        if name in _SECTIONS and not isinstance(value, dict):
            raise ConfigError(f"{name} = {value!r} (from {where}): expected a [{name}] table")
        if name not in _SECTIONS and isinstance(value, dict):
            raise _unknown("section", f"[{name}]", [f"[{section}]" for section in _SECTIONS], where)
        pairs = {f"{name}.{key}": v for key, v in value.items()} if name in _SECTIONS else {name: value}
        for dotted, v in pairs.items():
            if dotted not in _BY_DOTTED:
                raise _misplaced(dotted, where) or _unknown("key", dotted, _BY_DOTTED, where)
            raw[dotted] = (v, where)
    return raw


def _misplaced(dotted: str, where: str) -> ConfigError | None:
    """TOML's usual trap: a top-level key written below a [section] belongs to it."""
    section, _, key = dotted.partition(".")
    if key not in _BY_DOTTED:
        return None
    return ConfigError(f"unknown key {dotted} in {where}: {key} is a top-level key, "
                       f"so it must come before the first [section] (here it is under [{section}])")


def _env_values(environ: Mapping[str, str]) -> Raw:
    # Unknown TRACEPROXY_* variables are not errors: the environment is shared with
    # other tools (a benchmark's TRACEPROXY_CMD, say). ``unknown_environment`` names
    # them so the command line can warn about a likely typo.
    return {_BY_ENV[name].dotted: (value, f"env {name}") for name, value in environ.items() if name in _BY_ENV}


def unknown_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning per TRACEPROXY_* variable that is not a setting, with a suggestion."""
    environ = os.environ if environ is None else environ
    return [str(_unknown("environment variable", name, _BY_ENV)) + " (ignored)"
            for name in sorted(environ) if name.startswith(ENV_PREFIX) and name != CONFIG_ENV
            and name not in _BY_ENV]


def _given_flags(flags: argparse.Namespace | Mapping[str, Any] | None) -> dict[str, Any]:
    """Flags that were given, as dotted key -> raw value, plus "config" for --config."""
    if flags is None:
        return {}
    if isinstance(flags, argparse.Namespace):
        given = {s.dotted: getattr(flags, s.dest, None) for s in SCHEMA}
        given["config"] = getattr(flags, "config", None)
    else:
        for name in flags:
            if name != "config" and name not in _BY_DOTTED:
                raise _unknown("key", name, _BY_DOTTED, "flags")
        given = dict(flags)
    return {key: value for key, value in given.items() if value is not None}


def load_settings(
    flags: argparse.Namespace | Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Settings from flags > TRACEPROXY_* environment > the file named by --config/TRACEPROXY_CONFIG > defaults."""
    environ = os.environ if environ is None else environ
    given = _given_flags(flags)
    raw = _defaults()
    if "config" in given:
        path, source = str(given.pop("config")), "flag --config"
    else:
        path, source = environ.get(CONFIG_ENV), f"env {CONFIG_ENV}"
    if path is not None:
        raw.update(_checked(_file_values(_read_toml(path, source), f"file {path}")))
    raw.update(_checked(_env_values(environ)))
    raw.update({dotted: (value, f"flag {_BY_DOTTED[dotted].flag}") for dotted, value in given.items()})
    return _build(raw)


def _checked(values: Raw) -> Raw:
    """``values``, each parsed once here: a bad value in the file or the environment
    is an error even when a flag (or the environment) then overrides it, as a bad
    line in nginx's or Envoy's config is, whatever else is given."""
    for dotted, (value, source) in values.items():
        _parse(_BY_DOTTED[dotted], value, source)
    return values


# Short names that operators and docs use, beside the section-derived flag.
# (``request_id.headers`` needs none: its derived flag is already the router's
# ``--request-id-headers``.)
FLAG_ALIASES = {"request_id.inject_rid": ("--inject-rid",)}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Adds --config and one flag per setting; all default to None so "not given" stays visible."""
    group = parser.add_argument_group("settings (flags > TRACEPROXY_* env > --config file > defaults)")
    group.add_argument("--config", metavar="PATH", default=None,
                       help=f"TOML config file (env {CONFIG_ENV}); none is read unless named")
    for s in SCHEMA:
        text = f"{s.meaning} Expected: {s.kind.expected}. Default: {_toml_value(s.default)}. Env: {s.env}."
        # argparse %-formats help strings
        switch = {"nargs": "?", "const": "true"} if s.kind.metavar == "BOOL" else {}  # --inject-rid alone = true
        group.add_argument(s.flag, *FLAG_ALIASES.get(s.dotted, ()), dest=s.dest, metavar=s.kind.metavar,
                           default=None, help=text.replace("%", "%%"), **switch)


# --- the default config file ---

_HEADER = """\
# traceproxy configuration file (TOML).
#
# Every setting is shown commented out with its built-in default; uncomment a
# line to change it. The file is read only when named by --config PATH or
# TRACEPROXY_CONFIG=PATH. Precedence, highest first:
#   1. command-line flags            --timeouts-connect 2.5
#   2. TRACEPROXY_* environment      TRACEPROXY_TIMEOUTS_CONNECT=2.5
#   3. this file                     [timeouts] connect = 2.5
#   4. built-in defaults
"""


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def _comment(text: str) -> list[str]:
    return ["# " + line for line in textwrap.wrap(text, 76, break_on_hyphens=False)]


def render_default_toml() -> str:
    lines = [_HEADER.rstrip("\n")]
    section = ""
    for s in SCHEMA:
        if s.section != section:
            section = s.section
            lines += ["", *_comment(_SECTIONS[section][1]), f"[{section}]"]
        lines += ["", *_comment(s.meaning), *_comment(f"Expected: {s.kind.expected}."),
                  f"# {s.key} = {_toml_value(s.default)}"]
    return "\n".join(lines) + "\n"


def render_reference_markdown() -> str:
    """``docs/configuration.md``: every key, its flag, variable, default and meaning."""
    lines = ["# Configuration reference", "",
             "Generated from `traceproxy/config.py`; do not edit by hand. Precedence: flags, then",
             "`TRACEPROXY_*` environment variables, then the `--config` TOML file, then defaults.",
             "`config/traceproxy.toml` lists the same keys, commented out.", ""]
    section = None
    for s in SCHEMA:
        if s.section != section:
            section = s.section
            title = f"[{section}]" if section else "top level"
            intro = _SECTIONS[section][1] if section else "Where the proxy listens and what it forwards to."
            lines += [f"## {title}", "", intro, "", "| key | flag / environment | default | meaning |", "|---|---|---|---|"]
        flags = " ".join(f"`{f}`" for f in (s.flag, *FLAG_ALIASES.get(s.dotted, ())))
        meaning = f"{s.meaning} Expected: {s.kind.expected}.".replace("|", "\\|")
        lines.append(f"| `{s.key}` | {flags}<br>`{s.env}` | `{_toml_value(s.default)}` | {meaning} |")
        if s is SCHEMA[-1] or SCHEMA[SCHEMA.index(s) + 1].section != section:
            lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_default_toml(), end="")
