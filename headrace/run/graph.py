"""The actor graph of a run, read top to bottom: the actors, the channels between them, and
the two numbers a scheduler changes. Every scheduler runs this same graph.

    dataset ──▶ admission ─rollout_q─▶ rollouts ─results_q─▶ advantages ─learner_q─▶ learner
                    ▲                       │ sample()                                   │ publish(k+1)
                    └─── version ◀────── sampler ◀───────────── weights ◀─────────────────┘
                                            ▲
                                        evaluator (eval.every: held-out episodes on published versions)

- admission: admits batch k once the sampler holds version ≥ k − ``scheduler.lag()``.
- rollouts: workers, one group each at a time; a failed member is retried against the group's
  budget, and a run of dropped groups stops the run.
- advantages: per-group advantages, the constant-reward filter, the datums.
- learner: step k trains batch k in ``scheduler.minibatches()`` forward_backward calls and one
  optim_step, submitted before the previous step's results are awaited; then publishes k+1.
- sampler: serves every sample call with the newest published weights.

``sync`` is lag 0 and 1 minibatch; ``stream`` sends each minibatch as its groups arrive;
``async`` admits up to ``max_steps_off_policy`` batches ahead; ``inflight`` admits group by group
within the same bound (``InflightGate``: its ledger, and two actors, one admitting, one between
advantages and learner giving each finished group its step), and the sampler swaps weights into
running generations.
Every channel is bounded by what admission may let in (``batch_size × (lag + 1)``), so memory does
not grow with the run.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio

from headrace.core.admission import Admission, AdmissionGate, InflightGate
from headrace.core.advantage_actor import AdvantageActor, AdvantageSettings, ProcessedGroup, SampleSink
from headrace.core.channel import Channel
from headrace.core.episode import EpisodeSpec
from headrace.core.errors import root_cause
from headrace.core.evaluate import Evaluator
from headrace.core.learner import LearnerActor, LearnerSettings, StepReport
from headrace.core.protocols import Backend, ChecksLoss
from headrace.core.retry import Backoff
from headrace.core.rollout import RetrySettings, RolloutActor, RolloutItem, RolloutResult
from headrace.core.sampler import SamplerActor
from headrace.core.trace import StepPublished, Tracer
from headrace.core.types import AdamParams, RLDataset, SamplerHandle
from headrace.run.config import RunConfig
from headrace.run.metrics import StepMeter
from headrace.schedulers.base import Scheduler

# what the run does with each step's row: write it, record the step's checkpoint, tell the caller
RecordStep = Callable[[dict[str, Any], "str | None", int], Awaitable[None]]


@dataclass
class Graph:
    admission: Admission
    rollouts: RolloutActor
    advantages: AdvantageActor
    sampler: SamplerActor
    learner: LearnerActor
    meter: StepMeter  # the run's tallies, read when it ends
    evaluator: Evaluator | None = None

    async def run(self) -> None:
        """Every actor in one task group, until the learner is done; the first error stops all."""
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.sampler.run)
                for actor in self.admission.actors():
                    tg.start_soon(actor)
                tg.start_soon(self.rollouts.run)
                tg.start_soon(self.advantages.run)
                if self.evaluator is not None:
                    tg.start_soon(self.evaluator.run)
                await self.learner.run()
                # the learner is done (every step, or stopped early): nothing left to sample for
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            raise root_cause(group) from None


def build_graph(
    config: RunConfig,
    scheduler: Scheduler,
    backend: Backend,
    dataset: RLDataset,
    handle: SamplerHandle,
    steps: range,
    record_step: RecordStep,
    samples: SampleSink | None = None,
    eval_dataset: RLDataset | None = None,
    tracer: Tracer | None = None,
) -> Graph:
    lag, minibatches = scheduler.lag(), scheduler.minibatches()

    # the channels: every admitted-but-untrained batch can be in flight at once, no more
    in_flight = max(config.batch_size * (lag + 1), 1)
    rollout_q: Channel[RolloutItem] = Channel(in_flight, "rollout")
    results_q: Channel[RolloutResult] = Channel(max(config.batch_size, 1), "results")
    learner_q: Channel[ProcessedGroup] = Channel(in_flight, "learner")

    # the sampler: every sample call of the run goes through it, stamped with its version
    retry = config.retry
    backoff = Backoff(retry.backoff_attempts, retry.backoff_initial_s, retry.backoff_max_s)
    scheduler.check_backend(backend.sampling)
    sampler = SamplerActor(
        backend.sampling,
        handle,
        backoff,
        tracer,
        swap_in_flight=scheduler.swap_in_flight(),
        reproducible=scheduler.reproducible(),
    )

    # rollouts -> advantages: whole groups (or dropped ones), rewards computed with the group
    spec = EpisodeSpec(
        config.sampling.params(),
        config.max_turns,
        config.seed,
        getattr(backend.tokenizer, "vocab_size", None),
    )
    rollouts = RolloutActor(
        rollout_q,
        results_q,
        sampler,
        spec,
        RetrySettings(retry.budget, retry.rollout_timeout_s, retry.partial_groups, retry.max_consecutive_dropped),
        config.rollout_workers or in_flight,
        tracer,
    )

    # gate -> rollouts: batch k admitted at version k - lag; or (admission by sample) each group
    # while its deadline, version + lag, can be met, then given a step when it is finished
    admission: Admission
    advantages_out = learner_q
    if scheduler.admission() == "sample":
        advantages_out = Channel(in_flight, "finished")
        admission = InflightGate(
            dataset,
            rollout_q,
            advantages_out,
            learner_q,
            sampler,
            steps,
            lag,
            config.batch_size,
            scheduler.overdue,
            rollouts.regenerate,
        )
    else:
        admission = AdmissionGate(dataset, rollout_q, sampler, steps, lag)

    # advantages -> learner: datums, or an empty group (filtered, dropped) the step still counts
    advantages = AdvantageActor(
        results_q,
        advantages_out,
        AdvantageSettings(config.advantages.normalize_std, config.advantages.filter_constant),
        samples,
    )

    # the evaluator: beside the actors, never in the learner's way
    evaluator = None
    if eval_dataset is not None:
        evaluator = Evaluator(config.eval, config.eval.env or config.env, eval_dataset, sampler, spec)

    # learner -> sampler: step k trained in `minibatches` calls, then version k+1 published
    meter = StepMeter((rollout_q, results_q, learner_q), rollouts.error_counts)

    async def report(step: StepReport) -> None:
        row = meter.row(step) | admission.figures()
        if evaluator is not None:
            if step.step + 1 == steps.stop:
                await evaluator.evaluate_last(sampler.handle, config.eval.final_timeout_s)
            elif evaluator.due(step.step):
                evaluator.submit(sampler.handle)
            row |= evaluator.take()
        await record_step(row, step.checkpoint, step.step + 1)
        if tracer is not None:
            tracer(StepPublished(step.step, step.version, row, time.perf_counter()))

    loss = config.loss
    settings = LearnerSettings(
        minibatches=minibatches,
        loss=loss.spec(config.sampling.max_tokens),
        adam=AdamParams(**config.optim.model_dump()),
        save_every=config.checkpoint.every,
        backoff=backoff,
    )
    # a backend that cannot compute this loss says so now, not after the first batch is sampled
    if isinstance(backend.training, ChecksLoss):
        backend.training.check_loss(settings.loss)
    learner = LearnerActor(learner_q, backend.training, sampler, settings, steps, report, tracer)
    return Graph(admission, rollouts, advantages, sampler, learner, meter, evaluator)
