"""AdvantageActor: a finished group's advantages, the constant-group filter and its datums.

(Rewards are computed in the rollout actor, with the group; dropped groups pass through, counted.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from headrace.core.advantages import NonFiniteError, group_advantages, is_constant
from headrace.core.channel import Channel
from headrace.core.datums import trajectory_to_datums
from headrace.core.rollout import RolloutResult
from headrace.core.types import Datum, DroppedGroup, GroupKey, Metrics, Trajectory


@dataclass(frozen=True)
class ProcessedGroup:
    """What the learner consumes: one group's datums (possibly none) and its figures."""

    key: GroupKey  # where it stands in the dataset: (batch, index)
    step: int  # the training step it goes to: its batch's, or the one the inflight ledger gave it
    batch_size: int  # groups in that step
    datums: list[Datum]
    status: str  # "trained" | "filtered" | "dropped"
    policy_version: int
    rewards_G: list[float] = field(default_factory=list)
    metrics: Metrics = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    action_tokens: int = 0
    num_trajectories: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    # staleness from the data: (oldest token's version, action tokens) per trajectory, and
    # action tokens per version over the group
    trajectory_versions: list[tuple[int, int]] = field(default_factory=list)
    token_versions: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class AdvantageSettings:
    normalize_std: bool
    filter_constant: bool


# (step, [(key, trajectories, rewards, advantages or None)]): what a run does with a sample of
# each step's rollouts (the run dir's rollouts/ files); it must not raise
SampleSink = Callable[[int, list[tuple[GroupKey, list[Trajectory], list[float], list[float] | None]]], object]


class AdvantageActor:
    def __init__(
        self,
        inbox: Channel[RolloutResult],
        outbox: Channel[ProcessedGroup],
        settings: AdvantageSettings,
        samples: SampleSink | None = None,
    ):
        self.inbox, self.outbox, self.settings, self.samples = inbox, outbox, settings, samples

    async def run(self) -> None:
        async for result in self.inbox:
            await self.outbox.put(self.process(result))
        self.outbox.close()

    def process(self, result: RolloutResult) -> ProcessedGroup:
        group, item = result.group, result.item
        if isinstance(group, DroppedGroup):
            return ProcessedGroup(
                group.key,
                group.key.batch,
                item.batch_size,
                [],
                "dropped",
                -1,
                seconds=result.seconds,
                errors=group.errors,
            )
        trajectories = group.trajectories_G
        processed = partial(
            ProcessedGroup,
            key=group.key,
            step=group.key.batch,
            batch_size=item.batch_size,
            policy_version=group.policy_version,
            rewards_G=group.rewards_G,
            metrics=group.metrics,
            tags=group.tags,
            action_tokens=sum(t.num_action_tokens for t in trajectories),
            num_trajectories=len(trajectories),
            seconds=result.seconds,
            trajectory_versions=[(t.policy_version, t.num_action_tokens) for t in trajectories],
            token_versions=_count_versions(trajectories),
        )
        if self.settings.filter_constant and is_constant(group.rewards_G):
            if self.samples:
                self.samples(group.key.batch, [(group.key, trajectories, group.rewards_G, None)])
            return processed(datums=[], status="filtered")
        try:
            advantages = group_advantages(group.rewards_G, self.settings.normalize_std)
        except NonFiniteError as e:
            tags = f" ({', '.join(group.tags)})" if group.tags else ""
            raise NonFiniteError(f"group {group.key.index} of batch {group.key.batch}{tags}: {e}") from None
        datums = [d for t, a in zip(trajectories, advantages, strict=True) for d in trajectory_to_datums(t, a)]
        if self.samples:
            self.samples(group.key.batch, [(group.key, trajectories, group.rewards_G, advantages)])
        return processed(datums=datums, status="trained")


def _count_versions(trajectories: list[Trajectory]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for t in trajectories:
        for version, n in t.version_counts().items():
            counts[version] = counts.get(version, 0) + n
    return counts
