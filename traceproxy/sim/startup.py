"""Why a simulated deployment could not start, in one line, and which listener it was.

Theory of operation
-------------------
Every listener of the simulation is either bound in this process (the workers and
the prefill's bootstrap: aiohttp raises ``OSError``) or by the router child, which
cannot be asked which port it got: its port is chosen here, checked here
(``check_port_taken``) and, once the router answers, checked again to be the
child's own (``launch.RouterProcess``). A start that fails raises
``SimStartError``, whose text is one line a command can print as it is; the
router's log tail, when there is one, rides along in ``detail``.
"""

from __future__ import annotations

import errno
import socket


class SimStartError(RuntimeError):
    """The simulation could not start; ``str()`` is one line saying why."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(" ".join(message.split()))
        self.detail = detail


class ListenerError(SimStartError):
    """A listener (``prefill``, ``decode``, ``bootstrap``, ``router``) could not bind its address."""

    def __init__(self, listener: str, host: str, port: int, error: OSError) -> None:
        self.listener, self.host, self.port, self.error = listener, host, port, error
        self.taken = error.errno == errno.EADDRINUSE
        if self.taken:
            message = f"the {listener} port {port} on {host} is already in use by another process"
        else:
            reason = error.strerror or str(error) or type(error).__name__
            message = f"the {listener} cannot listen on {host}:{port}: {reason}"
        super().__init__(message)


def check_port_taken(listener: str, host: str, port: int) -> None:
    """Raise ``ListenerError`` if another process listens on ``host:port``.

    Probes as a listener binds: SO_REUSEADDR (a port in TIME_WAIT is free) and no
    SO_REUSEPORT (with it, the probe would bind beside another listener that set it
    too and call a taken port free). Every address the name resolves to is probed,
    IPv6 ones IPv6-only. Any other failure (a name that does not resolve, an address
    this host lacks) is left for the listener itself to report in its own words."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return
    for family, kind, proto, _, sockaddr in dict.fromkeys(infos):
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                probe.bind(sockaddr)
                probe.listen(1)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ListenerError(listener, host, port, exc) from None
