"""``stream``: on-policy like ``sync``, but the learner starts a ``forward_backward`` on each
minibatch as soon as its groups are in, so training overlaps the batch's slowest rollouts.
One optim step per batch (gradients accumulate across minibatches).
"""

from headrace.run.graph import Scheduler


class StreamScheduler(Scheduler):
    name = "stream"

    def minibatches(self) -> int:
        return self.config.num_minibatches
