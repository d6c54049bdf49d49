"""Ports for a process that must be told its port before it binds it (a router, a test
upstream, the simulated workers' peers).

A leaf module (the standard library only), shared by the simulator and the bench.

Hazard: between choosing a port and its owner binding it, anything else may take it.
A port the kernel hands out for ``bind(("127.0.0.1", 0))`` or an outgoing connection
comes from its ephemeral range, which every other program on the machine draws from
all the time (a test suite, thousands of times a second). So the port is chosen below
that range, where the kernel never assigns one by itself: only another program that
names that very port can take it. Where the range cannot be read (not Linux), the
kernel's own choice is taken.
"""

from __future__ import annotations

import random
import socket

_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_SPAN = 10_000  # how many ports below the ephemeral range are drawn from
_ATTEMPTS = 64
# Ports the stack's own defaults use (SGLang's server and router, a prefill beside it):
# a port chosen for a moment must not stand where a user will start one of those.
_KEPT_FOR_DEFAULTS = frozenset(range(30000, 30003))
_random = random.Random()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, from below the kernel's ephemeral range when it can be read."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    lowest, highest = _below_ephemeral()
    for _ in range(_ATTEMPTS if highest >= lowest else 0):
        port = _random.randint(lowest, highest)
        if port not in _KEPT_FOR_DEFAULTS and _bindable(family, host, port):
            return port
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _below_ephemeral() -> tuple[int, int]:
    """The ports drawn from: the _SPAN below the ephemeral range, above the privileged ones;
    an empty range when the ephemeral one cannot be read."""
    try:
        with open(_EPHEMERAL_RANGE) as text:
            first = int(text.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 1, 0
    return max(1024, first - _SPAN), first - 1


def _bindable(family: int, host: str, port: int) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
