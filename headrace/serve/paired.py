"""The gate's decision: a paired comparison of candidate and incumbent with a stated error rate.

Both versions answer the same held-out problems with the same sampling seeds, so a problem's
difference d_i = (candidate's mean reward on it) - (incumbent's) is paired: what the problem and
the seeds contribute cancels, and an identical candidate ties on every problem. The test is the
exact one-sided sign test on the problems where the two differ (for 0/1 rewards these are the
discordant pairs, and the test is the exact McNemar test):

- ``improve``: publish only if the candidate wins significantly more problems than it loses:
  p = P(Binomial(m, 1/2) >= wins) <= alpha, m = wins + losses. The false-accept rate, the chance
  that a candidate no better than the incumbent is published, is at most alpha.
- ``no_regress``: publish unless it loses significantly more than it wins (p for losses <= alpha):
  an equally good candidate is refused at most alpha of the time; a slightly worse one may pass.

Assumptions: the held-out problems are independent draws from the task's problem distribution,
and "no better" means a problem is at least as likely to go the incumbent's way as the
candidate's (P(d > 0) <= P(d < 0)); nothing is assumed of the rewards' distribution, and ties are
left out (the test is exact given the number of problems that differ). The effect reported is
the mean of d_i, with a two-sided 1 - 2 alpha interval from the normal approximation (its lower
end is the one-sided 1 - alpha bound), and the share of differing problems the candidate won, with
its exact (Clopper-Pearson) one-sided 1 - alpha lower bound: that bound is above 1/2 exactly when
``improve`` accepts. Fixed size: one test on ``serve.gate_problems`` problems, no peeking.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist
from typing import Any


def upper_tail(k: int, n: int) -> float:
    """P(Binomial(n, 1/2) >= k), exactly."""
    if k <= 0:
        return 1.0
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2**n


def binom_tail(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) >= k)."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(max(k, 0), n + 1))


def lower_bound(k: int, n: int, alpha: float) -> float:
    """Clopper-Pearson one-sided 1 - alpha lower bound on p, from k successes in n: the p with
    P(Binomial(n, p) >= k) = alpha (0 when k = 0)."""
    if k <= 0 or n == 0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):  # bisection: the tail grows with p
        mid = (lo + hi) / 2
        if binom_tail(k, n, mid) < alpha:
            lo = mid
        else:
            hi = mid
    return lo


def paired_test(
    candidate: Sequence[Sequence[float] | None],
    incumbent: Sequence[Sequence[float] | None],
    alpha: float,
    rule: str,
) -> dict[str, Any]:
    """The decision on per-problem rewards (one list of seeded samples per problem; None: the
    problem failed for that version, and is left out for both)."""
    diffs = [
        sum(c) / len(c) - sum(i) / len(i)
        for c, i in zip(candidate, incumbent, strict=True)
        if c is not None and i is not None and c and i
    ]
    n = len(diffs)
    wins, losses = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    m = wins + losses
    p_better, p_worse = upper_tail(wins, m), upper_tail(losses, m)
    effect = sum(diffs) / n if n else 0.0
    sd = math.sqrt(sum((d - effect) ** 2 for d in diffs) / (n - 1)) if n > 1 else 0.0
    half = NormalDist().inv_cdf(1 - alpha) * sd / math.sqrt(n) if n else 0.0
    if rule == "improve":
        passed = m > 0 and p_better <= alpha
    elif rule == "no_regress":
        passed = not (m > 0 and p_worse <= alpha)
    else:
        raise ValueError(f"unknown rule {rule!r}")
    return {
        "test": "sign (exact, one-sided, paired)",
        "rule": rule,
        "alpha": alpha,
        "problems": n,
        "wins": wins,
        "losses": losses,
        "ties": n - m,
        "effect": effect,
        "interval": [effect - half, effect + half],
        "win_share": wins / m if m else None,
        "win_share_lower": lower_bound(wins, m, alpha) if m else None,
        "p_value": p_better if rule == "improve" else p_worse,
        "decision": "accept" if passed else "reject",
        "passed": passed,
    }
