"""Ports chosen for a process that must be told its port before it binds it."""

from __future__ import annotations

import socket

import pytest

from traceproxy import ports


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as text:
            first, last = map(int, text.read().split())
    except OSError:
        pytest.skip("the kernel's ephemeral port range cannot be read here")
    return first, last


def test_a_chosen_port_is_below_the_ephemeral_range_and_free():
    # Nothing binding port 0 or connecting out is handed a port below the ephemeral range,
    # so the port stays free until its owner binds it (a test suite beside it included).
    first, _ = _ephemeral_range()
    for _ in range(20):
        port = ports.free_port()
        assert 1024 <= port < first and port not in range(30000, 30003)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free: bound at once


def test_without_the_range_the_kernels_choice_is_taken(monkeypatch):
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", "/nonexistent/ip_local_port_range")
    port = ports.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
