"""Trajectory → training datums.

Turns whose observation extends the previous observation + action merge into one datum (a
multi-turn conversation trains as one sequence); a break in the prefix starts a new datum.
Observation tokens are masked out of the loss; action tokens carry the sampler's logprobs and
the trajectory's advantage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from headrace.engine.types import Datum, Trajectory


@dataclass
class _Sequence:
    tokens: list[int] = field(default_factory=list)
    is_action: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def extend(self, tokens: list[int], action: bool, logprobs: list[float] | None = None) -> None:
        self.tokens += tokens
        self.is_action += [action] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)

    def to_datum(self, advantage: float, version: int) -> Datum:
        # position t predicts token t+1: shift every per-token field by one
        mask = [1.0 if a else 0.0 for a in self.is_action[1:]]
        return Datum(
            model_input=self.tokens[:-1],
            target_tokens=self.tokens[1:],
            logprobs=[lp if a else 0.0 for lp, a in zip(self.logprobs[1:], self.is_action[1:], strict=True)],
            advantages=[advantage * m for m in mask],
            mask=mask,
            policy_version=version,
        )


def trajectory_to_datums(trajectory: Trajectory, advantage: float) -> list[Datum]:
    sequences: list[_Sequence] = []
    current: _Sequence | None = None
    for transition in trajectory.transitions:
        ob, action = transition.observation, transition.action
        if current is not None and ob[: len(current.tokens)] == current.tokens:
            current.extend(ob[len(current.tokens) :], action=False)
        else:
            current = _Sequence()
            sequences.append(current)
            current.extend(list(ob), action=False)
        current.extend(list(action.tokens), action=True, logprobs=list(action.logprobs))
    version = trajectory.policy_version
    return [s.to_datum(advantage, version) for s in sequences if len(s.tokens) > 1 and any(s.is_action[1:])]
