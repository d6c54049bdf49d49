"""The command line hands each subcommand the arguments its module declares."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import traceproxy.demo
from traceproxy.cli import main


def test_the_demo_gets_its_own_flags_from_the_command_line(monkeypatch):
    given = []
    monkeypatch.setattr(traceproxy.demo, "run_demo", lambda args: given.append(args) or 0)
    assert main(["demo", "--keep-running", "--scenario", "client-leaves"]) == 0
    assert [(args.keep_running, args.scenario) for args in given] == [(True, ["client-leaves"])]


SERVE_CHECK_AND_REPORT = textwrap.dedent("""
    import contextlib, io, sys
    from traceproxy.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        status = main(["serve", "--check", "--listen", "127.0.0.1:0", "--upstream", "http://127.0.0.1:9"])
    print(status, sorted(name for name in ("traceproxy.demo", "traceproxy.diagnose", "traceproxy.sim.command",
                                           "traceproxy.repro.command", "google.protobuf") if name in sys.modules))
""")


def test_serve_does_not_load_the_other_commands_or_protobuf():
    # Their arguments live in their modules, and diagnose and demo import protobuf and the
    # simulator: about 5 MB of every proxy process. In its own interpreter, since this one
    # has imported everything.
    result = subprocess.run([sys.executable, "-c", SERVE_CHECK_AND_REPORT], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "0 []"


def test_each_command_still_has_its_own_arguments(capsys):
    for command, flag in (("demo", "--scenario"), ("sim", "--router-port"), ("diagnose", "--spans"),
                          ("repro", "--turns")):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert flag in capsys.readouterr().out, command


def test_the_fast_upstream_on_a_taken_port_says_so_in_one_line():
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        result = subprocess.run([sys.executable, "-m", "traceproxy", "upstream", "--listen",
                                 f"127.0.0.1:{taken.getsockname()[1]}"], capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.startswith("traceproxy: stopped: ") and "address already in use" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
