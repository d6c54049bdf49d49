import argparse
import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from traceproxy.config import (
    SCHEMA,
    ConfigError,
    Engines,
    Forwarding,
    HostPort,
    Limits,
    AccessLog,
    Pool,
    RequestIds,
    Stall,
    Settings,
    Timeouts,
    Tracing,
    UpstreamURL,
    add_flags,
    default_settings,
    load_settings,
    render_default_toml,
    unknown_environment,
)

SHIPPED_CONFIG = Path(__file__).resolve().parent.parent / "config" / "traceproxy.toml"

EXPECTED_DEFAULTS = Settings(
    listen=HostPort("127.0.0.1", 8000),
    upstream=UpstreamURL("127.0.0.1", 30000),
    admin=HostPort("127.0.0.1", 9464),
    admin_public=False,
    workers=1,
    log_level="info",
    timeouts=Timeouts(
        connect=5.0,
        upstream_headers=600.0,
        upstream_read=600.0,
        client_headers=30.0,
        client_body=60.0,
        client_send=60.0,
        client_keepalive=75.0,
        shutdown_grace=30.0,
    ),
    pool=Pool(idle_timeout=4.0, keep_warm=60.0, max_connections=1024, retry_buffer_bytes=1048576),
    limits=Limits(max_client_connections=10000, max_header_bytes=65536, max_target_bytes=8192),
    forwarding=Forwarding(preserve_host=True, x_forwarded=True),
    request_id=RequestIds(headers=("x-request-id",), inject_rid=False),
    tracing=Tracing(exporter="auto", otlp_endpoint="", otlp_protocol="", file_path="traceproxy-data/spans.jsonl",
                    service_name="", healthy_sample_ratio=None, healthy_max_per_second=250,
                    queue_spans=8192, exporter_nice=10),
    stall=Stall(client_headers=10.0, client_body=30.0, pool_wait=5.0, first_byte=120.0, stream_gap=30.0,
                client_drain=30.0, action="observe", abort_on=()),
    access_log=AccessLog(path="-"),
)


def parse_flags(argv):
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return parser.parse_args(argv)


def load(tmp_path, argv=(), env=None, toml=None):
    """Loads settings from flags `argv`, environment `env` and, if given, a config file with text `toml`."""
    env = dict(env or {})
    if toml is not None:
        path = tmp_path / "traceproxy.toml"
        path.write_text(toml)
        env.setdefault("TRACEPROXY_CONFIG", str(path))
    return load_settings(parse_flags(list(argv)), environ=env)


# --- defaults ---


def test_default_settings_match_the_documented_defaults():
    assert default_settings() == EXPECTED_DEFAULTS


def test_no_sources_give_the_defaults():
    assert load_settings(environ={}) == EXPECTED_DEFAULTS
    assert load_settings(parse_flags([]), environ={}) == EXPECTED_DEFAULTS


def test_config_file_is_not_read_implicitly(tmp_path, monkeypatch):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "traceproxy.toml").write_text("workers = 8\n")
    (tmp_path / "traceproxy.toml").write_text("workers = 8\n")
    monkeypatch.chdir(tmp_path)
    assert load_settings(environ={}).workers == 1


def test_environ_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("TRACEPROXY_WORKERS", "6")
    assert load_settings().workers == 6


# --- precedence: flags > env > file > defaults ---

FILE = "workers = 2\n[timeouts]\nconnect = 2.0\n"
ENV = {"TRACEPROXY_WORKERS": "3", "TRACEPROXY_TIMEOUTS_CONNECT": "3"}
FLAGS = ["--workers", "4", "--timeouts-connect", "4"]


@pytest.mark.parametrize(
    "use_file, use_env, use_flags, winner",
    [
        (False, False, False, 1),
        (True, False, False, 2),
        (False, True, False, 3),
        (False, False, True, 4),
        (True, True, False, 3),
        (True, False, True, 4),
        (False, True, True, 4),
        (True, True, True, 4),
    ],
    ids=[
        "defaults", "file", "env", "flag", "env-beats-file", "flag-beats-file", "flag-beats-env",
        "flag-beats-env-and-file",
    ],
)
def test_precedence(tmp_path, use_file, use_env, use_flags, winner):
    settings = load(
        tmp_path, argv=FLAGS if use_flags else [], env=ENV if use_env else {}, toml=FILE if use_file else None
    )
    assert settings.workers == winner
    assert settings.timeouts.connect == (5.0 if winner == 1 else float(winner))


def test_config_flag_beats_config_env(tmp_path):
    flag_file, env_file = tmp_path / "flag.toml", tmp_path / "env.toml"
    flag_file.write_text("workers = 2\n")
    env_file.write_text("workers = 3\n")
    flags = parse_flags(["--config", str(flag_file)])
    settings = load_settings(flags, environ={"TRACEPROXY_CONFIG": str(env_file)})
    assert settings.workers == 2


def test_flags_as_dict_of_dotted_keys(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text("[pool]\nmax_connections = 7\n")
    flags = {"config": str(path), "timeouts.connect": "2.5", "workers": 3, "admin": None}
    settings = load_settings(flags, environ={})
    assert (settings.timeouts.connect, settings.workers, settings.pool.max_connections) == (2.5, 3, 7)
    assert settings.admin == EXPECTED_DEFAULTS.admin  # None means "not given"


def test_other_environment_variables_are_ignored():
    environ = {"PATH": "/bin", "TRACEPROXYX": "1", "traceproxy_workers": "9"}
    assert load_settings(environ=environ) == EXPECTED_DEFAULTS


# --- value forms ---


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--listen", "[::1]:8000"], HostPort("::1", 8000)),
        (["--listen", "[2001:db8::1]:443"], HostPort("2001:db8::1", 443)),
        (["--listen", "0.0.0.0:80"], HostPort("0.0.0.0", 80)),
        (["--listen", "localhost:0"], HostPort("localhost", 0)),
        (["--listen", " proxy.example:8000 "], HostPort("proxy.example", 8000)),
        # Docker Compose service names resolve, though RFC 1123 has no underscore.
        (["--listen", "traceproxy_1:8000"], HostPort("traceproxy_1", 8000)),
        (["--listen", "proxy.example.:8000"], HostPort("proxy.example.", 8000)),
    ],
    ids=["ipv6-loopback", "ipv6-global", "ipv4-any", "port-0-picks-free-port", "hostname-with-spaces",
         "underscore-in-name", "fully-qualified-name"],
)
def test_listen_address_forms(tmp_path, argv, expected):
    assert load(tmp_path, argv=argv).listen == expected


def test_host_port_str_brackets_ipv6():
    assert str(HostPort("::1", 8000)) == "[::1]:8000"
    assert str(HostPort("127.0.0.1", 8000)) == "127.0.0.1:8000"


@pytest.mark.parametrize(
    "url, host, port, authority, text",
    [
        ("http://127.0.0.1:30000", "127.0.0.1", 30000, "127.0.0.1:30000", "http://127.0.0.1:30000"),
        ("http://router/", "router", 80, "router:80", "http://router:80"),
        ("HTTP://engine:8080/", "engine", 8080, "engine:8080", "http://engine:8080"),
        ("http://[::1]:30000/", "::1", 30000, "[::1]:30000", "http://[::1]:30000"),
        ("http://[fd00::2]", "fd00::2", 80, "[fd00::2]:80", "http://[fd00::2]:80"),
        ("http://sglang_router:30000", "sglang_router", 30000, "sglang_router:30000", "http://sglang_router:30000"),
    ],
    ids=["ipv4", "default-port-and-slash", "uppercase-scheme", "ipv6", "ipv6-default-port", "compose-service-name"],
)
def test_upstream_url_forms(tmp_path, url, host, port, authority, text):
    upstream = load(tmp_path, env={"TRACEPROXY_UPSTREAM": url}).upstream
    assert upstream == UpstreamURL(host, port)
    assert upstream.authority == authority
    assert str(upstream) == text


@pytest.mark.parametrize(
    "word, expected",
    [("true", True), ("false", False), ("1", True), ("0", False), ("yes", True), ("no", False),
     ("on", True), ("off", False), ("TRUE", True), ("Off", False)],
)
def test_boolean_words_from_env(word, expected):
    environ = {"TRACEPROXY_FORWARDING_PRESERVE_HOST": word, "TRACEPROXY_FORWARDING_X_FORWARDED": word}
    forwarding = load_settings(environ=environ).forwarding
    assert forwarding == Forwarding(preserve_host=expected, x_forwarded=expected)


def test_toml_integers_1_and_0_are_booleans_as_the_words_1_and_0_are(tmp_path):
    settings = load(tmp_path, toml="admin_public = 1\n[forwarding]\npreserve_host = 0\nx_forwarded = 1\n")
    assert (settings.admin_public, settings.forwarding.preserve_host, settings.forwarding.x_forwarded) == (
        True, False, True)
    assert settings.admin_public is True and settings.forwarding.preserve_host is False


SECONDS_KEYS = [s.dotted for s in SCHEMA if s.kind.metavar == "SECONDS"]


@pytest.mark.parametrize("dotted", SECONDS_KEYS)
def test_every_duration_refuses_a_value_under_a_millisecond_naming_the_key(dotted):
    with pytest.raises(ConfigError) as error:
        load_settings({dotted: "1e-300"}, environ={})
    setting = next(s for s in SCHEMA if s.dotted == dotted)
    # The value as given, then the exact floor: a reason ("1e-300 s is under 0.001 s") would repeat both.
    assert str(error.value) == f"{dotted} = '1e-300' (from flag {setting.flag}): expected {setting.kind.expected}"


@pytest.mark.parametrize("value", ["0.0009999999999", "0.0005"])
def test_a_duration_just_under_its_floor_is_shown_as_given_beside_the_exact_floor(value):
    # Said as "N s is under 0.001 s", a value rounded by %g read "0.001 s is under 0.001 s".
    with pytest.raises(ConfigError) as error:
        load_settings({"timeouts.client_body": value}, environ={})
    assert str(error.value) == (f"timeouts.client_body = {value!r} (from flag --timeouts-client-body): expected a "
                                "number of seconds, at least 0.001 s, or 0 for off, at most 31536000 (a year)")


def test_a_duration_argument_of_another_command_has_the_same_floor():
    from traceproxy.config import seconds_argument

    never = seconds_argument(zero="never")
    assert (never("0"), never("0.001")) == (0.0, 0.001)
    with pytest.raises(argparse.ArgumentTypeError) as error:
        never("1e-300")
    assert str(error.value) == ("expected a number of seconds, at least 0.001 s, or 0 for never, "
                                "at most 31536000 (a year), got '1e-300'")


def test_native_toml_values(tmp_path):
    toml = "workers = 4\nadmin_public = true\n[timeouts]\nconnect = 2\n[forwarding]\npreserve_host = false\n"
    settings = load(tmp_path, toml=toml)
    assert settings.timeouts.connect == 2.0 and isinstance(settings.timeouts.connect, float)
    assert (settings.workers, settings.admin_public, settings.forwarding.preserve_host) == (4, True, False)


BOUNDARY_VALUES = [
    ("timeouts.upstream_headers", "0", 0.0),
    ("timeouts.upstream_read", "0", 0.0),
    ("timeouts.client_body", "0", 0.0),
    ("timeouts.shutdown_grace", "0", 0.0),
    ("pool.max_connections", "0", 0),
    ("pool.retry_buffer_bytes", "0", 0),
    ("timeouts.connect", "0.25", 0.25),
    ("workers", "64", 64),
    ("limits.max_header_bytes", "1024", 1024),
    ("limits.max_target_bytes", "64", 64),
    ("timeouts.client_keepalive", "31536000", 31536000.0),  # a year: the longest duration
    ("tracing.otlp_endpoint", "http://collector:4318/v1/traces", "http://collector:4318/v1/traces"),
    ("tracing.otlp_endpoint", "collector:4317", "collector:4317"),
    ("tracing.otlp_endpoint", "unix:///run/otel.sock", "unix:///run/otel.sock"),
    ("timeouts.connect", "0.001", 0.001),  # the shortest duration
    ("stall.first_byte", "0.001", 0.001),
    ("stall.first_byte", "0", 0.0),  # off
    ("engines.scrape_interval", "0.05", 0.05),  # the scraper's floor
    ("access_log.path", "", ""),  # off
]


@pytest.mark.parametrize(
    "dotted, text, expected", BOUNDARY_VALUES, ids=[f"{d}={t}" for d, t, _ in BOUNDARY_VALUES]
)
def test_boundary_values_accepted(dotted, text, expected):
    settings = load_settings({dotted: text}, environ={})
    section, _, key = dotted.rpartition(".")
    value = getattr(getattr(settings, section) if section else settings, key)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    "source", [{"toml": 'admin = "off"\n'}, {"env": {"TRACEPROXY_ADMIN": "OFF"}}, {"argv": ["--admin", "off"]}],
    ids=["file", "env", "flag"],
)
def test_admin_off_disables_admin(tmp_path, source):
    assert load(tmp_path, **source).admin is None


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--admin", "localhost:9464"], HostPort("localhost", 9464)),
        (["--admin", "[::1]:9464"], HostPort("::1", 9464)),
        (["--admin", "127.0.0.2:9464"], HostPort("127.0.0.2", 9464)),
        (["--admin", "0.0.0.0:9464", "--admin-public", "true"], HostPort("0.0.0.0", 9464)),
    ],
    ids=["localhost", "ipv6-loopback", "loopback-net", "public-when-allowed"],
)
def test_admin_addresses_accepted(tmp_path, argv, expected):
    assert load(tmp_path, argv=argv).admin == expected


# --- errors: each names the dotted key, the source, the bad value and the expected form ---

ERROR_CASES = [
    ("bad-float", {"env": {"TRACEPROXY_TIMEOUTS_CONNECT": "abc"}},
     ["timeouts.connect", "env TRACEPROXY_TIMEOUTS_CONNECT", "'abc'", "a number of seconds, at least 0.001 s,"]),
    ("infinite-float", {"argv": ["--timeouts-upstream-read", "inf"]},
     ["timeouts.upstream_read", "flag --timeouts-upstream-read", "'inf'", "at least 0.001 s, or 0 for off"]),
    ("negative-timeout", {"argv": ["--timeouts-client-body", "-1"]},
     ["timeouts.client_body", "flag --timeouts-client-body", "'-1'", "at least 0.001 s, or 0 for off"]),
    ("zero-connect-timeout", {"toml": "[timeouts]\nconnect = 0\n"},
     ["timeouts.connect", "file {path}", "= 0 ", "seconds, at least 0.001 s, at most"]),
    ("zero-keepalive", {"env": {"TRACEPROXY_TIMEOUTS_CLIENT_KEEPALIVE": "0"}},
     ["timeouts.client_keepalive", "env TRACEPROXY_TIMEOUTS_CLIENT_KEEPALIVE", "seconds, at least 0.001 s, at most"]),
    ("zero-pool-idle", {"toml": "[pool]\nidle_timeout = 0.0\n"}, ["pool.idle_timeout", "at least 0.001 s, at most"]),
    # Finite, but past what nanosecond deadlines and timers hold: refused, not a crash later.
    ("huge-seconds", {"argv": ["--pool-idle-timeout", "1e300"]},
     ["pool.idle_timeout", "flag --pool-idle-timeout", "'1e300'", "at most 31536000 (a year)"]),
    ("just-past-a-year", {"env": {"TRACEPROXY_STALL_FIRST_BYTE": "31536001"}},
     ["stall.first_byte", "env TRACEPROXY_STALL_FIRST_BYTE", "at most 31536000"]),
    # A bad value is an error where it is, even when a higher source overrides it.
    ("collector-endpoint-not-a-url", {"argv": ["--tracing-otlp-endpoint", "not a url"]},
     ["tracing.otlp_endpoint", "flag --tracing-otlp-endpoint", "'not a url'", "an http(s):// URL"]),
    ("collector-endpoint-empty-grpc-target", {"argv": ["--tracing-otlp-endpoint", "unix:"]},
     ["tracing.otlp_endpoint", "a gRPC target such as unix:///run/otel.sock"]),
    ("collector-endpoint-bad-port", {"env": {"TRACEPROXY_TRACING_OTLP_ENDPOINT": "http://collector:99999"}},
     ["tracing.otlp_endpoint", "env TRACEPROXY_TRACING_OTLP_ENDPOINT", "an http(s):// URL"]),
    ("bad-file-value-under-a-flag", {"toml": '[timeouts]\nconnect = "abc"\n', "argv": ["--timeouts-connect", "1"]},
     ["timeouts.connect", "file {path}", "'abc'", "a number of seconds, at least 0.001 s"]),
    ("bad-env-value-under-a-flag", {"env": {"TRACEPROXY_TIMEOUTS_CONNECT": "bogus"}, "argv": ["--timeouts-connect", "1"]},
     ["timeouts.connect", "env TRACEPROXY_TIMEOUTS_CONNECT", "'bogus'"]),
    ("host-port-missing-port", {"argv": ["--listen", "localhost"]},
     ["listen", "flag --listen", "'localhost'", "missing port", "HOST:PORT"]),
    ("host-port-bad-port", {"argv": ["--listen", "127.0.0.1:http"]}, ["listen", "'127.0.0.1:http'", "HOST:PORT"]),
    ("host-port-out-of-range", {"argv": ["--listen", "127.0.0.1:70000"]}, ["listen", "out of range", "HOST:PORT"]),
    ("host-port-empty-host", {"argv": ["--listen", ":8000"]}, ["listen", "HOST:PORT"]),
    ("host-port-bad-hostname", {"argv": ["--listen", "bad_host!:8000"]},
     ["listen", "'bad_host!:8000'", "HOST:PORT"]),
    # The resolver would refuse these only at startup, as an encoding error.
    ("host-port-empty-label", {"argv": ["--listen", "127.0.0..1:8000"]}, ["listen", "'127.0.0..1:8000'", "HOST:PORT"]),
    ("host-port-label-over-63", {"env": {"TRACEPROXY_LISTEN": "a" * 64 + ".internal:8000"}},
     ["listen", "env TRACEPROXY_LISTEN", "HOST:PORT"]),
    ("upstream-empty-label", {"argv": ["--upstream", "http://router..internal:30000"]},
     ["upstream", "flag --upstream", "http://HOST[:PORT]"]),
    ("access-log-path-with-nul", {"toml": '[access_log]\npath = "/tmp/a\\u0000b.log"\n'},
     ["access_log.path", "{path}", "expected a file path"]),
    ("span-file-path-with-nul", {"env": {"TRACEPROXY_TRACING_FILE_PATH": "spans\x00.jsonl"}},
     ["tracing.file_path", "env TRACEPROXY_TRACING_FILE_PATH", "expected a file path"]),
    ("ipv6-without-brackets", {"argv": ["--listen", "::1:8000"]}, ["listen", "brackets", "[::1]:8000"]),
    ("ipv6-bad-address", {"argv": ["--listen", "[::zz]:8000"]}, ["listen", "'[::zz]:8000'", "HOST:PORT"]),
    ("https-upstream", {"env": {"TRACEPROXY_UPSTREAM": "https://router:443"}},
     ["upstream", "env TRACEPROXY_UPSTREAM", "TLS upstreams are not supported", "http://HOST[:PORT]"]),
    ("upstream-with-path", {"toml": 'upstream = "http://router:8000/v1"\n'},
     ["upstream", "file {path}", "only a host and port", "no path other than /"]),
    ("upstream-without-scheme", {"argv": ["--upstream", "router:8000"]},
     ["upstream", "flag --upstream", "'router:8000'", "http://HOST[:PORT]"]),
    ("upstream-port-0", {"argv": ["--upstream", "http://router:0"]}, ["upstream", "out of range 1..65535"]),
    ("unknown-toml-key", {"toml": "[timeouts]\nconect = 1\n"},
     ["unknown key timeouts.conect", "{path}", "did you mean timeouts.connect"]),
    ("unknown-toml-section", {"toml": "[timeout]\nconnect = 1\n"},
     ["unknown section [timeout]", "{path}", "did you mean [timeouts]?"]),
    # TOML puts a key written below a [section] header into that section.
    ("top-level-key-below-a-section", {"toml": '[pool]\nlisten = "127.0.0.1:8000"\n'},
     ["unknown key pool.listen", "{path}", "listen is a top-level key", "before the first [section]"]),
    ("unknown-top-level-key", {"toml": "worker = 2\n"}, ["unknown key worker ", "did you mean workers"]),
    ("section-given-as-value", {"toml": "timeouts = 5\n"}, ["timeouts", "{path}", "[timeouts] table"]),
    ("admin-public-without-permission", {"argv": ["--admin", "0.0.0.0:9464"]},
     ["admin", "flag --admin", "'0.0.0.0:9464'", "not a loopback address", "admin_public = true"]),
    ("admin-hostname-without-permission", {"env": {"TRACEPROXY_ADMIN": "metrics.internal:9464"}},
     ["admin", "env TRACEPROXY_ADMIN", "not a loopback address"]),
    ("workers-zero", {"argv": ["--workers", "0"]},
     ["workers", "flag --workers", "'0'", "an integer from 1 to 64"]),
    ("workers-with-any-listen-port", {"argv": ["--workers", "2", "--listen", "127.0.0.1:0"]},
     ["listen = '127.0.0.1:0'", "flag --listen", "2 workers (from flag --workers)", "a fixed port"]),
    ("workers-with-any-admin-port", {"env": {"TRACEPROXY_WORKERS": "2", "TRACEPROXY_ADMIN": "127.0.0.1:0"}},
     ["admin = '127.0.0.1:0'", "env TRACEPROXY_ADMIN", "a fixed port"]),
    ("workers-too-many", {"env": {"TRACEPROXY_WORKERS": "65"}}, ["workers", "'65'", "an integer from 1 to 64"]),
    ("workers-float", {"toml": "workers = 2.0\n"}, ["workers", "2.0", "an integer from 1 to 64"]),
    ("bool-where-int", {"toml": "workers = true\n"}, ["workers = True", "an integer from 1 to 64"]),
    ("bool-where-float", {"toml": "[timeouts]\nconnect = true\n"}, ["timeouts.connect = True", "at least 0.001 s"]),
    ("bad-bool", {"env": {"TRACEPROXY_FORWARDING_X_FORWARDED": "maybe"}},
     ["forwarding.x_forwarded", "'maybe'", "true or false"]),
    ("int-where-bool", {"toml": "[forwarding]\npreserve_host = 2\n"},
     ["forwarding.preserve_host = 2", "true or false (also 1/0"]),
    ("float-where-bool", {"toml": "[forwarding]\npreserve_host = 1.0\n"}, ["forwarding.preserve_host = 1.0"]),
    ("header-limit-too-small", {"argv": ["--limits-max-header-bytes", "512"]},
     ["limits.max_header_bytes", "flag --limits-max-header-bytes", "an integer >= 1024"]),
    ("negative-pool-size", {"argv": ["--pool-max-connections", "-1"]},
     ["pool.max_connections", "an integer >= 0 (0 = unlimited)"]),
    ("invalid-toml", {"toml": "[timeouts]\nconnect = \n"}, ["{path}", "not valid TOML", "line 2"]),
    ("probe-path-without-slash", {"argv": ["--engines-probe-path", "health"]},
     ["engines.probe_path", "'health' is not a path starting with /", "a URL path starting with /"]),
    ("probe-path-not-ascii", {"argv": ["--engines-probe-path", "/h\u20acalth"]},
     ["engines.probe_path", "in printable ASCII (percent-encode the rest)"]),
    ("probe-path-control-char", {"argv": ["--engines-probe-path", "/health\x00"]},
     ["engines.probe_path", "in printable ASCII"]),
    # Under a millisecond a timeout fires before any answer can come: a unit slip, not a setting.
    ("connect-timeout-under-a-millisecond", {"argv": ["--timeouts-connect", "1e-300"]},
     ["timeouts.connect", "flag --timeouts-connect", "'1e-300'", "): expected a number of seconds, at least 0.001 s, "
      "at most"]),
    ("off-able-timeout-under-a-millisecond", {"env": {"TRACEPROXY_TIMEOUTS_CLIENT_BODY": "0.0005"}},
     ["timeouts.client_body", "env TRACEPROXY_TIMEOUTS_CLIENT_BODY", "at least 0.001 s, or 0 for off"]),
    ("stall-threshold-under-a-millisecond", {"toml": "[stall]\nfirst_byte = 1e-9\n"},
     ["stall.first_byte", "file {path}", "at least 0.001 s, or 0 for off"]),
    ("shutdown-grace-under-a-millisecond", {"argv": ["--timeouts-shutdown-grace", "0.0001"]},
     ["timeouts.shutdown_grace", "or 0 for stopping at once"]),
    # Each scrape fetches and parses every URL's answer: a tiny interval is a busy loop.
    ("scrape-interval-under-its-floor", {"argv": ["--engines-scrape-interval", "1e-300"]},
     ["engines.scrape_interval", "flag --engines-scrape-interval", "): expected a number of seconds, at least 0.05 s"]),
    ("scrape-interval-just-under-its-floor", {"env": {"TRACEPROXY_ENGINES_SCRAPE_INTERVAL": "0.04"}},
     ["engines.scrape_interval", "env TRACEPROXY_ENGINES_SCRAPE_INTERVAL", "at least 0.05 s"]),
    # An empty path would be ".", the working folder: refused as empty, not as a folder.
    ("span-file-path-empty", {"argv": ["--tracing-file-path", ""]},
     ["tracing.file_path = ''", "flag --tracing-file-path", "the path is empty", "expected a file path"]),
    ("span-file-path-blank", {"toml": '[tracing]\nfile_path = "  "\n'},
     ["tracing.file_path", "file {path}", "the path is empty"]),
]


@pytest.mark.parametrize("source, fragments", [case[1:] for case in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_config_errors(tmp_path, source, fragments):
    with pytest.raises(ConfigError) as error:
        load(tmp_path, **source)
    message = str(error.value)
    for fragment in fragments:
        assert fragment.format(path=tmp_path / "traceproxy.toml") in message


@pytest.mark.parametrize(
    "flags, env, source",
    [
        (["--config", "{path}"], {}, "flag --config"),
        ([], {"TRACEPROXY_CONFIG": "{path}"}, "env TRACEPROXY_CONFIG"),
    ],
    ids=["flag", "env"],
)
def test_missing_config_file_names_the_path(tmp_path, flags, env, source):
    path = str(tmp_path / "absent.toml")
    argv = [arg.format(path=path) for arg in flags]
    environ = {name: value.format(path=path) for name, value in env.items()}
    with pytest.raises(ConfigError, match=re.escape(path)) as error:
        load_settings(parse_flags(argv), environ=environ)
    assert "does not exist" in str(error.value) and source in str(error.value)


def test_unknown_dict_flag_is_an_error():
    with pytest.raises(ConfigError, match="unknown key timeouts.conect"):
        load_settings({"timeouts.conect": "1"}, environ={})


# --- replace() ---


def test_replace_changes_only_the_named_keys():
    base = default_settings()
    changed = base.replace(**{"timeouts.connect": 1.0, "workers": "3", "admin": None})
    assert changed.timeouts.connect == 1.0 and changed.workers == 3 and changed.admin is None
    assert changed == dataclasses.replace(
        base, workers=3, admin=None, timeouts=dataclasses.replace(base.timeouts, connect=1.0)
    )
    assert base == EXPECTED_DEFAULTS


def test_replace_accepts_typed_addresses():
    settings = default_settings().replace(listen=HostPort("::1", 0), upstream=UpstreamURL("engine", 8080))
    assert (settings.listen, settings.upstream) == (HostPort("::1", 0), UpstreamURL("engine", 8080))


@pytest.mark.parametrize(
    "start, overrides, fragments",
    [
        ({}, {"workers": 0}, ["workers", "replace()", "from 1 to 64"]),
        ({}, {"timeouts.connect": -1.0}, ["timeouts.connect", "replace()", "at least 0.001 s"]),
        ({}, {"timeouts.conect": 1.0}, ["unknown key timeouts.conect", "did you mean timeouts.connect"]),
        ({}, {"admin": "0.0.0.0:9464"}, ["admin", "not a loopback address"]),
        ({"admin": "0.0.0.0:9464", "admin_public": True}, {"admin_public": False}, ["admin", "not a loopback"]),
        ({}, {"upstream": "https://router"}, ["upstream", "TLS upstreams are not supported"]),
    ],
    ids=["workers", "negative-timeout", "unknown-key", "public-admin", "revoking-admin-public", "https-upstream"],
)
def test_replace_validates(start, overrides, fragments):
    settings = default_settings().replace(**start)
    with pytest.raises(ConfigError) as error:
        settings.replace(**overrides)
    for fragment in fragments:
        assert fragment in str(error.value)


# --- the schema, the flags and the shipped default file ---


def test_schema_matches_the_settings_dataclasses():
    def fields(cls):
        return [f.name for f in dataclasses.fields(cls)]

    sections = {"timeouts": Timeouts, "pool": Pool, "limits": Limits, "forwarding": Forwarding,
                "request_id": RequestIds, "tracing": Tracing, "stall": Stall, "access_log": AccessLog,
                "metrics": type(Settings().metrics), "engines": Engines}
    not_keys = {"sources"}  # where each key's value came from, kept beside the values
    assert [s.key for s in SCHEMA if not s.section] == [n for n in fields(Settings)
                                                        if n not in sections and n not in not_keys]
    for name, cls in sections.items():
        assert [s.key for s in SCHEMA if s.section == name] == fields(cls)


def test_every_key_defaults_in_a_settings_object_built_by_hand_as_when_loaded():
    assert Settings() == default_settings() == EXPECTED_DEFAULTS
    assert Timeouts(connect=1.0) == dataclasses.replace(EXPECTED_DEFAULTS.timeouts, connect=1.0)
    assert Stall(first_byte=0.0).abort_on == () and Stall(first_byte=0.0).stream_gap == 30.0


def test_settings_classes_hold_no_class_attribute_that_shadows_a_field():
    # From CPython 3.12 a read of an instance attribute that a class attribute shadows is
    # not specialized, and the proxy reads ctx.timeouts.client_headers and the like on
    # every connection: the defaults live in __init__ and fields() only.
    for cls in (Settings, Timeouts, Pool, Limits, Forwarding, RequestIds, Tracing, Stall, AccessLog,
                type(Settings().metrics), Engines):
        assert [f.name for f in dataclasses.fields(cls) if f.name in vars(cls)] == [], cls.__name__


def test_the_stall_keys_and_abort_on_choices_are_the_stall_kinds():
    from traceproxy.lifecycle.stall import STALL_KINDS, StallThresholds

    thresholds = [s for s in SCHEMA if s.section == "stall" and s.key not in ("action", "abort_on")]
    assert [s.key for s in thresholds] == list(STALL_KINDS)
    assert {s.key: s.default for s in thresholds} == dataclasses.asdict(StallThresholds())
    every_kind = load_settings({"stall.abort_on": ",".join(STALL_KINDS)}, {})
    assert every_kind.stall.abort_on == STALL_KINDS


def test_the_generated_files_come_from_running_the_package():
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    for argv, shipped in (([], SHIPPED_CONFIG), (["reference"], root / "docs" / "configuration.md")):
        run = subprocess.run([sys.executable, "-m", "traceproxy.config", *argv], capture_output=True, text=True,
                             timeout=60, cwd=root, check=True)
        assert run.stdout == shipped.read_text()


def test_flag_and_env_names():
    names = {s.dotted: (s.flag, s.env) for s in SCHEMA}
    assert names["listen"] == ("--listen", "TRACEPROXY_LISTEN")
    assert names["admin_public"] == ("--admin-public", "TRACEPROXY_ADMIN_PUBLIC")
    assert names["timeouts.connect"] == ("--timeouts-connect", "TRACEPROXY_TIMEOUTS_CONNECT")
    assert names["pool.retry_buffer_bytes"] == ("--pool-retry-buffer-bytes", "TRACEPROXY_POOL_RETRY_BUFFER_BYTES")
    assert len({flag for flag, _ in names.values()}) == len({env for _, env in names.values()}) == len(SCHEMA)


def test_every_flag_defaults_to_none():
    parser = argparse.ArgumentParser()
    add_flags(parser)
    namespace = parser.parse_args([])
    assert vars(namespace) == dict.fromkeys(vars(namespace), None)
    assert len(vars(namespace)) == len(SCHEMA) + 1  # + --config
    help_text = parser.format_help()
    for setting in SCHEMA:
        assert setting.flag in help_text


def test_shipped_config_file_is_the_rendered_default():
    assert SHIPPED_CONFIG.read_text() == render_default_toml()


def test_shipped_config_file_loads_to_the_defaults():
    assert load_settings(parse_flags(["--config", str(SHIPPED_CONFIG)]), environ={}) == EXPECTED_DEFAULTS


def test_rendered_default_sets_nothing_but_names_every_key_with_its_meaning():
    text = render_default_toml()
    assert tomllib.loads(text) == {"timeouts": {}, "pool": {}, "limits": {}, "forwarding": {}, "request_id": {},
                                   "tracing": {}, "stall": {}, "access_log": {}, "metrics": {}, "engines": {}}
    assert "flags" in text and "TRACEPROXY_" in text
    comments = re.sub(r"\n# ", " ", text)
    for setting in SCHEMA:
        assert f"# {setting.key} = " in text
        assert setting.meaning in comments and setting.kind.expected in comments


def test_rendered_default_with_every_key_uncommented_loads_to_the_defaults(tmp_path):
    uncommented, count = re.subn(r"(?m)^# (\w+ = )", r"\1", render_default_toml())
    assert count == len(SCHEMA)
    assert load(tmp_path, toml=uncommented) == EXPECTED_DEFAULTS


@pytest.mark.parametrize(
    "raw,expected",
    [("x-request-id", ("x-request-id",)), ("X-Request-Id, x-correlation-id", ("x-request-id", "x-correlation-id"))],
    ids=["one", "two-mixed-case"],
)
def test_request_id_headers_from_env(raw, expected):
    settings = load_settings({}, {"TRACEPROXY_REQUEST_ID_HEADERS": raw})
    assert settings.request_id.headers == expected


@pytest.mark.parametrize(
    "key,raw,expected_form",
    [("request_id.headers", "bad header", "header names"), ("tracing.exporter", "jaeger", "'otlp'"),
     ("tracing.healthy_sample_ratio", "1.5", "from 0 to 1"), ("tracing.otlp_protocol", "thrift", "'grpc'")],
    ids=["header-with-space", "unknown-exporter", "ratio-above-one", "unknown-protocol"],
)
def test_tracing_and_request_id_errors_name_the_key(key, raw, expected_form):
    with pytest.raises(ConfigError) as err:
        load_settings({key: raw}, {})
    assert key in str(err.value) and expected_form in str(err.value)


@pytest.mark.parametrize("name", ["connection", "Traceparent", "x-forwarded-for", "transfer-encoding", "host"])
def test_a_conversation_id_header_the_proxy_manages_itself_is_refused_naming_the_key(name):
    # Such a field is removed or replaced before the value is read: the setting would
    # silently never find a conversation id.
    with pytest.raises(ConfigError) as err:
        load_settings({"tracing.conversation_id_header": name}, {})
    assert "tracing.conversation_id_header" in str(err.value) and "manages itself" in str(err.value)
    with pytest.raises(ConfigError, match="tracing.conversation_id_header"):
        load_settings({}, {"TRACEPROXY_TRACING_CONVERSATION_ID_HEADER": name})


def test_a_forwarded_conversation_id_header_is_accepted_in_lower_case():
    assert load_settings({"tracing.conversation_id_header": "X-Conversation-Id"}, {}
                         ).tracing.conversation_id_header == "x-conversation-id"
    assert load_settings({"tracing.conversation_id_header": ""}, {}).tracing.conversation_id_header == ""


def test_serve_check_exits_2_naming_a_managed_conversation_id_header(capsys):
    from traceproxy.cli import main

    assert main(["serve", "--check", "--tracing-conversation-id-header", "connection"]) == 2
    err = capsys.readouterr().err
    assert "tracing.conversation_id_header" in err and "connection is a header the proxy manages itself" in err


def test_empty_sample_ratio_means_from_the_environment():
    assert load_settings({"tracing.healthy_sample_ratio": ""}, {}).tracing.healthy_sample_ratio is None
    assert load_settings({"tracing.healthy_sample_ratio": "0.25"}, {}).tracing.healthy_sample_ratio == 0.25


def test_stall_abort_on_lists_known_kinds_only():
    settings = load_settings({}, {"TRACEPROXY_STALL_ABORT_ON": "first_byte,stream_gap"})
    assert settings.stall.abort_on == ("first_byte", "stream_gap")
    with pytest.raises(ConfigError) as err:
        load_settings({"stall.abort_on": "prefill"}, {})
    assert "stall.abort_on" in str(err.value) and "first_byte" in str(err.value)


def test_unknown_environment_variables_are_ignored_with_a_warning_naming_them():
    environ = {"TRACEPROXY_TIMEOUT_CONNECT": "1", "TRACEPROXY_CMD": "traceproxy serve ..."}
    assert load_settings({}, environ) == default_settings()
    warnings = unknown_environment(environ)
    assert len(warnings) == 2
    assert any("TRACEPROXY_TIMEOUT_CONNECT" in w and "did you mean TRACEPROXY_TIMEOUTS_CONNECT" in w for w in warnings)


def test_short_flag_aliases():
    settings = load_settings(parse_flags(["--inject-rid", "--request-id-headers", "x-request-id,x-trace-id"]), {})
    assert settings.request_id.inject_rid is True
    assert settings.request_id.headers == ("x-request-id", "x-trace-id")


def test_every_flag_is_listed_once_in_help_and_reference():
    from traceproxy.config import render_reference_markdown

    parser = argparse.ArgumentParser()
    add_flags(parser)
    for action in parser._actions:
        assert len(action.option_strings) == len(set(action.option_strings)), action.option_strings
    for line in render_reference_markdown().splitlines():
        flags = re.findall(r"`(--[a-z-]+)`", line)
        assert len(flags) == len(set(flags)), line


def test_boolean_flags_given_alone_mean_true_and_still_take_a_value():
    assert load_settings(parse_flags(["--forwarding-x-forwarded", "false"]), {}).forwarding.x_forwarded is False
    assert load_settings(parse_flags(["--admin-public"]), {}).admin_public is True


def test_log_level_is_a_setting_like_every_other(tmp_path):
    assert load(tmp_path, toml='log_level = "debug"\n').log_level == "debug"
    assert load(tmp_path, env={"TRACEPROXY_LOG_LEVEL": "warning"}, toml='log_level = "debug"\n').log_level == "warning"
    assert load(tmp_path, argv=["--log-level", "error"], env={"TRACEPROXY_LOG_LEVEL": "warning"}).log_level == "error"
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, env={"TRACEPROXY_LOG_LEVEL": "loud"})
    assert "TRACEPROXY_LOG_LEVEL" in str(caught.value) and "'debug'" in str(caught.value)


def test_configuration_reference_is_generated_from_the_schema():
    from traceproxy.config import render_reference_markdown

    shipped = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    assert shipped == render_reference_markdown()
    for setting in SCHEMA:
        assert setting.env in shipped and setting.flag in shipped


def test_settings_keep_where_each_value_came_from_through_a_replace(tmp_path):
    settings = load(tmp_path, ["--upstream", "http://127.0.0.1:9"], env={"TRACEPROXY_TIMEOUTS_CONNECT": "2"},
                    toml="[pool]\nidle_timeout = 3\n")
    assert settings.source("upstream") == "flag --upstream"
    assert settings.source("timeouts.connect") == "env TRACEPROXY_TIMEOUTS_CONNECT"
    assert settings.source("pool.idle_timeout") == f"file {tmp_path / 'traceproxy.toml'}"
    assert settings.source("workers") == "default"
    replaced = settings.replace(**{"workers": 2})
    assert replaced.source("workers") == "replace()" and replaced.source("upstream") == "flag --upstream"


@pytest.mark.parametrize("listen, admin, clash", [
    ("127.0.0.1:7000", "127.0.0.1:7000", True),
    ("0.0.0.0:7000", "127.0.0.1:7000", True),  # the wildcard covers the admin address
    ("127.0.0.1:7000", "localhost:7000", True),  # localhost binds both loopbacks
    ("LOCALHOST:7000", "localhost:7000", True),
    ("[::1]:7000", "[0:0:0:0:0:0:0:1]:7000", True),  # one address, two spellings
    ("[::]:7000", "[::1]:7000", True),
    ("[::]:7000", "127.0.0.1:7000", False),  # IPv6 listeners are IPv6-only
    ("0.0.0.0:7000", "[::1]:7000", False),
    ("127.1:7000", "127.0.0.1:7000", True),  # IPv4 as inet_aton reads it
    ("0:7000", "127.0.0.1:7000", True),  # the wildcard, so spelt
    ("0.0.0.0:7000", "localhost:7000", True),  # localhost: both loopbacks
    ("[::1]:7000", "[::1%1]:7000", True),  # a zone does not tell loopbacks apart
    ("127.0.0.1:7000", "127.0.0.2:7000", False),
    ("127.0.0.1:7000", "127.0.0.1:7001", False),
    ("127.0.0.1:0", "127.0.0.1:0", False),  # each picks its own free port
])
def test_the_admin_listener_cannot_share_the_proxys_address(tmp_path, listen, admin, clash):
    argv = ["--listen", listen, "--admin", admin, "--upstream", "http://127.0.0.1:9"]
    if not clash:
        assert load(tmp_path, argv).admin is not None
        return
    with pytest.raises(ConfigError, match=r"admin = .* \(from flag --admin\) is the listen address .*\(from flag "
                                          r"--listen\); expected another port"):
        load(tmp_path, argv)


@pytest.mark.parametrize("listen, upstream, loops", [
    ("127.0.0.1:7000", "http://127.0.0.1:7000", True),
    ("0.0.0.0:7000", "http://localhost:7000", True),  # the wildcard takes loopback connections
    ("0.0.0.0:7000", "http://127.0.0.1:7000", True),
    ("127.0.0.1:7000", "http://0.0.0.0:7000", True),  # a connection to 0.0.0.0 goes to this host
    ("[::]:7000", "http://[::1]:7000", True),
    ("127.0.0.1:7000", "http://127.0.0.1:7001", False),
    ("0.0.0.0:7000", "http://10.0.0.5:7000", False),  # maybe another host's: not judged
    ("127.0.0.1:7000", "http://router:7000", False),  # a name: not resolved here
    ("127.0.0.1:7000", "http://127.0.0.2:7000", False),  # the listener takes 127.0.0.1 only
    ("127.0.0.1:0", "http://127.0.0.1:7000", False),
])
def test_an_upstream_that_is_the_proxys_own_listener_is_refused(tmp_path, listen, upstream, loops):
    # Every request would come back in, until the pool is full and every client waits.
    argv = ["--listen", listen, "--upstream", upstream, "--admin", "off"]
    if not loops:
        assert str(load(tmp_path, argv).upstream) == upstream
        return
    with pytest.raises(ConfigError, match=r"upstream = .* \(from flag --upstream\) is this proxy's own listen "
                                          r"address .* \(from flag --listen\); expected the router's"):
        load(tmp_path, argv)


def test_an_upstream_that_is_the_admin_listener_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"is this proxy's own admin address '127.0.0.1:9464' \(from default\)"):
        load(tmp_path, ["--listen", "127.0.0.1:7000", "--upstream", "http://localhost:9464"])


def test_the_http_receivers_help_gives_sglang_the_full_traces_url():
    # SGLang hands --otlp-traces-endpoint to the OTLP/HTTP exporter as the URL to post to:
    # a bare http://HOST:PORT would post to /, which the receiver does not serve.
    [receiver] = [s for s in SCHEMA if s.dotted == "engines.otlp_receiver"]
    assert "--otlp-traces-endpoint http://HOST:PORT/v1/traces" in receiver.meaning
    assert "--otlp-traces-endpoint http://HOST:PORT " not in receiver.meaning
