"""``serve.gate = "env"``: a candidate is scored on held-out problems of ``serve.gate_env`` before
it may serve, beside the incumbent on the same problems with the same sampling seeds
(``serve.gate_samples`` per problem, greedy unless ``serve.gate_temperature``), and the two are
compared problem by problem (``paired.py``): ``serve.gate_improve`` publishes only a candidate
shown better at false-accept rate ``serve.gate_alpha``, ``serve.gate_no_regress`` refuses one shown
worse, ``serve.gate_min_reward`` one whose mean is below it. The whole comparison (effect, its
interval, the test's figures and the decision) goes into the candidate's chain line."""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio

from headrace.core import logs
from headrace.core.episode import EpisodeSpec, run_episode
from headrace.core.evaluate import EVAL_SEED_OFFSET
from headrace.core.protocols import Backend
from headrace.core.rollout import CLEANUP_TIMEOUT_S
from headrace.core.sampler import SamplerActor
from headrace.core.types import EnvGroupBuilder, SamplerHandle, SamplingParams
from headrace.run.config import MAX_SEED, RunConfig
from headrace.run.train import make_dataset

from .config import serve_options
from .paired import paired_test

log = logs.get_logger()

Rewards = list[list[float] | None]  # per problem: one reward per seeded sample (None: it failed)


class EnvGate:
    def __init__(self, config: RunConfig, backend: Backend, sampler: SamplerActor, seed: int | None = None):
        """``seed``: which held-out problems are drawn (default: the run's seed, offset as evals are)."""
        cfg = serve_options(config)
        assert cfg.gate_env is not None  # ServeConfig checks it
        self.cfg, self.name, self.sampler = cfg, cfg.gate_env, sampler
        base = config.seed if seed is None else seed
        gate_config = config.model_copy(
            update={
                "env": cfg.gate_env,
                "env_options": dict(cfg.gate_env_options),
                "batch_size": cfg.gate_problems,
                "group_size": cfg.gate_samples,
                "steps": 1,
                "seed": (base + EVAL_SEED_OFFSET) % (MAX_SEED + 1),
            }
        )
        params = dataclasses.replace(config.sampling.params(), temperature=cfg.gate_temperature)
        self.spec = EpisodeSpec(params, config.max_turns, gate_config.seed, backend.tokenizer.vocab_size)
        self.dataset = make_dataset(gate_config, backend)
        self._rewards: dict[tuple[str | None, int], Rewards] = {}  # by (scenario, version): scored once

    async def rewards(self, handle: SamplerHandle, seed_shift: int = 0, lane: str | None = None) -> Rewards:
        """Each problem's rewards under ``handle``; sample j of problem i is seeded
        ``EVAL_SEED_OFFSET + seed_shift + i * gate_samples + j``, whatever the version, so two
        versions are compared on the same draws. (``seed_shift`` other than 0: other draws, for
        measuring the gate itself; not cached.) ``lane``: the scenario whose chain numbers the version."""
        key = (lane, handle.version)
        if seed_shift == 0 and key in self._rewards:
            return self._rewards[key]
        builders = list(self.dataset.get_batch(0))
        out: Rewards = [None] * len(builders)
        limiter = anyio.CapacityLimiter(8)

        async def one(i: int, builder: EnvGroupBuilder) -> None:
            try:
                out[i] = await self._problem(i, builder, handle, limiter, seed_shift)
            except Exception as e:  # noqa: BLE001 - a failing problem is left out of the comparison
                log.warning("serve_gate_problem_failed", problem=i, error=f"{type(e).__name__}: {e}")
            finally:
                with anyio.CancelScope(shield=True), anyio.move_on_after(CLEANUP_TIMEOUT_S):
                    try:
                        await builder.cleanup()
                    except Exception as e:  # noqa: BLE001 - as above
                        log.warning("serve_gate_cleanup_failed", problem=i, error=f"{type(e).__name__}: {e}")

        async with anyio.create_task_group() as tg:
            for i, builder in enumerate(builders):
                tg.start_soon(one, i, builder)
        if seed_shift == 0:
            self._rewards[key] = out
        return out

    async def _problem(
        self, i: int, builder: EnvGroupBuilder, handle: SamplerHandle, limiter: anyio.CapacityLimiter, shift: int
    ) -> list[float]:
        envs = list(await builder.make_envs())

        async def sample(prompt: list[int], n: int, params: SamplingParams) -> Any:
            return await self.sampler.sample(prompt, n, params, handle=handle)

        trajectories: list[Any] = [None] * len(envs)

        async def member(j: int) -> None:
            async with limiter:
                seed = EVAL_SEED_OFFSET + shift + i * len(envs) + j
                trajectories[j] = await run_episode(envs[j], sample, self.spec, seed)

        async with anyio.create_task_group() as tg:
            for j in range(len(envs)):
                tg.start_soon(member, j)
        extra = await builder.compute_group_rewards(trajectories)
        return [t.total_reward + float(r) for t, (r, _) in zip(trajectories, extra, strict=True)]

    async def judge(
        self, candidate: SamplerHandle, incumbent: SamplerHandle, lane: str | None = None
    ) -> dict[str, Any]:
        """Whether ``candidate`` may replace ``incumbent``, and the figures that decided it."""
        return self.decide(await self.rewards(candidate, lane=lane), await self.rewards(incumbent, lane=lane))

    def decide(self, candidate: Rewards, incumbent: Rewards) -> dict[str, Any]:
        cfg = self.cfg
        cand, inc = _mean(candidate), _mean(incumbent)
        out: dict[str, Any] = {"gate": "env", "env": self.name, "candidate": cand, "incumbent": inc, "passed": True}
        out["samples"] = cfg.gate_samples
        if cfg.gate_min_reward is not None:
            out["min_reward"] = cfg.gate_min_reward
            out["passed"] = cand >= cfg.gate_min_reward
        for rule, wanted in (("improve", cfg.gate_improve), ("no_regress", cfg.gate_no_regress)):
            if wanted:
                test = paired_test(candidate, incumbent, cfg.gate_alpha, rule)
                out[rule] = test
                out["passed"] = out["passed"] and test["passed"]
        out["decision"] = "accept" if out["passed"] else "reject"
        return out


def _mean(rewards: Rewards) -> float:
    flat = [r for rs in rewards if rs is not None for r in rs]
    return sum(flat) / len(flat) if flat else float("nan")
