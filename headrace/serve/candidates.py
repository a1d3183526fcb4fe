"""A batch of scored completions into a candidate's training data.

Completions of the same prompt form a group and get group advantages (reward minus the group's
mean, as GRPO); a completion alone with its prompt is measured against its scenario's running
baseline (an exponential mean of that scenario's rewards; a scenario seen for the first time
starts from its batch's mean). Each completion is one datum: its prompt (as rendered when it was
served), its sampled tokens and their logprobs, exactly as captured; nothing is re-tokenised.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from headrace.core.advantages import group_advantages
from headrace.core.datums import trajectory_to_datums
from headrace.core.types import Datum, SampledTokens, StopReason, Trajectory, Transition

from .store import Completion


@dataclass(frozen=True)
class Batch:
    completions: list[Completion]
    datums: list[Datum]
    baselines: dict[str, float]  # each scenario's baseline once this batch is counted
    metrics: dict[str, float]


def make_batch(
    completions: Sequence[Completion], baselines: dict[str, float], decay: float, normalize_std: bool
) -> Batch:
    by_prompt: dict[tuple[int, ...], list[Completion]] = {}
    for c in completions:
        by_prompt.setdefault(tuple(c.prompt_tokens), []).append(c)
    advantage: dict[str, float] = {}
    alone: dict[str, list[Completion]] = {}
    for members in by_prompt.values():
        if len(members) > 1:
            rewards = [_reward(c) for c in members]
            for c, a in zip(members, group_advantages(rewards, normalize_std), strict=True):
                advantage[c.id] = a
        else:
            alone.setdefault(members[0].scenario or "", []).append(members[0])
    updated = dict(baselines)
    for scenario, members in alone.items():
        base = baselines.get(scenario)
        if base is None:
            base = sum(map(_reward, members)) / len(members)
        for c in members:
            advantage[c.id] = _reward(c) - base
    for c in completions:  # every reward moves its scenario's baseline, grouped or not
        scenario = c.scenario or ""
        updated[scenario] = decay * updated.get(scenario, _reward(c)) + (1 - decay) * _reward(c)
    datums = [d for c in completions for d in trajectory_to_datums(_trajectory(c), advantage[c.id])]
    rewards = [_reward(c) for c in completions]
    metrics = {
        "reward/mean": sum(rewards) / len(rewards),
        "batch/completions": float(len(completions)),
        "batch/grouped": float(len(completions) - sum(map(len, alone.values()))),
        "batch/datums": float(len(datums)),
        "advantage/abs_mean": sum(abs(a) for a in advantage.values()) / len(advantage),
    }
    return Batch(list(completions), datums, updated, metrics)


def _reward(c: Completion) -> float:
    assert c.reward is not None, "only scored completions are batched"
    return c.reward


def _trajectory(c: Completion) -> Trajectory:
    action = SampledTokens(c.completion_tokens, c.logprobs, StopReason.STOP, c.version)
    return Trajectory([Transition(c.prompt_tokens, action, _reward(c), True)], StopReason.DONE)
