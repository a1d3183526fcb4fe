"""Shared fixtures. Every test runs under pytest-timeout (pyproject sets the default), so a hang
fails instead of stalling CI; slow real-component tests are marked ``slow``.

Nothing here changes the process for every test: a test registers its envs and schedulers for
itself (``registry.envs.temporarily(name, factory)``, ``registry.envs.scoped(name)``), and a run
that should back off faster from transient errors says so in its config
(``retry.backoff_initial_s``, ``retry.backoff_attempts``)."""

import importlib.util
import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing sent out, before any import of Ray
# no test may download: offline, the Hub client fails at once instead of retrying for ~25 s
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def ray_instance():
    """One local Ray instance (loopback, no dashboard) for every --cluster ray test: each
    torch-loading actor costs ~0.5 GB, and starting Ray ~7 s. It is stopped after the last test
    that uses it (``pytest_runtest_teardown``), not at the end of the session: its processes would
    take memory and CPU from every test after it."""
    ray = pytest.importorskip("ray")
    from headrace.backends.ray.runtime import ensure_ray

    ensure_ray("local", num_cpus=4)
    yield ray
    if ray.is_initialized():
        ray.shutdown()


_LAST_RAY_TEST: list[str] = []


# a test marked with one of these needs that package: skipped, saying how to get it, where it is missing
NEEDS = {
    "vllm": ("vllm", "vLLM is not installed (pip install 'headrace[vllm]'; CPU: headrace/backends/vllm/README.md)"),
    "ray": ("ray", "Ray is not installed (pip install 'headrace[ray]')"),
    "tinker": ("tinker", "the tinker SDK is not installed (pip install 'headrace[tinker]')"),
}


def pytest_collection_modifyitems(config, items):
    users = [item.nodeid for item in items if "ray_instance" in getattr(item, "fixturenames", ())]
    _LAST_RAY_TEST[:] = users[-1:]
    missing = {marker: reason for marker, (module, reason) in NEEDS.items() if importlib.util.find_spec(module) is None}
    for item in items:
        for marker, reason in missing.items():
            if item.get_closest_marker(marker) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
                break


def pytest_runtest_teardown(item, nextitem):
    if _LAST_RAY_TEST and item.nodeid == _LAST_RAY_TEST[0]:
        import sys

        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()
