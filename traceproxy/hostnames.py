"""Host names as the resolver takes them, for every address the commands accept.

A leaf module (the standard library only), so that the simulator, which stands
apart from the proxy, checks its addresses the same way.
"""

from __future__ import annotations

import ipaddress
import re

# A DNS label: 1 to 63 characters, no hyphen at either end. Underscores are let
# through: names such as Docker Compose services (``sglang_router``) resolve in
# practice, though RFC 1123 does not allow them in host names.
_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def is_hostname(host: str) -> bool:
    """A name the resolver can take: an empty label (``127.0.0..1``) or one over 63
    characters would fail only at startup's lookup, as an encoding error."""
    name = host.removesuffix(".")  # a fully qualified name may end in a dot
    return 0 < len(name) <= 253 and all(_LABEL.fullmatch(label) for label in name.split("."))


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address. Other names are not resolved: that would be
    a side effect of reading the configuration."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
