"""One line of ``metrics.jsonl`` per step, with namespaced names.

``reward/…``, ``env/<tag>/…``, ``time/…``, ``throughput/…``, ``staleness/…``, ``queue/…``,
``rollout_errors/…``, ``optim/…``, ``groups/…``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

from headrace.engine.learner import StepReport
from headrace.engine.reward import ProcessedGroup


def _mean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def reward_metrics(groups: list[ProcessedGroup]) -> dict[str, float]:
    out: dict[str, float] = {}
    rewards = [r for g in groups for r in g.rewards_G]
    if rewards:
        out["reward/mean"] = _mean(rewards)
        mean = out["reward/mean"]
        # not statistics.pstdev: it computes in exact fractions, ~3 us per trajectory on the hot path
        out["reward/std"] = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        out["reward/min"], out["reward/max"] = min(rewards), max(rewards)
    else:
        out["reward/mean"] = float("nan")
    by_tag: dict[str, list[float]] = defaultdict(list)
    env_metrics: dict[str, list[float]] = defaultdict(list)
    for g in groups:
        for tag in g.tags:
            by_tag[tag] += g.rewards_G
        for name, value in g.metrics.items():
            env_metrics[name].append(value)
    for tag, values in by_tag.items():
        out[f"env/{tag}/reward/mean"] = _mean(values)
    for name, values in env_metrics.items():
        out[f"env/all/{name}"] = _mean(values)
    return out


def staleness_metrics(step: int, groups: list[ProcessedGroup]) -> dict[str, float]:
    """Staleness of a group = the step it trains at − the version of its oldest token."""
    trained = [g for g in groups if g.status != "dropped"]
    if not trained:
        return {"staleness/mean": 0.0, "staleness/max": 0.0, "staleness/token_weighted": 0.0}
    lags = [step - g.policy_version for g in trained]
    tokens = [max(g.action_tokens, 1) for g in trained]
    return {
        "staleness/mean": _mean(lags),
        "staleness/max": float(max(lags)),
        "staleness/token_weighted": sum(l * t for l, t in zip(lags, tokens, strict=True)) / sum(tokens),
    }


def _reduce(name: str, values: list[float]) -> float:
    """Tinker-style ``name:reduction`` keys say how minibatches combine; plain keys average."""
    reduction = name.rpartition(":")[2] if ":" in name else "mean"
    if reduction == "sum":
        return sum(values)
    if reduction in ("max", "min"):
        return max(values) if reduction == "max" else min(values)
    return sum(values) / len(values)


def learner_metrics(report: StepReport) -> dict[str, float]:
    collected: dict[str, list[float]] = defaultdict(list)
    for result in report.forward_backwards:
        for name, value in result.metrics.items():
            collected[name.removeprefix("optim/")].append(value)
    out = {f"optim/{name}": _reduce(name, values) for name, values in collected.items()}
    if report.optim is not None:
        for name, value in report.optim.metrics.items():
            out[f"optim/{name.removeprefix('optim/')}"] = value
    out["optim/forward_backward_calls"] = float(len(report.forward_backwards))
    out["optim/datums"] = float(sum(len(g.datums) for g in report.groups))
    return out


def group_counts(groups: list[ProcessedGroup]) -> dict[str, float]:
    out = {f"groups/{status}": 0.0 for status in ("trained", "filtered", "dropped")}
    for g in groups:
        out[f"groups/{g.status}"] += 1
    out["throughput/trajectories"] = float(sum(g.num_trajectories for g in groups))
    out["throughput/action_tokens"] = float(sum(g.action_tokens for g in groups))
    out["time/rollout_group_mean"] = _mean(g.seconds for g in groups)
    return out
