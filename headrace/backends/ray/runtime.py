"""Ray, started or joined, with nothing sent out: usage stats off, no dashboard."""

from __future__ import annotations

import os
from typing import Any

from headrace.core.errors import ConfigError

INSTALL = "pip install 'headrace[ray]'"


def import_ray() -> Any:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # before the import: Ray reads it then
    try:
        import ray
    except ImportError:
        raise ConfigError(
            f"--cluster ray needs Ray, which is not installed here. Install the extra ({INSTALL}), or run in one "
            "process (--cluster none, the default)."
        ) from None
    return ray


def ensure_ray(address: str, num_cpus: int | None = None) -> bool:
    """Join or start Ray; True when this call started it (and so should stop it)."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    if address == "local":
        # loopback only: nothing on this machine's other interfaces, no outbound traffic
        ray.init(address="local", num_cpus=num_cpus, _node_ip_address="127.0.0.1", **options)
    else:
        ray.init(address=address, **options)
    return True
