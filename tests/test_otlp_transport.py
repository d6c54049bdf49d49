"""OTLP delivery through public means: the settings the OTEL_EXPORTER_OTLP_* variables
make, the retry rule, an HTTP POST and a gRPC unary call carrying our bytes to real
servers on loopback (plaintext and TLS), and an exporter process that never loads the
OpenTelemetry SDK's exporters."""

from __future__ import annotations

import gzip
import logging
import os
import shutil
import ssl
import subprocess
import sys
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.rpc import error_details_pb2, status_pb2

import traceproxy
from traceproxy.observe import otlp_transport
from traceproxy.observe.export_wire import ExportConfig
from traceproxy.observe.otlp_settings import OtlpSettings, otlp_settings
from traceproxy.observe.otlp_transport import (
    MAX_ATTEMPTS, Attempt, GrpcTransport, HttpTransport, grpc_retry_delay, retry_after_seconds, send_with_retries,
)

PAYLOAD = b"\x0a\x03abc" * 50  # any bytes: the transports never look inside
SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"


@pytest.fixture(autouse=True)
def no_otel_environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)


@pytest.fixture
def no_backoff(monkeypatch):
    """Retries without the real 1, 2, 4 s waits (the rule itself is tested on a fake clock)."""
    monkeypatch.setattr(otlp_transport, "backoff", lambda retry: 0.01)


def config(protocol: str = "http/protobuf", endpoint: str = "", export_timeout: float = 5.0) -> ExportConfig:
    return ExportConfig(exporter="otlp", otlp_endpoint=endpoint, otlp_protocol=protocol, file_path="",
                        service_name="t", export_timeout=export_timeout)


# ------------------------------------------------------------------------ settings
@pytest.mark.parametrize("configured, environ, url", [
    ("http://c:4318", {}, "http://c:4318/v1/traces"),
    ("http://c:4318/v1/traces", {}, "http://c:4318/v1/traces"),
    ("http://c:4318", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/x"}, "http://c:4318/v1/traces"),
    ("", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/x", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://b:2"},
     "http://t:1/x"),
    ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://b:2/"}, "http://b:2/v1/traces"),
    ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://b/otlp"}, "https://b/otlp/v1/traces"),
    ("", {}, "http://localhost:4318/v1/traces"),
    ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://b:2/otlp/?tenant=a"}, "http://b:2/otlp/v1/traces?tenant=a"),
    ("http://c:4318?tenant=a#top", {}, "http://c:4318/v1/traces?tenant=a"),
], ids=["config-base", "config-full", "config-wins", "traces-variable-as-is", "base-variable", "base-with-path",
        "default", "base-variable-with-query", "config-with-query"])
def test_http_endpoint(configured, environ, url):
    assert otlp_settings(config(endpoint=configured), environ).endpoint == url


@pytest.mark.parametrize("configured, environ, target, insecure", [
    ("http://127.0.0.1:4317", {}, "127.0.0.1:4317", True),
    ("https://c:4317", {"OTEL_EXPORTER_OTLP_INSECURE": "true"}, "c:4317", False),
    ("c:4317", {}, "c:4317", False),
    ("c:4317", {"OTEL_EXPORTER_OTLP_INSECURE": "TRUE"}, "c:4317", True),
    ("c:4317", {"OTEL_EXPORTER_OTLP_TRACES_INSECURE": "false", "OTEL_EXPORTER_OTLP_INSECURE": "true"}, "c:4317", False),
    ("http://c:4317", {"OTEL_EXPORTER_OTLP_INSECURE": ""}, "c:4317", False),
    ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://e:1"}, "e:1", True),
    ("", {}, "localhost:4317", True),
], ids=["http-plaintext", "https-always-tls", "bare-target-tls", "insecure-variable", "traces-variable-wins",
        "set-but-empty-is-not-insecure", "from-variable", "default"])
def test_grpc_target_and_tls(configured, environ, target, insecure):
    settings = otlp_settings(config("grpc", configured), environ)
    assert (settings.endpoint, settings.insecure) == (target, insecure)


def test_the_traces_variables_win_over_the_general_ones():
    environ = {}
    for name, general, traces in [("HEADERS", "a=general", "a=traces"), ("TIMEOUT", "9", "2.5"),
                                  ("COMPRESSION", "deflate", "gzip"), ("CERTIFICATE", "/g.pem", "/t.pem"),
                                  ("CLIENT_CERTIFICATE", "/gc.pem", "/tc.pem"), ("CLIENT_KEY", "/gk", "/tk")]:
        environ |= {f"OTEL_EXPORTER_OTLP_{name}": general, f"OTEL_EXPORTER_OTLP_TRACES_{name}": traces}
    settings = otlp_settings(config(), environ)
    assert settings == OtlpSettings(protocol="http/protobuf", endpoint="http://localhost:4318/v1/traces",
                                    timeout=2.5, headers={"a": "traces"}, compression="gzip",
                                    certificate="/t.pem", client_certificate="/tc.pem", client_key="/tk")
    general = {name: value for name, value in environ.items() if "TRACES" not in name}
    assert otlp_settings(config(), general).timeout == 9.0


def test_headers_are_url_decoded_pairs_and_bad_ones_are_named(caplog):
    raw = "Authorization=Bearer%20tok%3D%3D, x-tenant = acme ,nonsense,=no-name,bad name=1,,x-empty="
    with caplog.at_level(logging.WARNING, logger="traceproxy.export"):
        headers = otlp_settings(config(), {"OTEL_EXPORTER_OTLP_HEADERS": raw}).headers
    assert headers == {"authorization": "Bearer tok==", "x-tenant": "acme", "x-empty": ""}
    warned = " ".join(record.getMessage() for record in caplog.records)
    assert "'nonsense'" in warned and "'=no-name'" in warned and "'bad name=1'" in warned


@pytest.mark.parametrize("raw, timeout", [("", 5.0), ("0.25", 0.25), ("abc", 5.0), ("0", 5.0), ("-1", 5.0),
                                          ("inf", 5.0)])
def test_timeout_is_seconds_else_the_configured_one(raw, timeout):
    assert otlp_settings(config(export_timeout=5.0), {"OTEL_EXPORTER_OTLP_TIMEOUT": raw}).timeout == timeout


@pytest.mark.parametrize("raw, compression", [("", "none"), ("GZIP ", "gzip"), ("deflate", "deflate"),
                                              ("none", "none"), ("br", "none")])
def test_compression(raw, compression):
    assert otlp_settings(config(), {"OTEL_EXPORTER_OTLP_COMPRESSION": raw}).compression == compression


# --------------------------------------------------------------------- the retry rule
class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []
        self.given: list[float] = []  # the time left each attempt was handed

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def attempts(self, *outcomes: Attempt, each_takes: float = 0.0):
        queue = list(outcomes)

        def attempt(seconds_left: float) -> Attempt:
            # As the real transports do, an attempt ends within the time it is given
            # (their request timeout): a slow collector costs at most what is left.
            self.given.append(seconds_left)
            self.now += min(each_takes, seconds_left)
            return queue.pop(0)

        return attempt


RETRYABLE = Attempt(False, retryable=True, reason="HTTP 503 Service Unavailable")


def test_retryable_failures_back_off_exponentially_until_delivered():
    fake = FakeTime()
    attempt = fake.attempts(RETRYABLE, RETRYABLE, RETRYABLE, Attempt(True))
    assert send_with_retries(attempt, 30.0, "c", fake.clock, fake.sleep) is True
    assert len(fake.slept) == 3
    for retry, waited in enumerate(fake.slept):
        assert 0.8 * 2**retry <= waited <= 1.2 * 2**retry
    assert fake.given[0] == 30.0 and fake.given[1] == pytest.approx(30.0 - fake.slept[0])


def test_the_collectors_retry_after_is_obeyed():
    fake = FakeTime()
    asked = Attempt(False, retryable=True, retry_after=3.5, reason="HTTP 429 Too Many Requests")
    assert send_with_retries(fake.attempts(asked, Attempt(True)), 30.0, "c", fake.clock, fake.sleep) is True
    assert fake.slept == [3.5]


@pytest.mark.parametrize("jitter", [1 - otlp_transport.JITTER, 1.0, 1 + otlp_transport.JITTER],
                         ids=["shortest waits", "even waits", "longest waits"])
def test_no_wait_ends_past_the_timeout(caplog, monkeypatch, jitter):
    monkeypatch.setattr(otlp_transport.random, "uniform", lambda low, high: jitter)
    fake = FakeTime()
    with caplog.at_level(logging.WARNING, logger="traceproxy.export"):
        delivered = send_with_retries(fake.attempts(*[RETRYABLE] * MAX_ATTEMPTS, each_takes=0.5), 5.0,
                                      "http://c/v1/traces", fake.clock, fake.sleep)
    assert delivered is False
    assert fake.now - 100.0 <= 5.0  # waits of ~1 and ~2 s, then ~4 s would pass the 5 s: given up
    assert len(fake.slept) == 2
    [warning] = caplog.records
    assert warning.getMessage().startswith("OTLP export to http://c/v1/traces failed: HTTP 503 Service Unavailable")
    assert "gave up after 3 attempts" in warning.getMessage()


def test_a_retry_after_past_the_timeout_ends_the_export():
    fake = FakeTime()
    asked = Attempt(False, retryable=True, retry_after=60.0, reason="HTTP 503")
    assert send_with_retries(fake.attempts(asked), 5.0, "c", fake.clock, fake.sleep) is False
    assert fake.slept == []


def test_attempts_are_bounded():
    fake = FakeTime()
    asked = Attempt(False, retryable=True, retry_after=0.0, reason="HTTP 503")
    assert send_with_retries(fake.attempts(*[asked] * MAX_ATTEMPTS), 3600.0, "c", fake.clock, fake.sleep) is False
    assert len(fake.given) == MAX_ATTEMPTS


def test_a_failure_that_is_not_retryable_is_not_retried(caplog):
    fake = FakeTime()
    with caplog.at_level(logging.WARNING, logger="traceproxy.export"):
        refused = Attempt(False, reason="HTTP 400 Bad Request: bad span")
        assert send_with_retries(fake.attempts(refused), 30.0, "c", fake.clock, fake.sleep) is False
    assert fake.slept == [] and "not retried" in caplog.records[0].getMessage()


@pytest.mark.parametrize("value, seconds", [(None, None), ("", None), ("7", 7.0), (" 1.5 ", 1.5), ("-3", 0.0),
                                            ("soon", None), ("nan", None),
                                            ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0)])
def test_retry_after_header(value, seconds):
    assert retry_after_seconds(value) == seconds


def test_retry_info_is_read_from_either_trailer():
    retry_info = error_details_pb2.RetryInfo(retry_delay=Duration(seconds=2, nanos=500_000_000))
    status = status_pb2.Status(code=8, message="slow down")
    status.details.add().Pack(error_details_pb2.DebugInfo(detail="unrelated"))
    status.details.add().Pack(retry_info)
    assert grpc_retry_delay([("google.rpc.retryinfo-bin", retry_info.SerializeToString())]) == 2.5
    assert grpc_retry_delay([("other", "x"), ("grpc-status-details-bin", status.SerializeToString())]) == 2.5
    assert grpc_retry_delay([("grpc-status-details-bin", b"\xff\xff not a message")]) is None
    assert grpc_retry_delay([]) is None


# ---------------------------------------------------------------------------- HTTP
class ScriptedCollector:
    """Answers each POST with the next scripted (status, headers, body), then 200."""

    def __init__(self, *script: tuple[int, dict, bytes], tls: ssl.SSLContext | None = None) -> None:
        self.script = list(script)
        self.received: list[tuple[str, dict, bytes]] = []
        self.client_ports: list[int] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                collector.received.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                collector.client_ports.append(self.client_address[1])
                status, headers, reply = collector.script.pop(0) if collector.script else (200, {}, b"")
                self.send_response(status)
                for name, value in {"Content-Length": str(len(reply)), **headers}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        if tls is not None:
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        scheme = "https" if tls is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def collector():
    started = []

    def start(*script, tls=None) -> ScriptedCollector:
        started.append(ScriptedCollector(*script, tls=tls))
        return started[-1]

    yield start
    for server in started:
        server.close()


def http_transport(url: str, environ: dict | None = None, timeout: float = 5.0) -> HttpTransport:
    return HttpTransport(otlp_settings(config(endpoint=url, export_timeout=timeout), environ or {}))


@pytest.mark.parametrize("status", [429, 502, 503, 504])
def test_http_retryable_answers_are_retried(status, collector, no_backoff):
    server = collector((status, {}, b"busy"))
    transport = http_transport(server.url)
    assert transport.send(PAYLOAD) is True
    assert [body for _, _, body in server.received] == [PAYLOAD, PAYLOAD]
    transport.shutdown()


@pytest.mark.parametrize("status", [400, 401, 404, 413, 500])
def test_http_other_answers_fail_the_batch_at_once_with_the_collectors_words(status, collector, caplog):
    message = status_pb2.Status(code=3, message="span 7 has no name").SerializeToString()
    server = collector((status, {"Content-Type": "application/x-protobuf"}, message))
    with caplog.at_level(logging.WARNING, logger="traceproxy.export"):
        assert http_transport(server.url).send(PAYLOAD) is False
    assert len(server.received) == 1
    [warning] = caplog.records
    assert f"HTTP {status}" in warning.getMessage() and "span 7 has no name" in warning.getMessage()


def test_http_a_redirect_is_not_a_delivery(collector, caplog):
    server = collector((308, {"Location": "http://elsewhere/v1/traces"}, b""))
    with caplog.at_level(logging.WARNING, logger="traceproxy.export"):
        assert http_transport(server.url).send(PAYLOAD) is False
    assert len(server.received) == 1
    assert "HTTP 308 Permanent Redirect to http://elsewhere/v1/traces" in caplog.records[0].getMessage()


def test_http_retry_after_is_obeyed(collector):
    server = collector((429, {"Retry-After": "0"}, b""), (503, {"Retry-After": "0"}, b""))
    assert http_transport(server.url).send(PAYLOAD) is True  # without the 1 + 2 s backoff
    assert len(server.received) == 3


@pytest.mark.parametrize("compression, decode", [("gzip", gzip.decompress), ("deflate", zlib.decompress),
                                                 ("none", lambda body: body)])
def test_http_request_headers_and_compression(compression, decode, collector):
    server = collector()
    environ = {"OTEL_EXPORTER_OTLP_TRACES_HEADERS": "authorization=Bearer%20tok,x-tenant=acme",
               "OTEL_EXPORTER_OTLP_COMPRESSION": compression}
    assert http_transport(server.url, environ).send(PAYLOAD) is True
    [(path, headers, body)] = server.received
    assert path == "/v1/traces" and decode(body) == PAYLOAD
    assert headers["content-type"] == "application/x-protobuf"
    assert headers["authorization"] == "Bearer tok" and headers["x-tenant"] == "acme"
    assert headers["user-agent"] == f"traceproxy/{traceproxy.__version__}"
    assert headers.get("content-encoding", "none") == compression


def test_http_keeps_its_connection_alive_between_batches(collector):
    server = collector()
    transport = http_transport(server.url)
    for _ in range(3):
        assert transport.send(PAYLOAD) is True
    assert len(server.received) == 3 and len(set(server.client_ports)) == 1


# ---------------------------------------------------------------------------- gRPC
class ScriptedGrpcCollector:
    """TraceService/Export with no deserializer: records the raw bytes and metadata,
    and fails the first calls with the scripted (code, trailing metadata)."""

    def __init__(self, *script: tuple[grpc.StatusCode, tuple], credentials=None, port: int = 0) -> None:
        self.script = list(script)
        self.received: list[tuple[bytes, dict]] = []
        handler = grpc.method_handlers_generic_handler(SERVICE, {"Export": grpc.unary_unary_rpc_method_handler(
            self._export, request_deserializer=None, response_serializer=None)})
        self._server = grpc.server(ThreadPoolExecutor(max_workers=4))
        self._server.add_generic_rpc_handlers((handler,))
        if credentials is None:
            self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        else:
            self.port = self._server.add_secure_port(f"127.0.0.1:{port}", credentials)
        if not self.port:
            raise RuntimeError(f"cannot listen on 127.0.0.1:{port}")
        self._server.start()

    def _export(self, request: bytes, context) -> bytes:
        self.received.append((request, dict(context.invocation_metadata())))
        if self.script:
            code, trailers = self.script.pop(0)
            context.set_trailing_metadata(trailers)
            context.abort(code, "scripted failure")
        return b""  # an empty ExportTraceServiceResponse

    def close(self) -> None:
        self._server.stop(grace=0).wait(5)


@pytest.fixture
def grpc_collector():
    started = []

    def start(*script, credentials=None, port=0) -> ScriptedGrpcCollector:
        started.append(ScriptedGrpcCollector(*script, credentials=credentials, port=port))
        return started[-1]

    yield start
    for server in started:
        server.close()


def grpc_transport(endpoint: str, environ: dict | None = None, timeout: float = 5.0) -> GrpcTransport:
    return GrpcTransport(otlp_settings(config("grpc", endpoint, export_timeout=timeout), environ or {}))


def test_grpc_carries_our_bytes_and_the_header_variables(grpc_collector):
    server = grpc_collector()
    environ = {"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20tok", "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip"}
    transport = grpc_transport(f"http://127.0.0.1:{server.port}", environ)
    assert transport.send(PAYLOAD) is True and transport.send(PAYLOAD[:7]) is True
    transport.shutdown()
    assert [request for request, _ in server.received] == [PAYLOAD, PAYLOAD[:7]]
    metadata = server.received[0][1]
    assert metadata["authorization"] == "Bearer tok"
    assert metadata["user-agent"].startswith(f"traceproxy/{traceproxy.__version__}")


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED,
                                  grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.DATA_LOSS])
def test_grpc_retryable_codes_are_retried(code, grpc_collector, no_backoff):
    server = grpc_collector((code, ()), (code, ()))
    assert grpc_transport(f"http://127.0.0.1:{server.port}").send(PAYLOAD) is True
    assert len(server.received) == 3


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED])
def test_grpc_other_codes_fail_the_batch_at_once(code, grpc_collector, no_backoff, caplog):
    server = grpc_collector((code, ()))
    with caplog.at_level(logging.WARNING, logger="traceproxy.export"):
        assert grpc_transport(f"http://127.0.0.1:{server.port}").send(PAYLOAD) is False
    assert len(server.received) == 1
    assert f"{code.name}: scripted failure" in caplog.records[0].getMessage()


def test_grpc_resource_exhausted_with_retry_info_waits_as_asked(grpc_collector):
    retry_info = error_details_pb2.RetryInfo(retry_delay=Duration(nanos=50_000_000)).SerializeToString()
    server = grpc_collector((grpc.StatusCode.RESOURCE_EXHAUSTED, (("google.rpc.retryinfo-bin", retry_info),)))
    assert grpc_transport(f"http://127.0.0.1:{server.port}").send(PAYLOAD) is True
    assert len(server.received) == 2


def test_grpc_a_collector_that_comes_back_gets_the_next_batch(grpc_collector, no_backoff):
    # A channel that lost its server waits a second or more before it reconnects;
    # a collector back within that must still get the next attempt.
    server = grpc_collector()
    transport = grpc_transport(f"http://127.0.0.1:{server.port}", timeout=0.5)
    assert transport.send(PAYLOAD) is True
    server.close()
    assert transport.send(PAYLOAD) is False  # down: UNAVAILABLE at every attempt
    try:
        back = grpc_collector(port=server.port)
    except RuntimeError:
        pytest.skip("the collector's port was taken before it came back")
    assert transport.send(PAYLOAD) is True
    assert [request for request, _ in back.received] == [PAYLOAD]


# ----------------------------------------------------------------------------- TLS
@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 (and its key), from the openssl tool."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_http_over_tls_trusts_the_certificate_variable(certificate, collector, caplog):
    cert, key = certificate
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = collector(tls=context)
    assert http_transport(server.url, {"OTEL_EXPORTER_OTLP_CERTIFICATE": str(cert)}).send(PAYLOAD) is True
    assert [body for _, _, body in server.received] == [PAYLOAD]
    with caplog.at_level(logging.WARNING, logger="traceproxy.export"):
        assert http_transport(server.url).send(PAYLOAD) is False  # not a CA the system trusts
    assert "TLS" in caplog.records[0].getMessage() and "not retried" in caplog.records[0].getMessage()


def test_grpc_over_tls_trusts_the_certificate_variable(certificate, grpc_collector):
    cert, key = certificate
    credentials = grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())])
    server = grpc_collector(credentials=credentials)
    environ = {"OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": str(cert)}
    assert grpc_transport(f"https://127.0.0.1:{server.port}", environ).send(PAYLOAD) is True
    assert grpc_transport(f"http://127.0.0.1:{server.port}", timeout=0.5).send(PAYLOAD) is False  # plaintext
    assert [request for request, _ in server.received] == [PAYLOAD]


# ------------------------------------------------------------------ the exporter process
EXPORT_ONCE = """
import sys
from traceproxy.observe.export_sinks import make_sink
from traceproxy.observe.export_wire import ExportConfig
from traceproxy.observe.spandata import SpanData
config = ExportConfig.from_json(sys.argv[1])
span = SpanData(1, 2, 0, "GET", 2, 10, 20, {"k": "v"})
sink = make_sink(config)
delivered = sink.export([span])
sink.shutdown()
sdk_exporters = sorted(name for name in sys.modules if name.startswith("opentelemetry.exporter"))
print(delivered, sdk_exporters)
"""


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_the_exporter_process_never_loads_the_sdks_exporters(protocol, collector, grpc_collector, tmp_path):
    # Their internals are what pinned the SDK to one minor version; public means need no pin.
    if protocol == "grpc":
        endpoint = f"http://127.0.0.1:{grpc_collector().port}"
    else:
        endpoint = collector().url
    exported = config(protocol, endpoint).to_json()
    done = subprocess.run([sys.executable, "-c", EXPORT_ONCE, exported], capture_output=True, text=True,
                          timeout=60, env={name: value for name, value in os.environ.items()
                                           if not name.startswith("OTEL_")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True []"
