"""AdvantageActor: a finished group's advantages, the constant-group filter and its datums.

(Rewards are computed in the rollout actor, with the group; dropped groups pass through, counted.)

On-policy distillation (``headrace run --teacher``): a ``Teacher`` scores each trained group's
datums (its logprobs of the tokens the student sampled), and each action token's advantage is
``reward_coef`` x the group advantage of the env's reward minus ``kl_coef`` x the per-token
reverse KL estimate ``log π_student - log π_teacher`` (the sampler's logprob minus the teacher's).
A group whose rewards are all equal still trains then: the teacher's signal is per token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

from headrace.core.advantages import NonFiniteError, finite32, group_advantages, is_constant
from headrace.core.channel import Channel
from headrace.core.datums import trajectory_to_datums
from headrace.core.frozen import quick_init
from headrace.core.rollout import RolloutResult
from headrace.core.types import Datum, DroppedGroup, GroupKey, Metrics, Trajectory


@quick_init
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


# a teacher: the datums' target logprobs under the teacher model (every position; the mask is read here)
Teacher = Callable[[list[Datum]], Awaitable[list[list[float]]]]


@dataclass(frozen=True)
class DistillSettings:
    kl_coef: float = 1.0  # weight of the teacher's per-token reverse KL in the advantage
    reward_coef: float = 0.0  # weight of the env reward's group advantage


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
        teacher: Teacher | None = None,
        distill: DistillSettings | None = None,
    ):
        self.inbox, self.outbox, self.settings, self.samples = inbox, outbox, settings, samples
        self.teacher, self.distill = teacher, distill or DistillSettings()

    async def run(self) -> None:
        async for result in self.inbox:
            processed = self.process(result)
            if self.teacher is not None and processed.datums:
                processed = await self._distilled(processed)
            await self.outbox.put(processed)
        self.outbox.close()

    async def _distilled(self, group: ProcessedGroup) -> ProcessedGroup:
        assert self.teacher is not None
        scored = await self.teacher(group.datums)
        kl_coef = self.distill.kl_coef
        datums, kl, teacher_lp, tokens = [], 0.0, 0.0, 0
        for d, row in zip(group.datums, scored, strict=True):
            advantages = list(d.advantages)
            for t, m in enumerate(d.mask):
                if m:
                    gap = d.logprobs[t] - row[t]  # log π_student - log π_teacher of the sampled token
                    advantages[t] -= kl_coef * gap
                    kl, teacher_lp, tokens = kl + gap, teacher_lp + row[t], tokens + 1
            if not finite32(advantages):
                raise NonFiniteError(f"the teacher's logprobs made a non-finite advantage (group {group.key})")
            datums.append(Datum(d.model_input, d.target_tokens, d.logprobs, advantages, d.mask, d.policy_version))
        n = max(tokens, 1)
        metrics = {**group.metrics, "distill/reverse_kl": kl / n, "distill/teacher_logprob": teacher_lp / n}
        return dataclasses.replace(group, datums=datums, metrics=metrics)

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
        versions = [(t.policy_version, t.num_action_tokens) for t in trajectories]
        processed = partial(
            ProcessedGroup,
            key=group.key,
            step=group.key.batch,
            batch_size=item.batch_size,
            policy_version=min([v for v, _ in versions], default=-1),  # group.policy_version, from the list
            rewards_G=group.rewards_G,
            metrics=group.metrics,
            tags=group.tags,
            action_tokens=sum([n for _, n in versions]),
            num_trajectories=len(trajectories),
            seconds=result.seconds,
            trajectory_versions=versions,
            token_versions=_count_versions(trajectories),
        )
        distilling = self.teacher is not None
        if distilling and is_constant(group.rewards_G):
            # the teacher's per-token signal trains it: the env's reward adds nothing here
            advantages = [0.0] * len(trajectories)
            datums = [d for t, a in zip(trajectories, advantages, strict=True) for d in trajectory_to_datums(t, a)]
            if self.samples:
                self.samples(group.key.batch, [(group.key, trajectories, group.rewards_G, advantages)])
            return processed(datums=datums, status="trained")
        if self.settings.filter_constant and is_constant(group.rewards_G):
            if self.samples:
                self.samples(group.key.batch, [(group.key, trajectories, group.rewards_G, None)])
            return processed(datums=[], status="filtered")
        try:
            advantages = group_advantages(group.rewards_G, self.settings.normalize_std)
        except NonFiniteError as e:
            tags = f" ({', '.join(group.tags)})" if group.tags else ""
            raise NonFiniteError(f"group {group.key.index} of batch {group.key.batch}{tags}: {e}") from None
        if distilling:
            advantages = [a * self.distill.reward_coef for a in advantages]
        datums = [d for t, a in zip(trajectories, advantages, strict=True) for d in trajectory_to_datums(t, a)]
        if self.samples:
            self.samples(group.key.batch, [(group.key, trajectories, group.rewards_G, advantages)])
        return processed(datums=datums, status="trained")


def _count_versions(trajectories: list[Trajectory]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for t in trajectories:
        if len(t.transitions) == 1 and t.transitions[0].action.token_versions is None:  # one version: no dict
            a = t.transitions[0].action
            counts[a.policy_version] = counts.get(a.policy_version, 0) + len(a.tokens)
            continue
        for version, n in t.version_counts().items():
            counts[version] = counts.get(version, 0) + n
    return counts
