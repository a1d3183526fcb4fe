"""RewardActor: advantages, the constant-group filter, datum assembly, and the dropped-group count."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from headrace.core.advantages import NonFiniteError, group_advantages, is_constant
from headrace.core.channel import Channel
from headrace.core.datums import trajectory_to_datums
from headrace.core.rollout import RolloutResult
from headrace.core.types import Datum, DroppedGroup, GroupKey, Metrics, Trajectory


class TooManyDroppedGroups(RuntimeError):
    """The run keeps losing whole groups: something is broken, stop instead of spinning."""


@dataclass(frozen=True)
class ProcessedGroup:
    """What the learner consumes: one group's datums (possibly none) and its figures."""

    key: GroupKey
    batch_size: int
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


@dataclass(frozen=True)
class AdvantagePolicy:
    normalize_std: bool
    filter_constant: bool
    max_consecutive_dropped: int


# (step, [(key, trajectories, rewards, advantages or None)]): what a run does with a sample of
# each step's rollouts (the run dir's rollouts/ files); it must not raise
SampleSink = Callable[[int, list[tuple[GroupKey, list[Trajectory], list[float], list[float] | None]]], object]


class RewardActor:
    def __init__(
        self,
        inbox: Channel[RolloutResult],
        outbox: Channel[ProcessedGroup],
        policy: AdvantagePolicy,
        samples: SampleSink | None = None,
    ):
        self.inbox, self.outbox, self.policy, self.samples = inbox, outbox, policy, samples
        self.consecutive_dropped = 0

    async def run(self) -> None:
        async for result in self.inbox:
            await self.outbox.put(self.process(result))
        self.outbox.close()

    def process(self, result: RolloutResult) -> ProcessedGroup:
        group, item = result.group, result.item
        if isinstance(group, DroppedGroup):
            self.consecutive_dropped += 1
            if self.consecutive_dropped >= self.policy.max_consecutive_dropped:
                raise TooManyDroppedGroups(
                    f"{self.consecutive_dropped} groups in a row were dropped after spending their retry budget "
                    f"(last errors: {'; '.join(group.errors[-3:])}). Fix the env or the backend, or raise "
                    "retry.budget / retry.max_consecutive_dropped."
                )
            return ProcessedGroup(
                group.key, item.batch_size, [], "dropped", -1, seconds=result.seconds, errors=group.errors
            )
        self.consecutive_dropped = 0
        trajectories = group.trajectories_G
        processed = partial(
            ProcessedGroup,
            key=group.key,
            batch_size=item.batch_size,
            policy_version=group.policy_version,
            rewards_G=group.rewards_G,
            metrics=group.metrics,
            tags=group.tags,
            action_tokens=sum(t.num_action_tokens for t in trajectories),
            num_trajectories=len(trajectories),
            seconds=result.seconds,
        )
        if self.policy.filter_constant and is_constant(group.rewards_G):
            if self.samples:
                self.samples(group.key.batch, [(group.key, trajectories, group.rewards_G, None)])
            return processed(datums=[], status="filtered")
        try:
            advantages = group_advantages(group.rewards_G, self.policy.normalize_std)
        except NonFiniteError as e:
            tags = f" ({', '.join(group.tags)})" if group.tags else ""
            raise NonFiniteError(f"group {group.key.index} of batch {group.key.batch}{tags}: {e}") from None
        datums = [d for t, a in zip(trajectories, advantages, strict=True) for d in trajectory_to_datums(t, a)]
        if self.samples:
            self.samples(group.key.batch, [(group.key, trajectories, group.rewards_G, advantages)])
        return processed(datums=datums, status="trained")
