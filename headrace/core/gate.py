"""AdmissionGate: feeds batches to the rollout workers, each only when the scheduler allows it.

Batch k is admitted once the sampler holds weights of version ≥ k − lag: lag 0 is on-policy
(sync, stream); lag m bounds staleness by admission (async) instead of discarding finished work.
"""

from __future__ import annotations

from typing import Any

from headrace.core.channel import Channel
from headrace.core.episode import EnvContractError
from headrace.core.errors import ConfigError
from headrace.core.rollout import RolloutItem
from headrace.core.sampler import SamplerActor
from headrace.core.types import GroupKey, RLDataset


def check_dataset(dataset: Any, source: str) -> RLDataset:
    """Refuse a dataset the gate could never draw a batch from, before the run starts."""
    if dataset is None or not callable(getattr(dataset, "get_batch", None)) or not hasattr(dataset, "__len__"):
        raise ConfigError(
            f"{source} gave {type(dataset).__name__} as its dataset; an env factory must return a headrace.RLDataset "
            "(e.g. a ProblemDataset), with get_batch(index) and __len__"
        )
    if len(dataset) <= 0:
        raise ConfigError(
            f"{source} gave an empty dataset ({type(dataset).__name__} has no batches); give it one or more"
        )
    return dataset


class AdmissionGate:
    def __init__(self, dataset: RLDataset, outbox: Channel[RolloutItem], sampler: SamplerActor, steps: range, lag: int):
        self.dataset = check_dataset(dataset, "train(dataset=...)")
        self.outbox, self.sampler, self.steps, self.lag = outbox, sampler, steps, lag

    async def run(self) -> None:
        for batch in self.steps:
            await self.sampler.wait_for_version(batch - self.lag)
            builders = self.dataset.get_batch(batch % len(self.dataset))
            if not builders:
                raise EnvContractError(
                    f"{type(self.dataset).__name__}.get_batch({batch % len(self.dataset)}) returned {builders!r:.40}; "
                    "every batch needs at least one group"
                )
            for index, builder in enumerate(builders):
                await self.outbox.put(RolloutItem(GroupKey(batch, index), builder, len(builders)))
        self.outbox.close()
