"""docker-compose.yml validates (Debian's docker-compose, no engine needed), and every
traceproxy command line in it parses with today's flags."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from traceproxy.cli import _parser
from traceproxy.config import load_settings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = shutil.which("docker-compose")
needs_compose = pytest.mark.skipif(COMPOSE is None, reason="docker-compose is not installed (.ci/run installs it)")


def _config(*profile: str) -> str:
    result = subprocess.run([COMPOSE, *profile, "config"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


@needs_compose
@pytest.mark.parametrize("profile", [(), ("--profile", "collector")], ids=["default", "collector"])
def test_compose_file_validates(profile):
    services = subprocess.run([COMPOSE, *profile, "config", "--services"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60).stdout.split()
    expected = {"jaeger", "prefill", "decode", "router", "traceproxy"}
    if profile:
        expected |= {"otel-collector", "traceproxy-fleet"}
    assert expected <= set(services)
    assert "COLLECTOR_OTLP_ENABLED" in _config(*profile)


def _traceproxy_commands() -> list[list[str]]:
    text = " ".join((ROOT / "docker-compose.yml").read_text().split())  # folded command lines joined
    return [shlex.split(match.group(1)) for match in re.finditer(r'traceproxy ((?:serve|sim) [^"]*)"', text)]


def test_every_traceproxy_command_in_compose_parses():
    commands = _traceproxy_commands()
    assert any(c[0] == "serve" for c in commands) and any(c[0] == "sim" for c in commands)
    parser = _parser()
    for argv in commands:
        args = parser.parse_args(argv)
        if argv[0] == "serve":
            load_settings(args, {})  # raises ConfigError on a bad value
