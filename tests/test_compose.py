"""docker-compose.yml validates (Debian's docker-compose, no engine needed), and every
traceproxy command line in it parses with today's flags."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
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


def _project_installs() -> list[str]:
    """Each service's shell steps before it runs traceproxy, with the project installed."""
    text = " ".join((ROOT / "docker-compose.yml").read_text().split())
    return re.findall(r'sh -c "([^"]*?) && traceproxy ', text)


can_mount = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                               reason="needs root and unshare for a read-only bind mount")


@can_mount
def test_the_project_installs_from_the_read_only_mount_as_compose_does(tmp_path):
    steps = _project_installs()
    assert len(steps) >= 3 and all("/src" in step for step in steps)
    assert len(set(steps)) == 1, steps  # every service installs the project the same way
    source, mount, copy = tmp_path / "source", tmp_path / "src", tmp_path / "copy"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", "*.egg-info", "__pycache__", ".pytest_cache", ".benchmarks", "traceproxy-data"))
    mount.mkdir()
    pip = f"{sys.executable} -m pip install --dry-run --no-deps"
    step = steps[0].replace("/tmp/traceproxy", str(copy)).replace("/src", str(mount)).replace("pip install", pip)
    read_only = f"mount --bind {source} {mount} && mount -o remount,bind,ro {mount}"
    # The mount really is read-only: installing straight from it fails, as it did in compose.
    direct = subprocess.run(["unshare", "-m", "sh", "-c", f"{read_only} && {pip} -q {mount}"],
                            capture_output=True, text=True, timeout=180)
    assert direct.returncode != 0 and "Read-only file system" in direct.stdout + direct.stderr
    result = subprocess.run(["unshare", "-m", "sh", "-c", f"{read_only} && {step}"],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
