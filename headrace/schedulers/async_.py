"""``async``: batch k is admitted once the learner has published step k − max_steps_off_policy,
so sampling runs ahead of training by a bounded number of steps. Batches train whole and
oldest first; staleness is bounded by admission, never by discarding finished rollouts
(discarding starves slow, hard problems). ``max_steps_off_policy=0`` is exactly ``sync``.
"""

from headrace.schedulers.base import Scheduler


class AsyncScheduler(Scheduler):
    """Off-policy by at most max_steps_off_policy: sampling runs ahead of training, batches train whole."""

    name = "async"

    def lag(self) -> int:
        return self.options.max_steps_off_policy
