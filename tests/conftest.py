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

    # its workers inherit the environment it starts with: the test verifiers environments
    # (tests/verifiers_envs) importable there, as a user's installed ones would be
    given = os.environ.get("PYTHONPATH")
    envs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verifiers_envs")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (envs, given) if p)
    try:
        ensure_ray("local", num_cpus=4)
    finally:
        if given is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = given
    yield ray
    if ray.is_initialized():
        ray.shutdown()


_LAST_RAY_TEST: list[pytest.Item] = []

# a test marked with one of these needs that package: skipped, saying how to get it, where it is missing
NEEDS = {
    "vllm": ("vllm", "vLLM is not installed (pip install 'headrace[vllm]'; CPU: headrace/backends/vllm/README.md)"),
    "ray": ("ray", "Ray is not installed (pip install 'headrace[ray]')"),
    "tinker": ("tinker", "the tinker SDK is not installed (pip install 'headrace[tinker]')"),
}


# `make test` runs the suite on one pytest worker per core (pytest-xdist), then the tests marked
# `serial` on their own: a vLLM engine claims ~5 GB of the machine's memory when it starts and
# refuses to start with less free, and the Ray tests share one local instance (some start vLLM
# replicas in it). xdist's own `xdist_group` cannot say this: it renames a test's node id, which
# pytest 9 no longer reads.
def pytest_itemcollected(item):
    engines = any(item.get_closest_marker(m) is not None for m in ("vllm", "ray"))
    if engines or "ray_instance" in getattr(item, "fixturenames", ()):
        item.add_marker(pytest.mark.serial)


def pytest_collection_modifyitems(config, items):
    users = [item for item in items if "ray_instance" in getattr(item, "fixturenames", ())]
    _LAST_RAY_TEST[:] = users[-1:]
    missing = {marker: reason for marker, (module, reason) in NEEDS.items() if importlib.util.find_spec(module) is None}
    for item in items:
        for marker, reason in missing.items():
            if item.get_closest_marker(marker) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
                break


def pytest_runtest_teardown(item, nextitem):
    if _LAST_RAY_TEST and item is _LAST_RAY_TEST[0]:
        import sys

        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()


# A test's figure (`record_property("figure", text)`: a ratio CI should show, such as the engine's
# overhead) is printed in the run's summary; a worker's own stdout never reaches the terminal.
_FIGURES: list[str] = []


def pytest_runtest_logreport(report):
    if report.when == "call":
        _FIGURES.extend(str(value) for name, value in report.user_properties if name == "figure")


def pytest_terminal_summary(terminalreporter):
    if _FIGURES:
        terminalreporter.section("figures")
        for line in _FIGURES:
            terminalreporter.write_line(line)
