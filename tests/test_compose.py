"""docker-compose.yml as compose and the containers' shell run it.

The file validates (Debian's docker-compose; no engine needed). Each service's
command is taken from compose's resolved configuration and run by a real sh, with
each program it starts replaced by one that records its arguments: the script must
run whole (no line of it run as a command of its own) and end by exec'ing its
program, with every flag. Each ``traceproxy serve`` passes ``serve --check`` with
the service's environment, and the services reach each other, and the published
ports reach them, at the addresses they listen on. The metrics profile's Prometheus
keeps exemplars and scrapes traceproxy's admin listener, and its Grafana is provisioned
with that Prometheus, Jaeger for the exemplars' trace ids, and the dashboard."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from traceproxy.cli import _parser
from traceproxy.config import listen_argument, load_settings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = shutil.which("docker-compose")
SH = shutil.which("sh")
pytestmark = pytest.mark.skipif(COMPOSE is None or SH is None,
                                reason="docker-compose is not installed (.ci/run installs it)")

# The programs the services' scripts run, each replaced by a recorder; a script that
# runs anything else fails with "not found", as a line cut off from its command does.
PROGRAMS = ("cp", "pip", "python", "traceproxy")
RECORD_VARIABLE = "COMPOSE_TEST_RECORD"
RECORDER = f"""#!{sys.executable}
import json, os, sys
with open(os.environ[{RECORD_VARIABLE!r}], "a") as record:
    record.write(json.dumps({{"pid": os.getpid(), "argv": [os.path.basename(sys.argv[0]), *sys.argv[1:]]}}) + "\\n")
"""


def _config(*profile: str) -> str:
    result = subprocess.run([COMPOSE, *profile, "config"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


PROFILES = ("--profile", "collector", "--profile", "metrics")  # each adds services, changes none


@pytest.mark.parametrize("profile, added", [
    ((), set()), (("--profile", "collector"), {"otel-collector", "traceproxy-fleet"}),
    (("--profile", "metrics"), {"prometheus", "grafana"})], ids=["default", "collector", "metrics"])
def test_compose_file_validates(profile, added):
    services = subprocess.run([COMPOSE, *profile, "config", "--services"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60).stdout.split()
    assert {"jaeger", "prefill", "decode", "router", "traceproxy"} | added <= set(services)
    assert "COLLECTOR_OTLP_ENABLED" in _config(*profile)


def _resolved(*profile: str) -> dict:
    """The file as compose resolves it (anchors, merge keys, folded blocks,
    interpolation), as data. Compose v2 prints it as JSON; Debian's v1 only as YAML,
    read here by the parser compose itself reads the file with, in its interpreter."""
    as_json = subprocess.run([COMPOSE, *profile, "config", "--format", "json"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
    if as_json.returncode == 0 and as_json.stdout.lstrip().startswith("{"):  # v1 prints its usage, status 0
        return json.loads(as_json.stdout)
    with open(COMPOSE, "rb") as script:
        first_line = script.readline(200)
    assert first_line.startswith(b"#!"), f"{COMPOSE} prints no JSON and is not a Python script"
    read = subprocess.run([*shlex.split(first_line[2:].decode()), "-c",
                           "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"],
                          input=_config(*profile), capture_output=True, text=True, timeout=60)
    assert read.returncode == 0, read.stderr
    return json.loads(read.stdout)


@dataclass
class Launch:
    """A service's command run as its container runs it, with its programs recorded."""

    argv: list[str]  # as compose hands it to the container
    environment: dict[str, str]
    returncode: int
    stderr: str
    calls: list[list[str]]  # each recorded program's arguments, in the order run
    program_replaced_the_shell: bool  # the last program ran in the shell's own process (exec)

    @property
    def program(self) -> list[str]:
        return self.calls[-1] if self.calls else []


@pytest.fixture(scope="module")
def services() -> dict:
    return _resolved(*PROFILES)["services"]


@pytest.fixture(scope="module")
def launches(services, tmp_path_factory) -> dict[str, Launch]:
    """Every service whose command is a sh script, run by a real sh."""
    folder = tmp_path_factory.mktemp("compose")
    programs = folder / "bin"
    programs.mkdir()
    for name in PROGRAMS:
        (programs / name).write_text(RECORDER)
        (programs / name).chmod(0o755)
    launched = {}
    for name, service in services.items():
        command = service.get("command") or []
        # A string command is split as a POSIX shell would (docker-py's shlex.split), a list taken as it is.
        argv = shlex.split(command) if isinstance(command, str) else list(command)
        if argv[:1] != ["sh"]:
            continue
        environment = {key: str(value) for key, value in (service.get("environment") or {}).items()
                       if value is not None}
        record = folder / f"{name}.jsonl"
        with subprocess.Popen([SH, *argv[1:]], stderr=subprocess.PIPE, text=True,
                              env={**environment, "PATH": str(programs), RECORD_VARIABLE: str(record)}) as proc:
            try:
                _, stderr = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
        calls = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
        launched[name] = Launch(argv, environment, proc.returncode, stderr, [call["argv"] for call in calls],
                                bool(calls) and calls[-1]["pid"] == proc.pid)
    return launched


_OPERATOR_CHARS = ";&|()<>\n"


def _commands(script: str) -> list[list[str]]:
    """The script's simple commands, split where sh ends one: at an operator (&&, ;,
    |, ...) and at a line break outside quotes."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=_OPERATOR_CHARS)
    lexer.whitespace, lexer.whitespace_split = " \t\r", True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token and all(char in _OPERATOR_CHARS for char in token):
            commands.append([])
        else:
            commands[-1].append(token)
    return [command for command in commands if command]


def test_every_script_runs_whole_and_ends_by_execing_its_program(launches):
    assert {"prefill", "decode", "router", "traceproxy", "traceproxy-fleet"} <= set(launches)
    for name, launch in launches.items():
        assert len(launch.argv) == 3 and launch.argv[1] == "-c", f"{name}: expected sh -c SCRIPT, got {launch.argv}"
        script = launch.argv[2]
        assert (launch.returncode, launch.stderr) == (0, ""), f"{name}: {script!r} -> {launch.stderr}"
        # A line after an exec'd program is never run, and says nothing: each command must have run.
        commands = _commands(script)
        assert len(launch.calls) == len(commands), f"{name}: {script!r}: {commands[len(launch.calls):]} never ran"
        assert launch.program_replaced_the_shell, f"{name}: sh does not exec {launch.program[:1]}, so " \
                                                  "the stop signal never reaches it"


@pytest.fixture(scope="module")
def checks(launches, tmp_path_factory) -> dict[str, tuple[list[str], subprocess.CompletedProcess]]:
    """``serve --check`` of every traceproxy serve command, in its service's environment."""
    folder = tmp_path_factory.mktemp("check")  # the container's working folder; nothing is written
    results = {}
    for name, launch in launches.items():
        if launch.program[:2] == ["traceproxy", "serve"]:
            argv = [*launch.program[1:], "--check"]
            results[name] = argv, subprocess.run(
                [sys.executable, "-m", "traceproxy", *argv], cwd=folder, capture_output=True, text=True, timeout=60,
                env={**launch.environment, "PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)})
    return results


def _effective(checks, name: str) -> dict[str, str]:
    """What the check says the service's traceproxy listens on, forwards to and writes to."""
    argv, result = checks[name]
    # (stderr may carry a warning that is this machine's, such as its open-file limit)
    assert result.returncode == 0, f"{name}: traceproxy {shlex.join(argv)} -> {result.stderr}"
    *lines, verdict = result.stdout.strip().splitlines()
    assert verdict == "traceproxy: configuration OK", result.stdout
    return dict(re.split(r"\s{2,}", line, maxsplit=1) for line in lines)


def test_every_traceproxy_serve_command_passes_check_with_its_environment(launches, checks):
    assert {"traceproxy", "traceproxy-fleet"} <= set(checks)
    for name in checks:
        effective = _effective(checks, name)
        # Spans go to the collector the service's environment names.
        endpoint = launches[name].environment["OTEL_EXPORTER_OTLP_ENDPOINT"]
        assert effective["spans"] == f"OTLP http/protobuf to {endpoint}/v1/traces", effective


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host.lower() == "localhost"


def _listeners_and_targets(launches, checks) -> tuple[dict[str, set], list[tuple[str, str, str]]]:
    """Each service's listening (host, port)s, and each URL a service is given to reach another."""
    listeners: dict[str, set] = {}
    targets: list[tuple[str, str, str]] = []
    for name, launch in launches.items():
        program = launch.program
        if program[:2] == ["traceproxy", "serve"]:
            effective = _effective(checks, name)
            admin = effective["admin"].removeprefix("http://")
            addresses = [listen_argument(effective["listen"]), *([listen_argument(admin)] if admin != "off" else [])]
            listeners[name] = {(address.host, address.port) for address in addresses}
            targets.append((name, "upstream", effective["upstream"]))
        elif program[:3] == ["traceproxy", "sim", "worker"]:
            args = _parser().parse_args(program[1:])
            listeners[name] = {args.listen}
            if args.prefill_url:
                targets.append((name, "--prefill-url", args.prefill_url))
        elif program[:3] == ["python", "-m", "sglang_router.launch_router"]:
            router = pytest.importorskip("sglang_router.launch_router").parse_router_args(program[3:])
            assert router.pd_disaggregation and router.prefill_urls and router.decode_urls, \
                f"{name}: the router is not in PD mode with its workers: {program}"
            listeners[name] = {(router.host, router.port), (router.prometheus_host, router.prometheus_port)}
            targets += [(name, "--prefill", url) for url, _bootstrap_port in router.prefill_urls]
            targets += [(name, "--decode", url) for url in router.decode_urls]
        else:
            pytest.fail(f"{name} runs {program}, which this test does not know how to read")
    return listeners, targets


def test_services_and_published_ports_reach_the_addresses_services_listen_on(services, launches, checks):
    listeners, targets = _listeners_and_targets(launches, checks)

    def reachable_ports(service: str) -> set[int]:
        """Ports another container (or the host, through a published port) can connect to."""
        return {port for host, port in listeners.get(service, ()) if not _is_loopback(host)}

    for name, what, url in targets:
        parts = urlsplit(url)
        assert parts.port in reachable_ports(parts.hostname), \
            f"{name} {what} {url}: no service {parts.hostname!r} listens there for other containers ({listeners})"
    for name, service in services.items():
        if name not in listeners:  # an image's own program (Jaeger): its ports are its own
            continue
        for published in service.get("ports", []):
            target = int(published["target"] if isinstance(published, dict) else str(published).split(":")[-1])
            assert target in reachable_ports(name), f"{name} publishes {target}, where it does not listen " \
                                                    f"on all interfaces ({sorted(listeners[name])})"


can_mount = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                               reason="needs root and unshare for a read-only bind mount")


@can_mount
def test_the_project_installs_from_the_read_only_mount_as_compose_does(launches, tmp_path):
    installs = {name: launch.calls[:-1] for name, launch in launches.items() if launch.program[:1] == ["traceproxy"]}
    assert len(installs) >= 3 and all("/src" in json.dumps(calls) for calls in installs.values()), installs
    assert len({json.dumps(calls) for calls in installs.values()}) == 1, installs  # each the same way
    source, mount, copy = tmp_path / "source", tmp_path / "src", tmp_path / "copy"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", "*.egg-info", "__pycache__", ".pytest_cache", ".benchmarks", "traceproxy-data"))
    mount.mkdir()
    pip = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps"]
    steps = []
    for call in next(iter(installs.values())):
        argv = [arg.replace("/tmp/traceproxy", str(copy)).replace("/src", str(mount)) for arg in call]
        steps.append(shlex.join([*pip, *argv[2:]] if argv[:2] == ["pip", "install"] else argv))
    read_only = f"mount --bind {source} {mount} && mount -o remount,bind,ro {mount}"
    # The mount really is read-only: installing straight from it fails, as it did in compose.
    direct = subprocess.run(["unshare", "-m", "sh", "-c", f"{read_only} && {shlex.join(pip)} -q {mount}"],
                            capture_output=True, text=True, timeout=180)
    assert direct.returncode != 0 and "Read-only file system" in direct.stdout + direct.stderr
    result = subprocess.run(["unshare", "-m", "sh", "-c", " && ".join([read_only, *steps])],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)")
_DURATION_UNIT = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}


def _compose_seconds(duration: str) -> float:
    """A compose duration ("35s", "1m30s") in seconds."""
    parts = _DURATION_PART.findall(duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a compose duration: {duration!r}"
    return sum(float(number) * _DURATION_UNIT[unit] for number, unit in parts)


def test_a_stop_gives_traceproxy_its_shutdown_grace_before_compose_kills_it(services, launches):
    """docker-compose stop waits stop_grace_period (10 s by default) after SIGTERM, then
    SIGKILLs: shorter than the proxy's shutdown grace, streams in flight would be cut."""
    serving = {name: launch for name, launch in launches.items() if launch.program[:2] == ["traceproxy", "serve"]}
    assert serving
    for name, launch in serving.items():
        settings = load_settings(_parser().parse_args(launch.program[1:]), launch.environment)
        waited = _compose_seconds(str(services[name].get("stop_grace_period", "10s")))
        assert waited > settings.timeouts.shutdown_grace, (name, waited, settings.timeouts.shutdown_grace)


# ----------------------------------------------------------------------------------
# The metrics profile: Prometheus with exemplars, Grafana with the dashboard and Jaeger
# ----------------------------------------------------------------------------------
def _mounts(service: dict) -> dict[str, Path]:
    """Each bind mount's target in the container -> its source on the host."""
    mounts = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            source, target = volume["source"], volume["target"]
        else:
            source, target = str(volume).split(":")[:2]
        mounts[target] = Path(source)
    return mounts


def _in_container(mounts: dict[str, Path], path: str) -> Path:
    """The host file behind ``path`` in the container, through its bind mounts."""
    for target, source in sorted(mounts.items(), key=lambda item: -len(item[0])):
        if path == target or path.startswith(target.rstrip("/") + "/"):
            return source / path[len(target):].lstrip("/")
    pytest.fail(f"{path} is not mounted: {sorted(mounts)}")


def _yaml(path: Path):
    yaml = pytest.importorskip("yaml", reason="compose's own YAML parser reads these files")
    return yaml.safe_load(path.read_text())


def test_prometheus_keeps_exemplars_and_scrapes_the_admin_listener(services, launches, checks):
    prometheus = services["prometheus"]
    command = prometheus["command"]
    assert "--enable-feature=exemplar-storage" in command
    config_path = next(arg.split("=", 1)[1] for arg in command if arg.startswith("--config.file="))
    config = _yaml(_in_container(_mounts(prometheus), config_path))
    targets = [target for job in config["scrape_configs"] for static in job["static_configs"]
               for target in static["targets"]]
    listeners, _ = _listeners_and_targets(launches, checks)
    admin = listen_argument(_effective(checks, "traceproxy")["admin"].removeprefix("http://"))
    assert f"traceproxy:{admin.port}" in targets and not _is_loopback(admin.host)
    for target in targets:
        host, _, port = target.rpartition(":")
        assert (host in listeners and any(p == int(port) and not _is_loopback(h) for h, p in listeners[host])), \
            f"Prometheus scrapes {target}, where no service listens for other containers"


def test_grafana_is_provisioned_with_prometheus_jaeger_and_the_dashboard(services):
    grafana = services["grafana"]
    mounts = _mounts(grafana)
    provisioning = _in_container(mounts, "/etc/grafana/provisioning")
    sources = {source["uid"]: source for path in (provisioning / "datasources").glob("*.yaml")
               for source in _yaml(path)["datasources"]}
    by_type = {source["type"]: source for source in sources.values()}
    # Prometheus listens on 9090 unless told otherwise; Jaeger's query UI and API on 16686.
    assert "--web.listen-address" not in " ".join(services["prometheus"]["command"])
    assert by_type["prometheus"]["url"] == "http://prometheus:9090"
    assert by_type["jaeger"]["url"] == "http://jaeger:16686" and "jaeger" in services
    destinations = by_type["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert {"name": "trace_id", "datasourceUid": by_type["jaeger"]["uid"]} in destinations
    providers = [provider for path in (provisioning / "dashboards").glob("*.yaml")
                 for provider in _yaml(path)["providers"]]
    dashboards = [_in_container(mounts, provider["options"]["path"]) for provider in providers]
    files = [path for folder in dashboards for path in folder.glob("*.json")]
    assert files, f"no dashboard in {dashboards}"
    for path in files:
        dashboard = json.loads(path.read_text())
        used = {panel["datasource"]["uid"] for panel in dashboard["panels"] if "datasource" in panel}
        assert used <= set(sources), f"{path.name} uses data sources Grafana is not given: {used - set(sources)}"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert _in_container(mounts, home) in files
