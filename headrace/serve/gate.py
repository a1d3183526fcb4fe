"""``serve.gate = "env"``: a candidate is scored on held-out problems of ``serve.gate_env`` before
it may serve, with the evaluator training runs use (``eval.every``): greedy first answers, the
same problems for every version, so two versions' scores differ by their weights alone."""

from __future__ import annotations

from typing import Any

from headrace.core.episode import EpisodeSpec
from headrace.core.evaluate import EVAL_SEED_OFFSET, Evaluator
from headrace.core.protocols import Backend
from headrace.core.sampler import SamplerActor
from headrace.core.types import SamplerHandle
from headrace.run.config import MAX_SEED, RunConfig
from headrace.run.train import make_dataset

from .config import serve_options


class _Settings:
    every, samples, greedy, max_concurrency = 1, 1, True, 8

    def __init__(self, problems: int):
        self.problems = problems


class EnvGate:
    def __init__(self, config: RunConfig, backend: Backend, sampler: SamplerActor):
        cfg = serve_options(config)
        assert cfg.gate_env is not None  # ServeConfig checks it
        self.cfg, self.name = cfg, cfg.gate_env
        gate_config = config.model_copy(
            update={
                "env": cfg.gate_env,
                "env_options": dict(cfg.gate_env_options),
                "batch_size": cfg.gate_problems,
                "group_size": 1,
                "steps": 1,
                "seed": (config.seed + EVAL_SEED_OFFSET) % (MAX_SEED + 1),
            }
        )
        spec = EpisodeSpec(
            config.sampling.params(),
            config.max_turns,
            gate_config.seed,
            backend.tokenizer.vocab_size,
        )
        dataset = make_dataset(gate_config, backend)
        self.evaluator = Evaluator(_Settings(cfg.gate_problems), cfg.gate_env, dataset, sampler, spec)
        self._scores: dict[int, float] = {}  # by version: the incumbent is scored once

    async def score(self, handle: SamplerHandle) -> float:
        if handle.version not in self._scores:
            figures = await self.evaluator.evaluate(handle)
            self._scores[handle.version] = figures[f"eval/{self.name}/reward_mean"]
        return self._scores[handle.version]

    async def judge(self, candidate: SamplerHandle, incumbent: SamplerHandle) -> dict[str, Any]:
        """Whether ``candidate`` may replace ``incumbent``, and the scores that decided it."""
        cand = await self.score(candidate)
        out: dict[str, Any] = {"gate": "env", "env": self.name, "candidate": cand, "passed": True}
        if self.cfg.gate_min_reward is not None:
            out["min_reward"] = self.cfg.gate_min_reward
            out["passed"] = cand >= self.cfg.gate_min_reward
        if self.cfg.gate_no_regress:
            out["incumbent"] = await self.score(incumbent)
            out["passed"] = out["passed"] and cand >= out["incumbent"]
        return out
