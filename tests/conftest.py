"""Shared fixtures. Every test runs under pytest-timeout (pyproject sets the default), so a hang
fails instead of stalling CI; slow real-component tests are marked ``slow``.

Nothing here changes the process for every test: a test registers its envs and schedulers for
itself (``registry.envs.temporarily(name, factory)``, ``registry.envs.scoped(name)``), and a run
that should back off faster from transient errors says so in its config
(``retry.backoff_initial_s``, ``retry.backoff_attempts``)."""
