"""AdmissionGate: feeds batches to the rollout workers, each only when the scheduler allows it.

Batch k is admitted once the sampler holds weights of version ≥ k − lag: lag 0 is on-policy
(sync, stream); lag m bounds staleness by admission (async) instead of discarding finished work.
"""

from __future__ import annotations

from headrace.engine.channel import Channel
from headrace.engine.rollout import RolloutItem
from headrace.engine.sampler import SamplerActor
from headrace.engine.types import GroupKey, RLDataset


class AdmissionGate:
    def __init__(self, dataset: RLDataset, outbox: Channel[RolloutItem], sampler: SamplerActor, steps: range, lag: int):
        self.dataset, self.outbox, self.sampler, self.steps, self.lag = dataset, outbox, sampler, steps, lag

    async def run(self) -> None:
        for batch in self.steps:
            await self.sampler.wait_for_version(batch - self.lag)
            builders = self.dataset.get_batch(batch % len(self.dataset))
            if not builders:
                raise ValueError(f"{type(self.dataset).__name__}.get_batch({batch}) returned no groups")
            for index, builder in enumerate(builders):
                await self.outbox.put(RolloutItem(GroupKey(batch, index), builder, len(builders)))
        self.outbox.close()
