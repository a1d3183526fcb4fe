"""Group-centred advantages: each member's reward minus its group's mean (GRPO, no critic).

Rewards, advantages and logprobs end up in the learner's float32 tensors (every backend's), as
they do in TRL and verl; there a NaN, an infinity or a value beyond float32's range (±3.4e38)
turns the loss, then every weight, into NaN. So a reward must be a finite number within float32's
range: anything else is an env contract error, raised where the reward is consumed (naming the
env and the value) before anything is computed from it. ``group_advantages`` re-checks its
inputs, and refuses (``NonFiniteError``) advantages that would not fit float32 either: without
``normalize_std`` a group spanning more than float32's range cannot be centred (normalised
advantages are bounded by sqrt(G) whatever the rewards' scale).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from headrace.core.episode import EnvContractError, is_real
from headrace.core.errors import RunError
from headrace.core.types import EnvGroupBuilder, Trajectory

FLOAT32_MAX = 3.4028234663852886e38


class NonFiniteError(RunError, ValueError):
    """A number the learner would train on is NaN, infinite or beyond float32's range: refused
    before it is submitted, since one such value turns every weight into NaN."""


def finite32(values: Sequence[float]) -> bool:
    """Every value finite and within float32's range, at C speed (this runs per token): ``sum`` is
    NaN or infinite exactly when a value is (or the values are far beyond float32 anyway), and
    with no NaN about, ``min`` and ``max`` are well defined."""
    return not values or (math.isfinite(sum(values)) and -FLOAT32_MAX <= min(values) and max(values) <= FLOAT32_MAX)


def _sound(value: object) -> bool:
    """A float or an int within float32's range, answered by one comparison (NaN fails it): the
    common case, checked before any message is written (this runs for every reward)."""
    return (type(value) is float or type(value) is int) and -FLOAT32_MAX <= value <= FLOAT32_MAX


def _check_reward(value: object, source: str, where: str) -> None:
    if _sound(value):
        return
    if is_real(value) and finite32((float(value),)):
        return
    if not is_real(value):
        problem = "is not a number"
    else:
        problem = "is NaN" if math.isnan(value) else "is infinite" if math.isinf(value) else "is beyond float32's range"
    raise EnvContractError(
        f"{source} {value!r} ({where}), which {problem}. A reward must be a finite number within float32's range "
        "(±3.4e38), where the learner computes: one NaN or infinite reward turns every advantage, then every "
        "weight, into NaN. Fix the reward (guard divisions by zero, clip or rescale it); nothing was trained on it."
    )


def check_step_rewards(env: object, trajectory: Trajectory) -> Trajectory:
    """The trajectory, once every reward its env gave is usable (else ``EnvContractError``)."""
    for turn, transition in enumerate(trajectory.transitions):
        if not _sound(transition.reward):
            _check_reward(transition.reward, f"{type(env).__name__}.step() returned the reward", f"turn {turn}")
    return trajectory


def checked_totals(builder: EnvGroupBuilder, trajectories: Sequence[Trajectory], group_rewards) -> list[float]:
    """Each member's total reward (its step rewards + its group reward), every part checked."""
    name = type(builder).__name__
    totals = []
    for i, (trajectory, (reward, _)) in enumerate(zip(trajectories, group_rewards, strict=True)):
        if not _sound(reward):
            _check_reward(reward, f"{name}.compute_group_rewards() returned the reward", f"trajectory {i}")
        total = trajectory.total_reward + reward
        if not _sound(total):
            _check_reward(total, f"{name}: a total reward (step rewards + group reward) is", f"trajectory {i}")
        totals.append(total)
    return totals


def group_advantages(rewards_G: Sequence[float], normalize_std: bool = False, eps: float = 1e-6) -> list[float]:
    """Rewards must be finite and within float32's range (``NonFiniteError`` otherwise); so are the
    advantages returned, or ``NonFiniteError`` says why they cannot be."""
    n = len(rewards_G)
    if n == 0:
        return []
    if not finite32(rewards_G):
        shown = str(list(rewards_G))[:200]
        raise NonFiniteError(f"rewards {shown} are not all finite numbers within float32's range (±3.4e38)")
    # in float64, |r| <= 3.4e38 cannot overflow the sum or the squares
    mean = sum(rewards_G) / n
    centred = [r - mean for r in rewards_G]
    if normalize_std:
        std = math.sqrt(sum(c * c for c in centred) / n)
        return [c / (std + eps) for c in centred]
    if not finite32(centred):
        raise NonFiniteError(
            f"rewards spanning {min(rewards_G):.3g} to {max(rewards_G):.3g} give advantages beyond float32's range "
            "(±3.4e38). Rescale the env's rewards or set advantages.normalize_std = true."
        )
    return centred


def is_constant(rewards_G: Sequence[float], tol: float = 1e-9) -> bool:
    """A group whose members all scored the same teaches nothing: every advantage is zero. A group
    holding a NaN or an infinity is never constant, wherever it sits (``min``/``max`` would depend
    on its position): it goes on to ``group_advantages``, which refuses it."""
    if not rewards_G:
        return True
    if not all(map(math.isfinite, rewards_G)):
        return False
    return max(rewards_G) - min(rewards_G) <= tol
