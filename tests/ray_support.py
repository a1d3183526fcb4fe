"""One local Ray instance for every Ray test (each torch-loading actor costs ~0.5 GB)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def ray_instance():
    ray = pytest.importorskip("ray")
    from headrace.cluster.runtime import ensure_ray

    started = ensure_ray("local", num_cpus=4)
    yield ray
    if started:
        ray.shutdown()
