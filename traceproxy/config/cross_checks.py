"""Rules between keys, checked once every key is parsed: each error names both keys
and where each value came from. They read only the values: no name is resolved and
nothing is bound (whether a port is free shows when serve binds it)."""

from __future__ import annotations

import ipaddress
import socket
from typing import TYPE_CHECKING, Any

from ..hostnames import is_loopback
from .addresses import HostPort
from .errors import ConfigError

if TYPE_CHECKING:
    from .sections import Raw


def _check_admin_exposure(admin: HostPort | None, admin_public: bool, source: str) -> None:
    if admin is None or admin_public or is_loopback(admin.host):
        return
    raise ConfigError(
        f"admin = {str(admin)!r} (from {source}): {admin.host} is not a loopback address; expected a "
        "loopback HOST:PORT (127.0.0.1, [::1] or localhost) or off, or set admin_public = true"
    )


def _check_shared_ports(values: dict[str, Any], raw: Raw) -> None:
    """Workers share their ports through SO_REUSEPORT, which needs one known port:
    with port 0 each worker would be given a different one."""
    if values["workers"] <= 1:
        return
    for key in ("listen", "admin"):
        address = values[key]
        if address is not None and address.port == 0:
            raise ConfigError(
                f"{key} = {str(address)!r} (from {raw[key][1]}): port 0 picks a free port per process, so "
                f"the {values['workers']} workers (from {raw['workers'][1]}) would not share one; expected "
                "a fixed port with workers > 1"
            )


def _bound_addresses(host: str) -> set:
    """The addresses a listener on ``host`` binds, as far as is known without a lookup:
    an IP in any spelling inet_aton takes (127.1, 0), a zone kept only where it tells
    addresses apart (link-local), and localhost as both loopbacks. Another name is
    compared by name; a clash through it shows when the ports are bound (see
    app._check_port_bindable), where resolving it costs nothing extra."""
    name = host.lower()
    if name == "localhost":
        return {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if ":" in host:
            return {name}
        try:
            return {ipaddress.ip_address(socket.inet_ntoa(socket.inet_aton(host)))}
        except OSError:
            return {name}
    if address.version == 6 and address.scope_id and not address.is_link_local:
        address = ipaddress.ip_address(host.partition("%")[0])
    return {address}


def _overlap(a, b) -> bool:
    """Two bound addresses take the same connections: equal, or one is the wildcard of
    the other's family (IPv6 listeners are IPv6-only, so :: does not cover IPv4)."""
    if a == b:
        return True
    if isinstance(a, str) or isinstance(b, str) or a.version != b.version:
        return False
    return a.is_unspecified or b.is_unspecified


def _check_distinct_ports(values: dict[str, Any], raw: Raw) -> None:
    """The proxy and the admin listener on one address: with workers > 1 (SO_REUSEPORT)
    both would bind and the kernel would split connections between them."""
    listen, admin = values["listen"], values["admin"]
    if admin is None or admin.port == 0 or admin.port != listen.port:
        return
    if any(_overlap(a, b) for a in _bound_addresses(admin.host) for b in _bound_addresses(listen.host)):
        raise ConfigError(
            f"admin = {str(admin)!r} (from {raw['admin'][1]}) is the listen address {str(listen)!r} (from "
            f"{raw['listen'][1]}); expected another port for the admin listener, or off"
        )


def _reaches(destination, listener) -> bool:
    """A connection to ``destination`` lands on a listener bound to ``listener``, as far
    as is known without a lookup: the same address, a loopback or unspecified destination
    (which the kernel sends to this host) at a wildcard or loopback listener, and the
    same name. A specific address at a wildcard listener may be this host's or another's:
    not judged."""
    if destination == listener:
        return True
    if isinstance(destination, str) or isinstance(listener, str) or destination.version != listener.version:
        return False
    local = destination.is_loopback or destination.is_unspecified
    return local and (listener.is_unspecified or listener.is_loopback and destination.is_unspecified)


def _check_upstream_not_self(values: dict[str, Any], raw: Raw) -> None:
    """An upstream that is the proxy's own listener sends every request back in, until
    the pool is full and every client waits: refused at startup rather than found then."""
    upstream = values["upstream"]
    for key in ("listen", "admin"):
        address = values[key]
        if address is None or address.port != upstream.port:
            continue
        if any(_reaches(u, a) for u in _bound_addresses(upstream.host) for a in _bound_addresses(address.host)):
            raise ConfigError(
                f"upstream = {str(upstream)!r} (from {raw['upstream'][1]}) is this proxy's own {key} address "
                f"{str(address)!r} (from {raw[key][1]}); expected the router's or engine's address"
            )


def check_between_keys(values: dict[str, Any], raw: Raw) -> None:
    """``values``: every key parsed, by dotted name; ``raw``: what each came from."""
    _check_admin_exposure(values["admin"], values["admin_public"], raw["admin"][1])
    _check_shared_ports(values, raw)
    _check_distinct_ports(values, raw)
    _check_upstream_not_self(values, raw)
