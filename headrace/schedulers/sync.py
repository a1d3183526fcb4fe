"""``sync``: sample batch k with the weights of step k-1, train on the whole batch, one optim step.

Sampling and training never overlap; the ideal time per step is sampling + training.
"""

from headrace.schedulers.base import Scheduler


class SyncScheduler(Scheduler):
    """On-policy: batch k is sampled with step k-1's weights, then trained whole in one optim step."""

    name = "sync"
