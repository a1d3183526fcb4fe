"""Held-out evaluation during training (``eval.every N``).

The eval dataset is built once: ``eval.problems`` problems of the env's held-out split
(``eval.env_options``, default ``split=test``), ``eval.samples`` samples each. An evaluation runs
as one task beside the actors, on the policy version the learner has just published (its handle
is pinned, so a publish mid-eval changes nothing), through the run's sampler. At most one is in
flight: one falling due while the previous still runs is skipped and counted, so the learner
never waits for it. Eval rollouts never reach the learner.

The figures are attached as ``eval/<env>/…`` to the first step row reported after the
evaluation finishes, so ``metrics.jsonl`` keeps one row per step. The last step's row waits for
the evaluation in flight and then for one of the final version (at most ``eval.final_timeout_s`` in
all), so every run that evaluates has a before and an after.

Envs without a held-out split (``arithmetic``) ignore ``split``; their eval problems differ from
the training ones by the seed only (``EVAL_SEED_OFFSET``), and a small problem space overlaps.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Protocol

import anyio

from headrace.core import logs
from headrace.core.episode import EpisodeSpec
from headrace.core.group import FATAL, GroupPolicy, GroupRunner
from headrace.core.sampler import SamplerActor
from headrace.core.types import (
    DroppedGroup,
    EnvGroupBuilder,
    GroupKey,
    RLDataset,
    SampledTokens,
    SamplerHandle,
    SamplingParams,
    Tokens,
    Trajectory,
)

log = logs.get_logger()
# eval problems and episodes are seeded apart from the training ones by this much
EVAL_SEED_OFFSET = 1_000_003


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator over n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class EvalSettings(Protocol):
    """What the evaluator reads of ``eval.*`` (the run's ``EvalConfig`` is one)."""

    every: int
    problems: int
    samples: int
    greedy: bool
    max_concurrency: int


@dataclasses.dataclass
class _Problem:
    correct: list[bool]  # per sample, the first one greedy when eval.greedy
    rewards: list[float]


class Evaluator:
    def __init__(self, cfg: EvalSettings, name: str, dataset: RLDataset, sampler: SamplerActor, spec: EpisodeSpec):
        self.cfg, self.name, self.dataset, self.sampler, self.spec = cfg, name, dataset, sampler, spec
        self.skipped = 0  # evaluations that fell due while the previous one still ran
        # finished ones replaced by a newer one before a row took them (the last step's: it waits
        # for its own); their figures are in log.jsonl
        self.superseded = 0
        self._due: SamplerHandle | None = None
        self._wake = anyio.Event()
        self._running: int | None = None  # the version being evaluated
        self._done_event = anyio.Event()
        self._ready: dict[str, float] = {}  # finished figures not yet attached to a row

    def due(self, step: int) -> bool:
        return (step + 1) % self.cfg.every == 0

    def submit(self, handle: SamplerHandle) -> bool:
        """Ask for an evaluation of ``handle``'s version; never waits. False: skipped, one is busy."""
        if self._running is not None or self._due is not None:
            self.skipped += 1
            log.info("eval_skipped", version=handle.version, running=self._running)
            return False
        self._due = handle
        self._wake.set()
        return True

    async def evaluate_last(self, handle: SamplerHandle, timeout_s: float) -> None:
        """The run's "after": wait for the evaluation in flight, if any, then for one of the final
        ``handle``, all within ``timeout_s`` (past it, the run ends without them)."""
        with anyio.move_on_after(timeout_s):
            while self._running is not None or self._due is not None:
                await self._done_event.wait()
            self.submit(handle)
            while self._running is not None or self._due is not None:
                await self._done_event.wait()

    def take(self) -> dict[str, float]:
        """The finished figures, once: merged into the next step row."""
        out, self._ready = self._ready, {}
        if out:
            out[f"eval/{self.name}/skipped"] = float(self.skipped)
            out[f"eval/{self.name}/superseded"] = float(self.superseded)
        return out

    async def run(self) -> None:
        self.submit(self.sampler.handle)  # before any training: the "before" of the run
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            handle, self._due = self._due, None
            if handle is None:
                continue
            self._running = handle.version
            try:
                figures = await self.evaluate(handle)
                self.superseded += bool(self._ready)
                self._ready = figures
            finally:
                self._running = None
                self._done_event.set()
                self._done_event = anyio.Event()

    async def evaluate(self, handle: SamplerHandle) -> dict[str, float]:
        """One evaluation of ``handle``'s version: each problem a group run through the rollouts'
        lifecycle (``core/group.py``) with eval's policy: no retries, no timeout, member 0 greedy
        when ``eval.greedy``, untraced. A member or a grader that fails loses its problem (counted
        in ``eval/<env>/errors``, never fatal to training); a broken contract stops the run, as it
        does in a rollout."""
        started = anyio.current_time()
        builders = list(self.dataset.get_batch(0))
        problems: list[_Problem | None] = [None] * len(builders)
        errors: list[str] = []
        counts: Counter[str] = Counter()

        async def sample(prompt: Tokens, n: int, params: SamplingParams) -> list[SampledTokens]:
            return await self.sampler.sample(prompt, n, params, handle=handle)

        policy = GroupPolicy(share_first_sample=False, greedy_first=self.cfg.greedy, traced=False, seed=_eval_seed)
        groups = GroupRunner(sample, self.spec, policy, counts, anyio.CapacityLimiter(self.cfg.max_concurrency))

        async def one(i: int, builder: EnvGroupBuilder) -> None:
            try:
                group = await groups.run(builder, GroupKey(0, i))
            except FATAL:
                raise
            except Exception as e:  # noqa: BLE001 - a sample call that failed: counted, not fatal to training
                errors.append(f"{type(e).__name__}: {e}")
                return
            if isinstance(group, DroppedGroup):
                errors.append(group.errors[-1] if group.errors else "dropped")
            else:
                problems[i] = _Problem(
                    [_correct(t, r) for t, r in zip(group.trajectories_G, group.rewards_G, strict=True)],
                    group.rewards_G,
                )

        async with anyio.create_task_group() as tg:
            for i, builder in enumerate(builders):
                tg.start_soon(one, i, builder)
        # a cleanup that failed is counted too (logged as cleanup_failed): a leaked sandbox is an error
        failed = len(errors) + sum(n for name, n in counts.items() if name.startswith("cleanup/"))
        if failed:
            first = errors[0] if errors else next(iter(counts))
            log.warning("eval_errors", env=self.name, version=handle.version, count=failed, first=first)
        done = [p for p in problems if p is not None]
        k = self.cfg.samples
        prefix = f"eval/{self.name}"
        out = {
            f"{prefix}/version": float(handle.version),
            f"{prefix}/problems": float(len(done)),
            f"{prefix}/errors": float(failed),
            f"{prefix}/accuracy": _mean([float(p.correct[0]) for p in done]),
            f"{prefix}/pass@{k}": _mean([pass_at_k(len(p.correct), sum(p.correct), k) for p in done]),
            f"{prefix}/reward_mean": _mean([r for p in done for r in p.rewards]),
            f"{prefix}/seconds": anyio.current_time() - started,
        }
        log.info("eval", env=self.name, **{k.rpartition("/")[2]: v for k, v in out.items()})
        return out


def _eval_seed(seed: int, key: GroupKey, member: int, attempt: int) -> int:
    """Eval episodes are seeded by member alone, apart from the training ones."""
    return EVAL_SEED_OFFSET + member


def _correct(trajectory: Trajectory, reward: float) -> bool:
    """The env's own ``correct`` metric (its last report of it), else a positive reward."""
    for transition in reversed(trajectory.transitions):
        if "correct" in transition.metrics:
            return transition.metrics["correct"] > 0
    return reward > 0


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")
