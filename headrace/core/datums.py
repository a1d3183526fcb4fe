"""Trajectory → training datums.

Turns whose observation extends the previous observation + action merge into one datum (a
multi-turn conversation trains as one sequence); a break in the prefix starts a new datum.
Observation tokens are masked out of the loss; action tokens carry the sampler's logprobs and
the trajectory's advantage. Both are checked here, the one place every backend's data passes
through before ``forward_backward``: a NaN, an infinity or a value beyond float32 is refused
(``NonFiniteError``) instead of being submitted, since one of them turns every weight into NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from headrace.core.advantages import FLOAT32_MAX, NonFiniteError, finite32
from headrace.core.types import Datum, SampledTokens, Trajectory


@dataclass
class _Sequence:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # 0.0 on observation tokens
    runs: list[tuple[int, bool]] = field(default_factory=list)  # (length, is_action) segments, in order

    def extend(self, tokens: list[int], action: bool, logprobs: list[float] | None = None) -> None:
        self.tokens += tokens
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.runs.append((len(tokens), action))

    def trains(self) -> bool:
        """Has an action token past position 0 (the first token is never a target)."""
        end = 0
        for n, action in self.runs:
            end += n
            if action and n and end > 1:
                return True
        return False

    def to_datum(self, advantage: float, version: int) -> Datum:
        # position t predicts token t+1: shift every per-token field by one. Built per segment
        # (list repetition), not per token: this runs for every trajectory on the hot path.
        mask: list[float] = []
        advantages: list[float] = []
        skip = 1  # the first token is only an input
        for n, action in self.runs:
            if skip and n:
                n, skip = n - 1, 0
            mask += [1.0 if action else 0.0] * n
            advantages += [advantage if action else 0.0] * n
        return Datum(
            model_input=self.tokens[:-1],
            target_tokens=self.tokens[1:],
            logprobs=self.logprobs[1:],
            advantages=advantages,
            mask=mask,
            policy_version=version,
        )


def trajectory_to_datums(trajectory: Trajectory, advantage: float) -> list[Datum]:
    if not -FLOAT32_MAX <= advantage <= FLOAT32_MAX:  # NaN fails the comparison too
        raise NonFiniteError(f"a trajectory's advantage is {advantage!r}; it must be finite and within float32's range")
    for turn, transition in enumerate(trajectory.transitions):
        if not finite32(transition.action.logprobs):
            bad = next(x for x in transition.action.logprobs if not finite32((x,)))
            raise NonFiniteError(
                f"the sampler returned the logprob {bad!r} for a token it sampled (turn {turn}, policy version "
                f"{transition.action.policy_version}); a sampled token's logprob must be finite. The sampler's "
                "weights or the sampling backend are broken; nothing was trained on it."
            )
    if len(trajectory.transitions) == 1:  # single turn, the commonest: one sequence, built directly
        return _single_turn(trajectory.transitions[0].observation, trajectory.transitions[0].action, advantage)
    return _by_sequence(trajectory, advantage)


def _by_sequence(trajectory: Trajectory, advantage: float) -> list[Datum]:
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
    return [s.to_datum(advantage, version) for s in sequences if s.trains()]


def _single_turn(observation: list[int], action: SampledTokens, advantage: float) -> list[Datum]:
    """``_Sequence``'s datum for one observation and its action, without the segment bookkeeping
    (the same lists: ``tests/test_datums.py`` compares it with ``_by_sequence``)."""
    n_ob, n_act = len(observation), len(action.tokens)
    if not n_act or n_ob + n_act <= 1:  # no action token past position 0: nothing to train
        return []
    tokens = list(observation)
    tokens += action.tokens
    prompt = n_ob - 1 if n_ob else 0  # the first token is only an input
    acted = n_act if n_ob else n_act - 1
    logprobs = [0.0] * prompt
    logprobs += action.logprobs[1 - min(n_ob, 1) :]
    return [
        Datum(
            model_input=tokens[:-1],
            target_tokens=tokens[1:],
            logprobs=logprobs,
            advantages=[0.0] * prompt + [advantage] * acted,
            mask=[0.0] * prompt + [1.0] * acted,
            policy_version=action.policy_version,
        )
    ]
