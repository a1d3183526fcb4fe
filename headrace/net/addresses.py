"""Whether an address stays on this machine (what may listen or connect without a token)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """``localhost``, or an IP address in 127.0.0.0/8 or ::1; a name or a routable address is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
