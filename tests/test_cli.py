"""The command line hands each subcommand the arguments its module declares."""

from __future__ import annotations

import traceproxy.demo
from traceproxy.cli import main


def test_the_demo_gets_its_own_flags_from_the_command_line(monkeypatch):
    given = []
    monkeypatch.setattr(traceproxy.demo, "run_demo", lambda args: given.append(args) or 0)
    assert main(["demo", "--keep-running", "--scenario", "client-leaves"]) == 0
    assert [(args.keep_running, args.scenario) for args in given] == [(True, ["client-leaves"])]
