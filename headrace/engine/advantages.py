"""Group-centred advantages: each member's reward minus its group's mean (GRPO, no critic)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def group_advantages(rewards_G: Sequence[float], normalize_std: bool = False, eps: float = 1e-6) -> list[float]:
    n = len(rewards_G)
    if n == 0:
        return []
    mean = sum(rewards_G) / n
    centred = [r - mean for r in rewards_G]
    if not normalize_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / n)
    return [c / (std + eps) for c in centred]


def is_constant(rewards_G: Sequence[float], tol: float = 1e-9) -> bool:
    """A group whose members all scored the same teaches nothing: every advantage is zero."""
    return max(rewards_G) - min(rewards_G) <= tol if rewards_G else True
