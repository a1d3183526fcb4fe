"""What a scheduler is: a few choices that change how the same actors are wired.

``lag``: batch k is admitted once the sampler holds weights of version k − lag (0: on-policy;
sampling never runs ahead of training). ``minibatches``: in how many ``forward_backward`` calls
the learner consumes a batch, each sent as soon as its groups are in (one optimizer step per
batch either way). ``admission``: ``"batch"`` (the dataset's batch k trains at step k) or
``"sample"`` (group by group, finished groups given to steps by deadline: ``inflight``).
``swap_in_flight``: the sampler takes new weights during a generation. ``check_backend`` refuses
a sampler the scheduler cannot run on. ``headrace/run/graph.py`` shows where each takes effect.

A scheduler of your own: subclass ``Scheduler``, override either number (and ``check`` to refuse
options it cannot run), and register it, e.g. ``registry.schedulers.register("mine", Mine)``. It
is given ``SchedulerOptions``, the few numbers of the run it reads, never the run's config.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerOptions:
    """What a scheduler reads of the run (``headrace/run/scheduling.py`` takes it from the config)."""

    batch_size: int = 32  # groups per step
    num_minibatches: int = 4  # stream: forward_backward calls per step
    max_steps_off_policy: int = 1  # async, inflight: how far sampling may run ahead
    sampler: str = "sim"  # the sampling backend's name (--sampler, else --backend), for messages


class Scheduler:
    name: str = ""
    # admission "sample" only: what to do with a running group about to pass its staleness
    # bound, "hold" (the learner waits for it) or "regenerate" (restart it with current weights)
    overdue: str = "hold"

    def __init__(self, options: SchedulerOptions):
        self.options = options
        self.check()

    def check(self) -> None:
        """Raise ``ConfigError`` for options this scheduler cannot run (before any set-up)."""

    def lag(self) -> int:
        """Batch k may be sampled once the learner has published version k - lag."""
        return 0

    def minibatches(self) -> int:
        """forward_backward calls per step."""
        return 1

    def admission(self) -> str:
        """``"batch"`` or ``"sample"`` (see the module docstring)."""
        return "batch"

    def swap_in_flight(self) -> bool:
        """Whether running generations take new weights as they are published."""
        return False

    def check_backend(self, sampling: object) -> None:
        """Raise ``ConfigError`` for a sampling backend this scheduler cannot run on."""
