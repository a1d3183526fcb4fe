"""One line of ``metrics.jsonl`` per step, with namespaced names.

``reward/…``, ``env/<tag>/…``, ``time/…``, ``throughput/…``, ``staleness/…``, ``queue/…``,
``rollout_errors/…``, ``optim/…``, ``groups/…``; ``inflight/…`` under admission by samples
(``core/admission.py``'s figures).
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from headrace.core.advantage_actor import ProcessedGroup
from headrace.core.channel import Channel
from headrace.core.errors import RunError
from headrace.core.learner import StepReport


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
    # a group's metrics (its envs' StepResult.metrics and its group-reward metrics) count once
    # per group under env/all/, and under env/<tag>/ for each of the group's logging tags
    env_metrics: dict[str, list[float]] = defaultdict(list)
    for g in groups:
        for tag in g.tags:
            by_tag[tag] += g.rewards_G
        for name, value in g.metrics.items():
            for env in ("all", *g.tags):
                env_metrics[f"env/{env}/{name}"].append(value)
    for tag, values in by_tag.items():
        out[f"env/{tag}/reward/mean"] = _mean(values)
    for key, values in env_metrics.items():
        out[key] = _mean(values)
    return out


def staleness_metrics(step: int, groups: list[ProcessedGroup]) -> dict[str, float]:
    """Staleness = the step a sample trains at − the version of the weights that made it, read
    from the data. Per trajectory (``mean``, ``max``): its oldest token, the figure
    ``max_steps_off_policy`` bounds; ``token_weighted``: that, weighted by the trajectory's action
    tokens; per token (``token_mean``; its max is ``max``): each token's own version, which is newer
    than its trajectory's oldest when the weights were swapped during its generation (``inflight``)."""
    trained = [g for g in groups if g.status != "dropped"]
    if not trained:
        return {
            "staleness/mean": 0.0,
            "staleness/max": 0.0,
            "staleness/token_weighted": 0.0,
            "staleness/token_mean": 0.0,
        }
    # a group built without per-trajectory figures (tests, third-party actors) counts as one
    # trajectory of its oldest version
    pairs = [p for g in trained for p in (g.trajectory_versions or [(g.policy_version, g.action_tokens)])]
    lags = [step - v for v, _ in pairs]
    tokens = [max(n, 1) for _, n in pairs]
    counts: dict[int, int] = {}
    for g in trained:
        for v, n in (g.token_versions or {g.policy_version: max(g.action_tokens, 1)}).items():
            counts[v] = counts.get(v, 0) + n
    total = sum(counts.values())
    return {
        "staleness/mean": _mean(lags),
        "staleness/max": float(max(lags)),
        "staleness/token_weighted": sum(lag * t for lag, t in zip(lags, tokens, strict=True)) / sum(tokens),
        "staleness/token_mean": sum((step - v) * n for v, n in counts.items()) / total if total else 0.0,
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
    out = {}
    for name, values in collected.items():
        if name.startswith("loss/"):  # the loss's own statistics (ratios, KL) keep their namespace
            out[name.partition(":")[0]] = _reduce(name, values)
        else:
            out[f"optim/{name}"] = _reduce(name, values)
    if report.optim is not None:
        for name, value in report.optim.metrics.items():
            # a backend's own timings (time/publish, --cluster ray) keep their namespace
            # perf/… (FLOPs, MFU: the torch backend's) too
            kept = name.startswith(("time/", "perf/"))
            out[name if kept else f"optim/{name.removeprefix('optim/')}"] = value
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


class NoUpdateApplied(RunError, RuntimeError):
    """Every group of every step was dropped or filtered (or every update skipped as non-finite):
    the run finished without training."""


class StepMeter:
    """Builds each step's ``metrics.jsonl`` row: the step's own figures, its timing, and gauges
    of the queues and the rollout error counts at the moment it was reported. Keeps the run's
    tallies too, so a run that never trained can say why."""

    def __init__(self, queues: Sequence[Channel], error_counts: Counter[str]):
        self.queues, self.error_counts = queues, error_counts
        self.start = self.last = time.perf_counter()
        self.steps = self.updates = self.skipped = 0
        self.groups: Counter[str] = Counter()
        self.examples: dict[str, str] = {}  # error name -> one message, from the dropped groups

    def no_update_error(self) -> NoUpdateApplied | None:
        """The error to end a run with when it reported steps but applied no update."""
        if not self.steps or self.updates:
            return None
        top = self.error_counts.most_common(3)
        causes = "; ".join(f"{name} x{n}" + (f" ({e})" if (e := self.examples.get(name)) else "") for name, n in top)
        skipped = f", and {self.skipped} updates were skipped as non-finite" if self.skipped else ""
        return NoUpdateApplied(
            f"no update was applied: in {self.steps} steps, {self.groups['dropped']} groups were dropped after "
            f"spending their retry budget and {self.groups['filtered']} were filtered (every member got the same "
            f"reward){skipped}, "
            f"so nothing was trained. Top errors: {causes or 'none'}. Fix the env or the backend; if every reward is "
            "the same, make the task easier, the group larger, or set advantages.filter_constant=false."
        )

    def _tally(self, step: StepReport) -> None:
        self.steps += 1
        if step.optim is not None:
            skipped = bool(step.optim.metrics.get("optim/skipped_nonfinite"))  # a learner that refused the step
            self.updates += not skipped
            self.skipped += skipped
        for g in step.groups:
            self.groups[g.status] += 1
            for error in g.errors:
                name, _, message = error.partition(": ")
                self.examples.setdefault(name, message[:120])

    def row(self, step: StepReport) -> dict[str, Any]:
        self._tally(step)
        elapsed, self.last = step.completed_at - self.last, step.completed_at
        row: dict[str, Any] = {"step": step.step, "policy_version": step.version}
        row |= reward_metrics(step.groups)
        row |= staleness_metrics(step.step, step.groups)
        row |= group_counts(step.groups)
        row |= learner_metrics(step)
        row["time/step"] = elapsed
        row["time/total"] = step.completed_at - self.start
        # training that sampling did not hide: the whole of it under sync, the tail under stream
        row["time/after_last_group"] = step.completed_at - step.last_group_at if step.last_group_at else 0.0
        row["throughput/trajectories_per_s"] = row["throughput/trajectories"] / max(elapsed, 1e-9)
        row["throughput/tokens_per_s"] = row["throughput/action_tokens"] / max(elapsed, 1e-9)
        for q in self.queues:
            row[f"queue/{q.name}"] = float(q.qsize())
            row[f"queue/{q.name}_peak"] = float(q.peak)
        row["rollout_errors/total"] = float(sum(self.error_counts.values()))
        for name, count in self.error_counts.items():
            row[f"rollout_errors/{name}"] = float(count)
        row["rollout_errors/groups_dropped"] = row["groups/dropped"]
        return row
