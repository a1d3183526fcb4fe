"""``stream``: on-policy like ``sync``, but the learner starts a ``forward_backward`` on each
minibatch as soon as its groups are in, so training overlaps the batch's slowest rollouts.
One optim step per batch (gradients accumulate across minibatches).
"""

from headrace.core.errors import ConfigError
from headrace.schedulers.base import Scheduler


class StreamScheduler(Scheduler):
    """On-policy, with a forward_backward per minibatch as soon as its groups are in (overlaps the slowest rollouts)."""

    name = "stream"

    def check(self) -> None:
        batch, minibatches = self.options.batch_size, self.options.num_minibatches
        if batch % minibatches:
            raise ConfigError(
                f"invalid configuration: batch_size={batch} does not split into num_minibatches={minibatches}; "
                "pick a batch size that is a multiple of the number of minibatches"
            )

    def minibatches(self) -> int:
        return self.options.num_minibatches
