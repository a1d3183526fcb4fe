"""Shared fixtures. Every test runs under pytest-timeout (pyproject sets the default), so a hang
fails instead of stalling CI; slow real-component tests are marked ``slow``."""
