"""The run's backend, built from its ``RunConfig``: the plugins it names (``--backend``,
``--sampler``, ``--cluster``), each given its own section and a ``BackendContext``, never the
whole config (``headrace/plugins/backends.py`` finds and builds them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from headrace.core.protocols import Backend, BackendContext, BackendPlugin, InnerBackend
from headrace.plugins.backends import build, checked
from headrace.run.scheduling import make_scheduler

if TYPE_CHECKING:
    from headrace.run.config import RunConfig
    from headrace.schedulers.base import Scheduler

__all__ = ["check", "context", "make_backend"]


def context(
    config: RunConfig, scheduler: Scheduler | None = None, resume_checkpoint: tuple[int, str] | None = None
) -> BackendContext:
    """The run-wide facts a backend may read. ``scheduler``: the run's (made from the config when
    not given); ``resume_checkpoint``: the run directory's latest checkpoint, when resuming."""
    scheduler = scheduler if scheduler is not None else make_scheduler(config)
    lag = scheduler.lag()
    return BackendContext(
        model=config.model,
        seed=config.seed,
        run_dir=config.run_dir,
        resume=config.resume,
        sampling=config.sampling.params(),
        group_size=config.group_size,
        # as run/graph.py sizes the rollout actor: every batch the gate may admit, unless capped
        max_concurrent_rollouts=config.rollout_workers or max(config.batch_size * (lag + 1), 1),
        resume_checkpoint=resume_checkpoint,
        lag=lag,
        swap_in_flight=scheduler.swap_in_flight(),
    )


def check(config: RunConfig) -> tuple[BackendPlugin, BackendPlugin | None, BackendPlugin | None]:
    """The run's training backend, sampler and cluster, checked (names, kinds, installed modules)
    before anything is built: a wrong pick is one clear error, not a failure deep in set-up."""
    training = checked(config.backend, "training")
    sampler = checked(config.sampler, "sampler") if config.sampler else None
    cluster = checked(config.cluster.kind, "cluster") if config.cluster.kind != "none" else None
    return training, sampler, cluster


def make_backend(
    config: RunConfig, *, scheduler: Scheduler | None = None, resume_checkpoint: tuple[int, str] | None = None
) -> Backend:
    """The run's backend: ``--backend``'s, with its sampling on ``--sampler``'s if one is named,
    and its parts placed by ``--cluster``'s if one is named."""
    training, sampler, cluster = check(config)
    ctx = context(config, scheduler, resume_checkpoint)
    if cluster is not None:
        inner = [InnerBackend(p.name, config.section(p.name).model_dump()) if p else None for p in (training, sampler)]
        backend: Backend = build(cluster, config.section(cluster.name), ctx, *inner)
        return backend
    backend = build(training, config.section(training.name), ctx)
    if sampler is not None:
        backend = build(sampler, config.section(sampler.name), ctx, backend)
    return backend
