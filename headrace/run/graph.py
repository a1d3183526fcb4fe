"""What every scheduler shares: the actors of a run, started in one task group.

A scheduler is only a policy: how far the gate may admit ahead of the learner (``lag``), and in
how many ``forward_backward`` calls the learner consumes a batch (``minibatches``). The files in
``headrace/schedulers/`` choose those two numbers and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio

from headrace.core.advantage_actor import AdvantageActor
from headrace.core.evaluate import Evaluator
from headrace.core.gate import AdmissionGate
from headrace.core.learner import LearnerActor
from headrace.core.rollout import RolloutActor
from headrace.core.sampler import SamplerActor
from headrace.run.config import RunConfig
from headrace.run.metrics import StepMeter


@dataclass
class Actors:
    gate: AdmissionGate
    rollouts: RolloutActor
    rewards: AdvantageActor
    sampler: SamplerActor
    learner: LearnerActor
    meter: StepMeter  # the run's tallies, read when it ends
    evaluator: Evaluator | None = None  # eval.every: held-out evaluation beside the actors


class Scheduler:
    name: str = ""

    def __init__(self, config: RunConfig):
        self.config = config

    def lag(self) -> int:
        """Batch k may be sampled once the learner has published version k - lag."""
        return 0

    def minibatches(self) -> int:
        """forward_backward calls per step."""
        return 1

    async def run(self, actors: Actors) -> None:
        try:
            await self._run(actors)
        except BaseExceptionGroup as group:
            raise root_cause(group) from None

    async def _run(self, actors: Actors) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(actors.sampler.run)
            tg.start_soon(actors.gate.run)
            tg.start_soon(actors.rollouts.run)
            tg.start_soon(actors.rewards.run)
            if actors.evaluator is not None:
                tg.start_soon(actors.evaluator.run)
            await actors.learner.run()
            # the learner is done (every step, or stopped early): nothing left to sample for
            tg.cancel_scope.cancel()


def root_cause(group: BaseExceptionGroup) -> BaseException:
    """The error that started a failure: nested task groups wrap it, and the siblings it
    cancelled add nothing. Its own traceback is kept."""
    leaves: list[BaseException] = []

    def walk(error: BaseException) -> None:
        if isinstance(error, BaseExceptionGroup):
            for inner in error.exceptions:
                walk(inner)
        else:
            leaves.append(error)

    walk(group)
    for leaf in leaves:
        if not isinstance(leaf, anyio.get_cancelled_exc_class()):
            return leaf
    return leaves[0] if leaves else group
