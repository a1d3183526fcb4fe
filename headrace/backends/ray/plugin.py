"""The Ray cluster as headrace finds it (``headrace.backends`` entry point, kind ``cluster``:
``--cluster ray``); imports no Ray."""

from __future__ import annotations

from headrace.core.protocols import BackendPlugin

from .config import RayConfig

plugin = BackendPlugin(
    "ray",
    RayConfig,
    "headrace.backends.ray.backend:make_backend",
    kind="cluster",
    description="the training backend's rollout workers, sampler replicas and learner in Ray actors",
)
