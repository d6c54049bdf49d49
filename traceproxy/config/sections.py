"""The settings: a frozen dataclass per [section], and the schema derived from them.

Each key is declared once, as a field: ``setting(kind, default, meaning)`` gives its form
(kinds.py, addresses.py), its default as a file would spell it, and what it means. The
[stall] thresholds are the stall kinds, declared with their defaults and meanings in
lifecycle.stall. SCHEMA lists the keys in field order, top-level keys first; the flags,
the TRACEPROXY_* variables, the TOML keys, --help, the shipped default file and
docs/configuration.md all come from it.

The dataclasses stay plain: attribute reads cost what they always did, and the proxy
copies what it needs into its own attributes at startup, so nothing here runs per request.
"""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields
from typing import Any, Mapping, NamedTuple

from ..lifecycle.stall import MEANING as STALL_MEANING
from ..lifecycle.stall import StallThresholds
from .addresses import HostPort, UpstreamURL, address, collector_endpoint, http_url, http_urls
from .cross_checks import check_between_keys
from .errors import ConfigError, Rejected, refusal, unknown
from .kinds import (Kind, boolean, choice, file_path, header_names, integer, ratio, require_str, seconds, stall_kinds,
                    text, url_path)

ENV_PREFIX = "TRACEPROXY_"
CONFIG_ENV = "TRACEPROXY_CONFIG"  # the file to read, like --config
MAX_WORKERS = 64  # serve's worker processes at most (bench's --workers takes the same)

_DECLARED = "traceproxy.config.setting"  # a field's metadata: its _Declaration
_SECTION = "traceproxy.config.section"  # a Settings field's metadata: its section's opening sentence


class _Declaration(NamedTuple):
    kind: Kind
    default: Any  # in TOML form; parsed like any other source
    meaning: str
    flag_aliases: tuple[str, ...] = ()


def setting(kind: Kind, default: Any, meaning: str, *, flag_aliases: tuple[str, ...] = ()) -> Any:
    """A settings field: its form, its default as a file would spell it, what it means
    (for --help, the default file and the reference), and any short flag beside the
    derived one. The dataclass default is that value parsed, so a section built by hand
    defaults as a loaded one does."""
    declaration = _Declaration(kind, default, meaning, flag_aliases)
    return field(default=kind.parse(default), metadata={_DECLARED: declaration})


def _settings_class(cls: type) -> type:
    """``cls`` as a frozen dataclass whose defaults live in its __init__ and fields() only.

    Hazard: a dataclass default is also a class attribute, and from CPython 3.12 a read of an
    instance attribute that a class attribute shadows is not specialized; the proxy reads
    ``ctx.timeouts.client_headers`` and the like on every connection.
    """
    cls = dataclass(frozen=True)(cls)
    for f in fields(cls):
        if f.name in vars(cls):
            delattr(cls, f.name)
    return cls


def section(cls: type, intro: str) -> Any:
    """A [section] of Settings: its dataclass, and the sentence that opens it in the default file and the reference."""
    return field(default=cls(), metadata={_SECTION: intro})


@_settings_class
class Timeouts:
    connect: float = setting(seconds(), 5.0, "Connecting to the upstream.")
    upstream_headers: float = setting(
        seconds(zero="off"), 600.0,
        "From the client's last request byte (the end of its head, or the last body byte "
        "received) to the response headers, else 504 (UT; PWS if no connection was free under "
        "pool.max_connections). Long because a long prefill is normal.")
    upstream_read: float = setting(
        seconds(zero="off"), 600.0,
        "Longest silence between upstream response body bytes before the response is aborted.")
    client_headers: float = setting(seconds(), 30.0, "Receiving a complete request head, counted from its first byte.")
    client_body: float = setting(seconds(zero="off"), 60.0, "Longest silence between request body bytes, else 408.")
    client_send: float = setting(
        seconds(zero="off"), 60.0,
        "Longest time a client whose connection is full takes none of the response before the "
        "request is cut (DNR), freeing its upstream connection, as nginx's send_timeout.")
    client_keepalive: float = setting(seconds(), 75.0, "An idle client keep-alive connection is closed after this.")
    shutdown_grace: float = setting(
        seconds(zero="stopping at once"), 30.0,
        "On SIGTERM or SIGINT, in-flight streams get this long to finish, and slow clients to "
        "take what was written to them; what is left then is cut with a reset.")
    admin_worker_answer: float = setting(
        seconds(), 1.0,
        "With workers > 1: how long the admin side (/metrics, /debug/inflight, /healthz, the engine "
        "orphan check) waits for each worker's answer before it goes on without it (counted in "
        "traceproxy_worker_answers_late_total).")


@_settings_class
class Pool:
    idle_timeout: float = setting(
        seconds(), 4.0,
        "An idle upstream keep-alive connection is closed after this; kept below the 5 s idle "
        "timeout of uvicorn-based engines so a connection the engine is closing is not reused.")
    # 0: off
    keep_warm: float = setting(
        seconds(zero="off"), 60.0,
        "The pool keeps as many connections open as were in use at once during the last this many "
        "seconds, replacing each idle one with a fresh one before idle_timeout, so a burst after a "
        "pause finds them ready instead of opening them all at once. Also, as a keep-alive client "
        "connection sends its first request, one connection is opened ahead while fewer are open "
        "than such client connections, so clients that each sent a request, then burst within "
        "idle_timeout, find them ready too. Nothing is renewed while the "
        "upstream closes idle connections before idle_timeout (traceproxy_upstream_keepalive_misaligned "
        "is 1): their replacements would be closed the same way.")
    max_connections: int = setting(
        integer(0, zero="unlimited"), 1024,
        "Upstream connections open at once, per worker; further requests wait.")
    retry_buffer_bytes: int = setting(
        integer(0, zero="never retry"), 1048576,
        "Request bytes kept so a request that failed on a stale reused connection can be resent "
        "once on a fresh one; larger requests are not retried.")


@_settings_class
class Limits:
    max_client_connections: int = setting(
        integer(1), 10000,
        "Open client connections, per worker; at the cap the longest-idle keep-alive connection is closed "
        "to make room. Lowered at startup, with a warning, to what the open-file limit can hold.")
    max_header_bytes: int = setting(
        integer(1024), 65536,
        "A request head or trailer section larger than this gets 431; a response head or trailer "
        "section larger than this from the upstream is a 502. A trailer section counts its field "
        "lines, never chunk framing.")
    max_target_bytes: int = setting(integer(64), 8192, "A request target longer than this gets 414.")
    # abort | answer
    client_half_close: str = setting(
        choice("abort", "answer"), "abort",
        "A client that half-closes (a FIN: shutdown(SHUT_WR), nc -N, some health checkers) after sending "
        "a complete request, before its response is complete. abort: taken as leaving, as nginx and "
        "Envoy take it: the request ends DC (blame client) and its upstream connection is closed, so "
        "the engine stops work nobody will read. answer: the response is still sent, then the "
        "connection closed; a client that in fact left is found at the first write (a reset). A FIN "
        "before the request is complete is a disconnect (DC) either way.")


@_settings_class
class Forwarding:
    preserve_host: bool = setting(
        boolean(), True,
        "Forward the client's Host header; false sends the upstream's host:port instead.")
    x_forwarded: bool = setting(boolean(), True, "Append X-Forwarded-For, X-Forwarded-Proto and X-Forwarded-Host.")


@_settings_class
class RequestIds:
    # lower-case header names, first one used when generating
    headers: tuple[str, ...] = setting(
        header_names(), ["x-request-id"],
        "Headers that carry the client's request id (like the router's --request-id-headers); "
        "the first one is generated when none is present, and returned on every response. Not a header "
        "the proxy manages itself (framing, connection, forwarding, tracing).")
    inject_rid: bool = setting(
        boolean(), False,
        "For JSON bodies of SGLang /generate, set the body field rid to the request id when absent, "
        "so the engines' own logs carry it. Every router keeps rid on /generate (on chat only "
        "sglang-router 0.3.2 strips it); behind vllm-router, which sends the engines an "
        "x-request-id of its own, it is how the engines see the request id. See docs/routers.md.",
        flag_aliases=("--inject-rid",))


def _one_forwarded_header_name() -> Kind:
    """One HTTP header name the proxy forwards as it came, or empty for none. A field the
    proxy manages itself is refused: it is removed or replaced before the value is read,
    so the setting would never find anything there."""
    names = header_names()

    def parse(raw: Any) -> str:
        value = require_str(raw).strip()
        if not value:
            return ""
        parsed = names.parse(value)
        if len(parsed) != 1:
            raise ValueError
        # The one list of managed names is the header rules' own (pure, standard library
        # only); read here, when a name is given, as app.check_request_id_headers reads it.
        from ..proxy.headers import PROXY_MANAGED

        if parsed[0].encode("ascii") in PROXY_MANAGED:
            raise Rejected(f"{parsed[0]} is a header the proxy manages itself (framing, connection, "
                           "forwarding or tracing), never read as a conversation id")
        return parsed[0]

    return Kind(parse, "one header name, e.g. x-conversation-id, or empty for none", "NAME")


@_settings_class
class Tracing:
    # auto | otlp | file | console | off
    exporter: str = setting(
        choice("auto", "otlp", "file", "console", "off"), "auto",
        "Where spans go: auto = otlp when OTEL_EXPORTER_OTLP_ENDPOINT or otlp_endpoint is set, "
        "else the local file.")
    otlp_endpoint: str = setting(
        collector_endpoint(), "",
        "OTLP endpoint; empty = OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT.")
    # "" | grpc | http/protobuf
    otlp_protocol: str = setting(
        choice("", "grpc", "http/protobuf"), "",
        "OTLP protocol; empty = OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL, "
        "else http/protobuf.")
    file_path: str = setting(
        file_path(), "traceproxy-data/spans.jsonl",
        "The local span file (OTLP/JSON lines, as the OpenTelemetry Collector's file exporter "
        "writes and its file receiver reads).")
    service_name: str = setting(text(), "", "Resource service.name; empty = OTEL_SERVICE_NAME, else traceproxy.")
    # None: from OTEL_TRACES_SAMPLER, else 1.0
    healthy_sample_ratio: float | None = setting(
        ratio(empty="from OTEL_TRACES_SAMPLER, else 1"), "",
        "Fraction of healthy requests whose trace is kept; requests that errored or stalled are "
        "always kept. Decided when the request ends.")
    # 0: no ceiling
    healthy_max_per_second: int = setting(
        integer(0, zero="no ceiling"), 250,
        "At most this many healthy requests' traces kept per second (for the whole service, shared "
        "by its workers), in bursts of up to one second's worth; beyond it they are shed (counted). Bounds what tracing costs under a "
        "flood; far above LLM request rates, where every trace is kept. Errored and stalled "
        "requests are always kept.")
    queue_spans: int = setting(
        integer(64), 8192,
        "Spans waiting for the exporter process; beyond this new spans are dropped and counted. "
        "Past half of it the exporter is behind: healthy requests' spans are shed (counted), "
        "errored and stalled ones still queue.")
    exporter_nice: int = setting(
        integer(0, 19), 10,
        "Added to the exporter process's CPU niceness, so that on saturated cores proxying gets "
        "the CPU first and the span queue absorbs the lag (0 = same priority as the proxy).")
    genai_provider: str = setting(
        text(), "",
        "gen_ai.provider.name on the spans of model requests, e.g. sglang, vllm or openai; empty = from "
        "each response: sglang for /generate or SGLang's own fields (meta_info, matched_stop), vllm for "
        "vLLM's (stop_reason), else openai (the OpenAI-compatible API).")
    conversation_id_header: str = setting(
        _one_forwarded_header_name(), "",
        "A request header whose value is the request's conversation (session, thread) id, put on its "
        "span as gen_ai.conversation.id and shown as conversation_id in /debug/inflight and the access log; "
        "its first 256 characters are kept. A header the proxy forwards: one it manages itself (framing, "
        "connection, forwarding, tracing) is a configuration error. Empty = none.")


# The thresholds, one per stall kind, are StallThresholds' fields: these settings are seconds, 0 = off.
_STALL_THRESHOLD = seconds(zero="off")


@_settings_class
class Stall(StallThresholds):
    """A threshold per stall kind (inherited: the kinds are declared in lifecycle.stall), and what a stall does."""

    # observe | abort
    action: str = setting(
        choice("observe", "abort"), "observe",
        "observe: report stalls (log, metric, stall span) and let the request go on; abort: also end "
        "the request (504 with the outcome if no response started, else a cut stream).")
    # stall kinds that abort even when action = observe
    abort_on: tuple[str, ...] = setting(
        stall_kinds(), [],
        "Stall kinds that abort even when action is observe, e.g. [\"first_byte\", \"stream_gap\"].")


@_settings_class
class AccessLog:
    # "" off, "-" stdout, else a file
    path: str = setting(
        file_path(empty="off"), "-",
        "One JSON line per finished request: - for stdout, a file path, or empty to turn it off.")


@_settings_class
class Metrics:
    max_models: int = setting(
        integer(1, 10000), 32,
        "Distinct model names (the request body's model) that get a model label of their own in the "
        "per-model metrics, the first ones seen, per worker process; past them a request counts as "
        "model=\"other\", and one whose body names no model (or is not JSON) as model=\"unknown\".")


# The scraper's shortest interval. Each scrape fetches and parses every URL's whole answer
# (up to 4 MiB each) and hands the readings to every worker: twenty a second already reads
# the engines' gauges far more often than they move (Prometheus scrapes every few seconds),
# and much faster the scraper would take a core for itself.
SCRAPE_INTERVAL_FLOOR = 0.05


@_settings_class
class Engines:
    # empty: the scraper does not start
    metrics_urls: tuple[str, ...] = setting(
        http_urls(), [],
        "Prometheus /metrics URLs of the router and the prefill and decode workers, whatever their role; "
        "when these and the role-labelled keys below are empty nothing is scraped and nothing is correlated.")
    scrape_interval: float = setting(
        seconds(minimum=SCRAPE_INTERVAL_FLOOR),
        5.0,
        "Seconds between scrapes of every metrics URL. Each scrape fetches and parses every URL's whole "
        "answer, hence a floor above the other durations' (Prometheus itself scrapes every few seconds).")
    scrape_timeout: float = setting(
        seconds(), 2.0,
        "A scrape that takes longer fails (counted and shown); so does an answer over 4 MiB or "
        "without Prometheus samples. Proxying never waits for it.")
    orphan_after: float = setting(
        seconds(), 30.0,
        "Engine work that no proxied request explains for this long is reported as an orphan (EOR).")
    probe_on_stall: bool = setting(
        boolean(), False,
        "When a request stalls waiting on the upstream (FBS, MSS, UCS), send GET probe_path on a fresh "
        "connection to the same upstream (never from the pool, at most one at a time) and record whether "
        "it answered: a connection-state fault (fresh works) or an unresponsive engine (fresh hangs too).")
    probe_path: str = setting(url_path(), "/health", "The path the stall probe requests.")
    probe_timeout: float = setting(
        seconds(), 2.0,
        "A stall probe that has no response status line within this long counts as hanging.")
    router_metrics_urls: tuple[str, ...] = setting(
        http_urls(), [],
        "Like metrics_urls, for the router: scraped with them, and read as the router's, so that without "
        "engine spans a waiting request the workers hold nothing of is placed in the router.")
    prefill_metrics_urls: tuple[str, ...] = setting(
        http_urls(), [],
        "Like metrics_urls, for the prefill workers: their gauges say, without engine spans, which PD "
        "component holds a waiting request (bootstrap, prefill, kv_transfer).")
    decode_metrics_urls: tuple[str, ...] = setting(
        http_urls(), [],
        "Like metrics_urls, for the decode workers (bootstrap, kv_transfer, decode).")
    # None: off
    otlp_receiver: HostPort | None = setting(
        address(off=True), "off",
        "Address of an OTLP/HTTP receiver (POST /v1/traces, protobuf) for the engines' own spans (SGLang "
        "--enable-trace --otlp-traces-endpoint http://HOST:PORT/v1/traces with "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf: SGLang posts to that URL as given, so without "
        "/v1/traces it posts to /, which is taken too). Every request is relayed unchanged to traceproxy's span destination; the stage "
        "spans say which PD stage and worker hold each request in flight. off disables it.")
    otlp_receiver_grpc: HostPort | None = setting(
        address(off=True), "off",
        "Address of an OTLP/gRPC receiver for the engines' spans (SGLang's default protocol: "
        "--otlp-traces-endpoint HOST:PORT), as otlp_receiver; off disables it.")
    otlp_receiver_public: bool = setting(
        boolean(), False, "Allow the OTLP receivers on a non-loopback address.")
    otlp_receiver_relay: bool = setting(
        boolean(), True,
        "Relay every request the receivers take to traceproxy's span destination (the collector, or the "
        "span file). false when the engines' spans reach that destination another way: a collector that "
        "fans them out to traceproxy and to the backend would get them back, and send them round again.")
    span_traces: int = setting(
        integer(16), 10000,
        "Traces whose engine spans are kept for the join, at most. A trace the engines finished is "
        "dropped 30 s after its last span; past the bound, the one the engines finished longest ago goes "
        "first, and only when every kept trace still has work at the engines the one updated longest ago "
        "(its spans counted as dropped for lack of room).")
    span_settle: float = setting(
        seconds(), 2.0,
        "A request sent upstream this long ago with no response yet, of which no engine has exported a "
        "span (while engines do export to the receiver), is placed in the router. Above SGLang's export "
        "delay (SGLANG_OTLP_EXPORTER_SCHEDULE_DELAY_MILLIS, 500 ms by default).")


@_settings_class
class Settings:
    listen: HostPort = setting(
        address(), "127.0.0.1:8000",
        "Address the proxy listens on for clients. Port 0 takes any free port (the "
        "startup log names it; only with workers = 1).")
    upstream: UpstreamURL = setting(
        http_url(), "http://127.0.0.1:30000",
        "Base URL of the router or engine that requests are forwarded to.")
    # None: admin listener disabled
    admin: HostPort | None = setting(
        address(off=True), "127.0.0.1:9464",
        "Address of the read-only admin listener; off disables it. Port 0 as for listen.")
    admin_public: bool = setting(boolean(), False, "Allow the admin listener on a non-loopback address.")
    workers: int = setting(integer(1, MAX_WORKERS), 1, "Number of processes sharing the listen port (SO_REUSEPORT).")
    log_level: str = setting(
        choice("debug", "info", "warning", "error"), "info",
        "Level of the proxy's own log messages (stderr).")
    timeouts: Timeouts = section(Timeouts, "Timeouts, in seconds.")
    pool: Pool = section(Pool, "Upstream connection pool.")
    limits: Limits = section(Limits, "Limits on clients and requests.")
    forwarding: Forwarding = section(Forwarding, "Headers sent to the upstream.")
    request_id: RequestIds = section(RequestIds, "Request ids.")
    tracing: Tracing = section(Tracing, "OpenTelemetry tracing. The standard OTEL_* environment variables apply "
                                        "where a key is left empty.")
    stall: Stall = section(Stall, "Stall detection: how long a wait may last before the watchdog reports it, in "
                                  "seconds (0 = off). Stalls are verdicts on live requests; the hard limits are "
                                  "under [timeouts].")
    access_log: AccessLog = section(AccessLog, "The access log.")
    metrics: Metrics = section(Metrics, "The Prometheus metrics on the admin listener's /metrics.")
    engines: Engines = section(Engines, "Correlation with the engines: their /metrics gauges, scraped in the "
                                        "background, and their own spans, received and relayed.")
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
            if dotted not in BY_DOTTED:
                raise unknown("key", dotted, BY_DOTTED, source)
            raw[dotted] = (_as_raw(value), source)
        return build(raw)


# --- the schema, derived from the fields above ---


@dataclass(frozen=True)
class Setting:
    section: str  # "" for a top-level key
    key: str
    kind: Kind
    default: Any  # in TOML form; parsed like any other source
    meaning: str
    # Short names that operators and docs use, beside the derived flag. (request_id.headers
    # needs none: its derived flag is already the router's --request-id-headers.)
    flag_aliases: tuple[str, ...] = ()

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


def _declaration(cls: type, f: Field) -> _Declaration:
    if _DECLARED in f.metadata:
        return f.metadata[_DECLARED]
    if STALL_MEANING in f.metadata:  # a [stall] threshold, declared with its kind in lifecycle.stall
        return _Declaration(_STALL_THRESHOLD, f.default, f.metadata[STALL_MEANING])
    raise TypeError(f"{cls.__name__}.{f.name} is not declared with setting()")


# section -> (its dataclass, the sentence that opens it), in Settings' order
SECTIONS: dict[str, tuple[type, str]] = {
    f.name: (type(f.default), f.metadata[_SECTION]) for f in fields(Settings) if _SECTION in f.metadata
}
# Top-level keys first: below a [section] header a TOML key belongs to that section.
SCHEMA: tuple[Setting, ...] = (
    *(Setting("", f.name, *f.metadata[_DECLARED]) for f in fields(Settings) if _DECLARED in f.metadata),
    *(Setting(name, f.name, *_declaration(cls, f)) for name, (cls, _) in SECTIONS.items() for f in fields(cls)),
)
BY_DOTTED = {s.dotted: s for s in SCHEMA}
BY_ENV = {s.env: s for s in SCHEMA}
_TOP_LEVEL = {s.key for s in SCHEMA if not s.section}

Raw = dict[str, tuple[Any, str]]  # dotted key -> (raw value, where it came from)


# --- building Settings ---


def _as_raw(value: Any) -> Any:
    return str(value) if isinstance(value, (HostPort, UpstreamURL)) else value


def parse(s: Setting, raw: Any, source: str) -> Any:
    try:
        return s.kind.parse(raw.strip() if isinstance(raw, str) else raw)
    except ValueError as e:
        raise ConfigError(f"{s.dotted} = {raw!r} (from {source}): {refusal(e, s.kind.expected)}") from None


def build(raw: Raw) -> Settings:
    values = {s.dotted: parse(s, *raw[s.dotted]) for s in SCHEMA}
    check_between_keys(values, raw)
    sections = {
        name: cls(**{s.key: values[s.dotted] for s in SCHEMA if s.section == name})
        for name, (cls, _) in SECTIONS.items()
    }
    return Settings(**{key: values[key] for key in _TOP_LEVEL}, **sections,
                    sources={dotted: source for dotted, (_, source) in raw.items()})


def defaults() -> Raw:
    return {s.dotted: (s.default, "default") for s in SCHEMA}


def default_settings() -> Settings:
    return build(defaults())
