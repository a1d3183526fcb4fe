"""Shared fixtures. Every test runs under pytest-timeout (pyproject sets the default), so a hang
fails instead of stalling CI; slow real-component tests are marked ``slow``."""

from __future__ import annotations

import pytest

from headrace.engine import retry


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    """Transient-error backoff in milliseconds, not seconds."""
    monkeypatch.setitem(retry.RETRY_POLICY, "initial", 0.001)
    monkeypatch.setitem(retry.RETRY_POLICY, "max", 0.01)
