"""Fault injection: wrap any registered env so a seeded share of its steps fail, hang or run slow.

``faulty`` wraps the env named by its ``env`` option (default ``arithmetic``); every other option
goes to that env::

    headrace run --env faulty --set env_options.fail_rate=0.2 --set env_options.max_operand=20

``flaky_arithmetic`` is the same with ``fail_rate = 0.2`` unless told otherwise.

Options: ``fail_rate`` (``step`` raises ``InjectedFault``: the rollout is retried with a fresh env
against its group's budget), ``hang_rate`` (``step`` sleeps ``hang_s``, default an hour: pair it
with ``retry.rollout_timeout_s``), ``slow_rate`` (``step`` sleeps ``slow_s`` first, default 0.05 s),
``busy_ms`` (every ``step`` first burns this much CPU in Python: a CPU-heavy env, for
``--cluster ray``'s rollout workers), and ``on_start`` (also draw on ``initial_observation``).
Each call draws one number from a generator seeded by (run seed, batch, group, the group's
``make_envs`` call, member), so a run replays the same faults.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from headrace.core.errors import EnvError
from headrace.core.types import Env, EnvGroupBuilder, Metrics, RLDataset, SampledTokens, StepResult, Trajectory
from headrace.envs.context import EnvContext
from headrace.plugins import registry

# its own options; every other one goes to the env it wraps (the one its ``env`` option names)
FAULT_OPTIONS = {
    "env": "arithmetic",
    "fail_rate": 0.0,
    "hang_rate": 0.0,
    "slow_rate": 0.0,
    "slow_s": 0.05,
    "hang_s": 3600.0,
    "on_start": False,
    "busy_ms": 0.0,
}


class InjectedFault(EnvError, RuntimeError):
    """A failure the ``faulty`` env made on purpose."""


@dataclass(frozen=True)
class Faults:
    fail_rate: float = 0.0
    hang_rate: float = 0.0
    slow_rate: float = 0.0
    slow_s: float = 0.05
    hang_s: float = 3600.0
    on_start: bool = False
    busy_ms: float = 0.0

    def __post_init__(self) -> None:
        rates = (self.fail_rate, self.hang_rate, self.slow_rate)
        if any(not 0.0 <= r <= 1.0 for r in rates) or sum(rates) > 1.0:
            raise ValueError(f"fail_rate, hang_rate and slow_rate must be in [0, 1] and sum to at most 1 (got {rates})")
        if self.slow_s < 0 or self.hang_s < 0 or self.busy_ms < 0:
            raise ValueError(
                f"slow_s, hang_s and busy_ms must be >= 0 (got {self.slow_s}, {self.hang_s}, {self.busy_ms})"
            )

    def burn(self) -> None:
        """Hold the CPU (and the GIL) for ``busy_ms``, as a parser, a judge or a simulator would."""
        end = time.perf_counter() + self.busy_ms / 1000
        while time.perf_counter() < end:
            pass

    async def draw(self, rng: random.Random, where: str) -> None:
        u = rng.random()
        if u < self.fail_rate:
            raise InjectedFault(f"injected failure in {where}")
        u -= self.fail_rate
        if u < self.hang_rate:
            await asyncio.sleep(self.hang_s)
        elif u - self.hang_rate < self.slow_rate:
            await asyncio.sleep(self.slow_s)


class FaultyEnv(Env):
    def __init__(self, inner: Env, faults: Faults, rng: random.Random):
        self.inner, self.faults, self.rng = inner, faults, rng

    async def initial_observation(self):
        if self.faults.on_start:
            await self.faults.draw(self.rng, "initial_observation")
        return await self.inner.initial_observation()

    async def step(self, action: SampledTokens) -> StepResult:
        if self.faults.busy_ms:
            self.faults.burn()
        await self.faults.draw(self.rng, "step")
        return await self.inner.step(action)


@dataclass
class FaultyGroup(EnvGroupBuilder):
    """Wraps a group builder; picklable when the wrapped one is."""

    inner: EnvGroupBuilder
    faults: Faults
    seed: str
    calls: int = field(default=0)

    async def make_envs(self) -> Sequence[Env]:
        call, self.calls = self.calls, self.calls + 1
        envs = await self.inner.make_envs()
        return [FaultyEnv(env, self.faults, random.Random(f"{self.seed}/{call}/{i}")) for i, env in enumerate(envs)]

    async def compute_group_rewards(self, trajectories_G: Sequence[Trajectory]) -> list[tuple[float, Metrics]]:
        return await self.inner.compute_group_rewards(trajectories_G)

    async def cleanup(self) -> None:
        await self.inner.cleanup()

    def logging_tags(self) -> list[str]:
        return self.inner.logging_tags()


class FaultyDataset(RLDataset):
    def __init__(self, inner: RLDataset, faults: Faults, seed: int):
        self.inner, self.faults, self.seed = inner, faults, seed

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        return [
            FaultyGroup(b, self.faults, f"{self.seed}/{index}/{j}") for j, b in enumerate(self.inner.get_batch(index))
        ]

    def __len__(self) -> int:
        return len(self.inner)


def wrap(ctx: EnvContext) -> FaultyDataset:
    options = ctx.options
    name = options["env"]
    if name in ("faulty", "flaky_arithmetic"):
        raise ValueError(f"the faulty env cannot wrap '{name}'; name the env to wrap, e.g. env = 'arithmetic'")
    faults = Faults(**{k: options[k] for k in FAULT_OPTIONS if k != "env"})
    inner_options = {k: v for k, v in options.items() if k not in FAULT_OPTIONS}
    inner_ctx = dataclasses.replace(ctx, options=inner_options)
    return FaultyDataset(registry.envs.get(name)(inner_ctx), faults, ctx.seed)


@registry.register_env("faulty", options=FAULT_OPTIONS, passes_on="env")
def make_dataset(ctx: EnvContext) -> FaultyDataset:
    """Test env: any env (default arithmetic) with seeded failures, hangs, slow steps."""
    return wrap(ctx)


@registry.register_env("flaky_arithmetic", options={**FAULT_OPTIONS, "fail_rate": 0.2}, passes_on="env")
def make_flaky_arithmetic(ctx: EnvContext) -> FaultyDataset:
    """Test env: arithmetic with 20% of steps failing, to exercise retries."""
    return wrap(ctx)
