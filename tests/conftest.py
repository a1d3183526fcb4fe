"""Shared fixtures. Every test runs under pytest-timeout (pyproject sets the default), so a hang
fails instead of stalling CI; slow real-component tests are marked ``slow``.

Nothing here changes the process for every test: a test registers its envs and schedulers for
itself (``registry.envs.temporarily(name, factory)``, ``registry.envs.scoped(name)``), and a run
that should back off faster from transient errors says so in its config
(``retry.backoff_initial_s``, ``retry.backoff_attempts``)."""

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing sent out, before any import of Ray


@pytest.fixture(scope="session")
def ray_instance():
    """One local Ray instance (loopback, no dashboard) for every --cluster ray test: each
    torch-loading actor costs ~0.5 GB, and starting Ray ~7 s."""
    ray = pytest.importorskip("ray")
    from headrace.cluster.runtime import ensure_ray

    started = ensure_ray("local", num_cpus=4)
    yield ray
    if started:
        ray.shutdown()
