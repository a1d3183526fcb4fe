"""What a scheduler is: two numbers that change how the same actors are wired.

``lag``: batch k is admitted once the sampler holds weights of version k − lag (0: on-policy;
sampling never runs ahead of training). ``minibatches``: in how many ``forward_backward`` calls
the learner consumes a batch, each sent as soon as its groups are in (one optimizer step per
batch either way). ``headrace/run/graph.py`` shows where each number takes effect.

A scheduler of your own: subclass ``Scheduler``, override either number (and ``check`` to refuse
a config it cannot run), and register it, e.g. ``registry.schedulers.register("mine", Mine)``.
"""

from __future__ import annotations

from headrace.run.config import RunConfig


class Scheduler:
    name: str = ""

    def __init__(self, config: RunConfig):
        self.config = config
        self.check()

    def check(self) -> None:
        """Raise ``ConfigError`` for a config this scheduler cannot run (before any set-up)."""

    def lag(self) -> int:
        """Batch k may be sampled once the learner has published version k - lag."""
        return 0

    def minibatches(self) -> int:
        """forward_backward calls per step."""
        return 1
