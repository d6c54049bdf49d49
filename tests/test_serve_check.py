"""``traceproxy serve --check``: the settings loaded and validated as serve would, what
it would listen on, forward to and write to, and nothing started, bound, resolved or
written."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from traceproxy.cli import main
from traceproxy.sim.launch import free_port

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``traceproxy *argv`` in a clean environment: no TRACEPROXY_* or OTEL_* but ``env``."""
    clean = {name: value for name, value in os.environ.items() if not name.startswith(("TRACEPROXY_", "OTEL_"))}
    return subprocess.run([sys.executable, "-m", "traceproxy", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=60, env={**clean, "PYTHONPATH": str(ROOT), **(env or {})})


def _effective(stdout: str) -> dict[str, str]:
    """The check's "label  value" lines, its last line apart."""
    *lines, verdict = stdout.strip().splitlines()
    assert verdict == "traceproxy: configuration OK", stdout
    return dict(re.split(r"\s{2,}", line, maxsplit=1) for line in lines)


@pytest.fixture
def in_process(monkeypatch, tmp_path):
    """For ``main`` run here: no TRACEPROXY_* or OTEL_* variable, and an empty working folder."""
    for name in [name for name in os.environ if name.startswith(("TRACEPROXY_", "OTEL_"))]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def test_check_prints_the_effective_addresses_and_absolute_paths_and_writes_nothing(tmp_path):
    result = _run("serve", "--check", "--listen", "0.0.0.0:8000", "--upstream", "http://router:30000",
                  "--admin", "0.0.0.0:9464", "--admin-public", "--tracing-exporter", "file",
                  "--tracing-file-path", "data/spans.jsonl", "--access-log-path", "logs/access.log", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert _effective(result.stdout) == {
        "listen": "0.0.0.0:8000",
        "upstream": "http://router:30000",
        "admin": "http://0.0.0.0:9464",
        "spans": str(tmp_path / "data" / "spans.jsonl"),
        "access log": str(tmp_path / "logs" / "access.log"),
    }
    assert list(tmp_path.iterdir()) == []  # neither folder made, neither file created


def test_check_loads_flags_over_environment_over_the_config_file_as_serve_does(tmp_path):
    config = tmp_path / "traceproxy.toml"
    config.write_text('listen = "127.0.0.1:7000"\nupstream = "http://engine:9000"\nadmin = "127.0.0.1:7001"\n'
                      '[access_log]\npath = ""\n')
    env = {"TRACEPROXY_CONFIG": str(config), "TRACEPROXY_ADMIN": "off",
           "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"}
    result = _run("serve", "--check", "--listen", "127.0.0.1:7100", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert _effective(result.stdout) == {
        "listen": "127.0.0.1:7100",  # the flag
        "upstream": "http://engine:9000",  # the file
        "admin": "off",  # the environment
        "spans": "OTLP http/protobuf to http://collector:4318/v1/traces",  # where the SDK exporter posts
        "access log": "off",
    }


# {free}: a port nothing listens on, so that serve, were it wrongly to accept the
# settings, would bind nothing another test uses.
@pytest.mark.parametrize(("argv", "env", "named"), [
    (["--admin", "127.0.0.1:{free}", "--upstream", "http://localhost:{free}"], {},
     "upstream = 'http://localhost:{free}' (from flag --upstream) is this proxy's own admin address"),
    (["--request-id-headers", "x-request-id,content-length"], {}, "request_id.headers"),
    (["--tracing-exporter", "file", "--tracing-file-path", "a-file/spans.jsonl"], {},
     "tracing.file_path = 'a-file/spans.jsonl' (from flag --tracing-file-path): its folder 'a-file' cannot be "
     "made (a part of it is a file, not a folder)"),
    (["--access-log-path", "a-file/logs/access.jsonl"], {},
     "access_log.path = 'a-file/logs/access.jsonl' (from flag --access-log-path): its folder 'a-file/logs' cannot "
     "be made (a part of it is a file, not a folder)"),
    (["--access-log-path", "a-folder"], {},
     "access_log.path = 'a-folder' (from flag --access-log-path): cannot append to it (Is a directory)"),
    ([], {"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"}, "OTEL_EXPORTER_OTLP_ENDPOINT = 'collector:4318'"),
    ([], {"TRACEPROXY_POOL_IDLE_TIMEOUT": "soon"},
     "pool.idle_timeout = 'soon' (from env TRACEPROXY_POOL_IDLE_TIMEOUT)"),
], ids=["upstream-is-self", "managed-request-id-header", "spans-folder-is-a-file",
        "access-log-folder-under-a-file", "access-log-is-a-folder",
        "otlp-endpoint-not-a-url", "bad-environment-value"])
def test_an_invalid_setting_exits_2_naming_the_key_as_serve_itself_does(tmp_path, argv, env, named):
    free = str(free_port())
    argv = ["--listen", "127.0.0.1:0", "--admin", "off", *(arg.replace("{free}", free) for arg in argv)]
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-folder").mkdir()
    checked = _run("serve", "--check", *argv, cwd=tmp_path, env=env)
    assert checked.returncode == 2 and checked.stdout == ""
    assert checked.stderr.startswith("traceproxy: configuration error: ")
    assert named.replace("{free}", free) in checked.stderr
    # serve refuses the same settings in the same words, before it binds anything.
    served = _run("serve", *argv, cwd=tmp_path, env=env)
    assert (served.returncode, served.stderr.splitlines()[-1:]) == (2, checked.stderr.splitlines())


def test_check_binds_nothing_and_resolves_no_names(in_process, monkeypatch, capsys):
    """In-process, with every way to resolve a name or open a socket turned into a failure."""

    def refused(*_args, **_kwargs):
        raise AssertionError("serve --check must not resolve names or open sockets")

    for name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "create_connection", "socket"):
        monkeypatch.setattr(socket, name, refused)
    code = main(["serve", "--check", "--listen", "proxy.invalid:8000", "--upstream", "http://engine.invalid:30000",
                 "--admin", "proxy.invalid:9464", "--admin-public", "--workers", "2"])
    out = capsys.readouterr()
    assert code == 0, out.err
    effective = _effective(out.out)
    assert effective["listen"] == "proxy.invalid:8000" and effective["upstream"] == "http://engine.invalid:30000"
    assert effective["admin"] == "http://proxy.invalid:9464"


@pytest.mark.parametrize(("argv", "env", "spans"), [
    ([], {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/custom", "OTEL_EXPORTER_OTLP_ENDPOINT":
          "http://other:4318"}, "OTLP http/protobuf to http://collector:4318/custom"),
    (["--tracing-otlp-endpoint", "http://collector:4318"], {}, "OTLP http/protobuf to http://collector:4318/v1/traces"),
    (["--tracing-otlp-protocol", "grpc"], {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4317"},
     "OTLP grpc to collector:4317 (TLS)"),
    (["--tracing-exporter", "otlp", "--tracing-otlp-protocol", "grpc"], {}, "OTLP grpc to localhost:4317 (plaintext)"),
    (["--tracing-exporter", "console"], {}, "stderr (console exporter)"),
    (["--tracing-exporter", "off"], {}, "off"),
], ids=["traces-variable-as-is", "config-endpoint", "grpc-tls", "grpc-default", "console", "off"])
def test_the_spans_line_names_where_the_exporter_sends_them(in_process, monkeypatch, capsys, argv, env, spans):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "--check", *argv]) == 0
    assert _effective(capsys.readouterr().out)["spans"] == spans


def test_check_passes_while_the_listen_port_is_taken(tmp_path):
    """Whether a port is free only binding tells: the check leaves it to startup."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = _run("serve", "--check", "--listen", f"127.0.0.1:{port}", "--admin", "off", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert _effective(result.stdout)["listen"] == f"127.0.0.1:{port}"
