"""The run's scheduler, made from its config: it is given the few numbers it reads
(``SchedulerOptions``), never the config."""

from __future__ import annotations

from typing import TYPE_CHECKING

from headrace.plugins import registry
from headrace.schedulers.base import Scheduler, SchedulerOptions

if TYPE_CHECKING:
    from headrace.run.config import RunConfig


def scheduler_options(config: RunConfig) -> SchedulerOptions:
    return SchedulerOptions(
        batch_size=config.batch_size,
        num_minibatches=config.num_minibatches,
        max_steps_off_policy=config.max_steps_off_policy,
        sampler=config.sampler or config.backend,
    )


def make_scheduler(config: RunConfig) -> Scheduler:
    """``config.scheduler``'s scheduler; it refuses options it cannot run (``check``) here."""
    scheduler: Scheduler = registry.schedulers.get(config.scheduler)(scheduler_options(config))
    return scheduler
