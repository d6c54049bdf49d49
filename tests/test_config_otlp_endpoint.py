"""The collector endpoint: tracing.otlp_endpoint and the OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT
variables that stand in for it are judged by one rule, so that an endpoint every export
would fail on is refused at startup naming where it came from."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from traceproxy.config import (ConfigError, check_otlp_endpoint, collector_endpoint,
                               default_settings, load_settings)

ROOT = Path(__file__).resolve().parents[1]
VARIABLES = ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"]
# URLs the OTLP exporters cannot send to: every export would fail ("Failed to parse").
UNUSABLE_URLS = ["http://[::1", "http://collector:99999", "http://collector:abc", "http://[::zz]:4318",
                 "http://collector:0"]


@pytest.mark.parametrize("variable", VARIABLES)
@pytest.mark.parametrize("url", UNUSABLE_URLS)
def test_an_unusable_url_in_the_variable_is_refused_naming_the_variable(variable, url):
    with pytest.raises(ConfigError) as error:
        check_otlp_endpoint(default_settings(), {variable: url}, "http/protobuf")
    assert str(error.value).startswith(f"{variable} = {url!r} (from env): ")
    assert "expected an http(s):// URL" in str(error.value)


@pytest.mark.parametrize("url", UNUSABLE_URLS + ["http://collector:4318", "https://[::1]:4318/v1/traces",
                                                  "http://collector", "collector:4318", "not a url"])
def test_the_key_and_the_variable_accept_the_same_urls(url):
    def accepted(check) -> bool:
        try:
            check()
        except (ConfigError, ValueError):
            return False
        return True

    by_key = accepted(lambda: check_otlp_endpoint(load_settings({"tracing.otlp_endpoint": url}, environ={}), {},
                                                  "http/protobuf"))
    by_variable = accepted(lambda: check_otlp_endpoint(default_settings(), {VARIABLES[0]: url}, "http/protobuf"))
    assert by_key == by_variable


def test_the_traces_variable_is_the_one_judged_when_both_are_set():
    environ = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://[::1", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://ok:4318"}
    with pytest.raises(ConfigError, match=r"^OTEL_EXPORTER_OTLP_TRACES_ENDPOINT = 'http://\[::1'"):
        check_otlp_endpoint(default_settings(), environ, "http/protobuf")


def test_the_key_wins_over_the_variables_and_is_named():
    settings = load_settings({"tracing.otlp_endpoint": "http://collector:4318"}, environ={})
    check_otlp_endpoint(settings, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://[::1"}, "http/protobuf")  # not the one used
    # A key the protocol cannot use is the one named, not the usable variable beside it.
    settings = load_settings({"tracing.otlp_endpoint": "collector:4318"}, environ={})
    with pytest.raises(ConfigError) as error:
        check_otlp_endpoint(settings, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://ok:4318"}, "http/protobuf")
    message = str(error.value)
    assert message.startswith("tracing.otlp_endpoint = 'collector:4318' (from flag --tracing-otlp-endpoint): ")
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in message


def test_over_grpc_a_variable_is_judged_by_the_same_rule():
    settings = default_settings()
    for target in ("collector:4317", "unix:///run/otel.sock", "https://collector:4317"):
        check_otlp_endpoint(settings, {"OTEL_EXPORTER_OTLP_ENDPOINT": target}, "grpc")
    with pytest.raises(ConfigError, match=r"^OTEL_EXPORTER_OTLP_ENDPOINT = 'http://\[::1' \(from env\): not a URL"):
        check_otlp_endpoint(settings, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://[::1"}, "grpc")
    with pytest.raises(ConfigError, match="OTLP over http/protobuf needs an http:// or https:// URL"):
        check_otlp_endpoint(settings, {"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317"}, "http/protobuf")


def test_the_reason_says_what_is_wrong_with_the_url():
    kind = collector_endpoint()
    for url, reason in (("http://[::1", "not a URL"), ("http://collector:99999", "port 99999 is out of range 1..65535"),
                        ("http://collector:0", "port 0 is out of range 1..65535")):
        with pytest.raises(ValueError, match=re.escape(reason)):
            kind.parse(url)


@pytest.mark.parametrize("endpoint", ["http://collector:99999", "collector:99999", "http://[::1", "http://collector:abc",
                                      "ftp://collector:21"])
def test_the_variable_is_refused_in_the_words_the_key_is(endpoint):
    with pytest.raises(ConfigError) as by_key:
        load_settings({"tracing.otlp_endpoint": endpoint}, environ={})
    with pytest.raises(ConfigError) as by_variable:
        check_otlp_endpoint(default_settings(), {VARIABLES[1]: endpoint}, "grpc")
    assert str(by_key.value).partition("): ")[2] == str(by_variable.value).partition("): ")[2]


def test_a_port_out_of_range_is_said_alike_in_a_url_and_in_host_port():
    reasons = set()
    for key, value in (("tracing.otlp_endpoint", "http://collector:70000"), ("tracing.otlp_endpoint", "collector:70000"),
                       ("upstream", "http://router:70000")):
        with pytest.raises(ConfigError) as error:
            load_settings({key: value}, environ={})
        reasons.add(str(error.value).partition("): ")[2].partition(";")[0])
    assert reasons == {"port 70000 is out of range 1..65535"}


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
@pytest.mark.parametrize("variable", VARIABLES)
def test_serve_check_exits_2_naming_the_variable(tmp_path, variable, protocol):
    clean = {name: value for name, value in os.environ.items() if not name.startswith(("TRACEPROXY_", "OTEL_"))}
    checked = subprocess.run([sys.executable, "-m", "traceproxy", "serve", "--check", "--admin", "off",
                              "--tracing-exporter", "otlp", "--tracing-otlp-protocol", protocol], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60,
                             env={**clean, "PYTHONPATH": str(ROOT), variable: "http://[::1"})
    assert checked.returncode == 2 and checked.stdout == ""
    assert checked.stderr.startswith(f"traceproxy: configuration error: {variable} = 'http://[::1' (from env): ")
