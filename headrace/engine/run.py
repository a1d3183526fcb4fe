"""A training run: build the actors from a config, let the scheduler wire them, report each step."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from headrace.engine import logs, registry
from headrace.engine.channel import Channel
from headrace.engine.config import ConfigError, RunConfig
from headrace.engine.episode import EpisodeSpec
from headrace.engine.gate import AdmissionGate
from headrace.engine.interrupt import stop_on_signals
from headrace.engine.learner import LearnerActor, LearnerPolicy, StepReport
from headrace.engine.metrics import StepMeter
from headrace.engine.protocols import Backend
from headrace.engine.reward import AdvantagePolicy, RewardActor
from headrace.engine.rollout import RetryPolicy, RolloutActor
from headrace.engine.rundir import RunDir, RunDirError
from headrace.engine.sampler import SamplerActor
from headrace.engine.scheduler import Actors, Scheduler
from headrace.engine.types import AdamParams, EnvContext, LossSpec, RLDataset, SamplingParams

log = structlog.get_logger("headrace.run")
KEEP_ROWS = 100


@dataclass
class RunSummary:
    run_dir: str
    steps: int
    wall_s: float
    metrics: list[dict[str, Any]] = field(default_factory=list)
    backend: Any = None  # the backend object, for tests that inspect its recorded timeline
    actors: Any = None  # the run's actors (sampler, learner...), for the benchmarks' busy-time figures
    stopped_by: str | None = None  # the signal that stopped the run early, if one did


def make_dataset(config: RunConfig, backend: Backend) -> RLDataset:
    factory = registry.envs.get(config.env)
    ctx = EnvContext(
        tokenizer=backend.tokenizer,
        group_size=config.group_size,
        batch_size=config.batch_size,
        steps=config.steps,
        seed=config.seed,
        max_tokens=config.sampling.max_tokens,
        options=dict(config.env_options),
    )
    try:
        return factory(ctx)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"env '{config.env}' rejected its options {config.env_options}: {e}") from e


def make_backend(config: RunConfig) -> Backend:
    factory = registry.backends.get(config.backend)
    backend = factory(config)
    if config.sampler:
        backend = registry.samplers.get(config.sampler)(config, backend)
    return backend


async def train(
    config: RunConfig,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    dataset: RLDataset | None = None,
    handle_signals: bool = False,
) -> RunSummary:
    """Train for ``config.steps`` steps (resuming if asked). With ``handle_signals``, the first
    SIGINT/SIGTERM stops at the next step boundary and checkpoints; a second exits at once."""
    scheduler: Scheduler = registry.schedulers.get(config.scheduler)(config)
    run_dir = RunDir.prepare(config)
    # backends keep their checkpoints and manifests in the run directory, also when it was defaulted
    config = config.model_copy(update={"run_dir": str(run_dir.path)})
    logs.configure(run_dir.path / "log.jsonl")
    backend = make_backend(config)
    started = time.perf_counter()
    async with backend:
        dataset = dataset if dataset is not None else make_dataset(config, backend)
        start_step, handle = await _restore(config, run_dir, backend)
        log.info("run_start", run_dir=str(run_dir.path), start_step=start_step, **backend.describe())
        # the newest rows only: the full history is metrics.jsonl, and memory must stay flat
        rows: deque[dict[str, Any]] = deque(maxlen=KEEP_ROWS)
        actors = build_actors(config, scheduler, backend, dataset, handle, range(start_step, config.steps), run_dir, rows, on_step)
        with stop_on_signals(actors.learner.request_stop, enabled=handle_signals) as stopped_by:
            await scheduler.run(actors)
        done = actors.learner.completed
        if done > start_step and run_dir.last_checkpoint_step() != done:
            run_dir.record_checkpoint(done, await backend.training.save_state(f"step_{done:06d}"))
        log.info("run_end", steps=done, wall_s=time.perf_counter() - started, stopped_by=stopped_by.get("signal"))
    wall = time.perf_counter() - started
    return RunSummary(str(run_dir.path), done, wall, list(rows), backend, actors, stopped_by.get("signal"))


async def _restore(config: RunConfig, run_dir: RunDir, backend: Backend):
    latest = run_dir.latest_checkpoint() if config.resume else None
    if latest is None:
        return 0, backend.initial_handle()
    try:
        await backend.training.load_state(latest["path"])
    except Exception as e:
        raise RunDirError(
            f"cannot resume from checkpoint '{latest['path']}' (step {latest['step']}): {e}. "
            "Fix or remove the checkpoint, or pass --overwrite to start over."
        ) from e
    run_dir.truncate_metrics(latest["step"])
    log.info("resumed", step=latest["step"], path=latest["path"])
    return latest["step"], await backend.training.publish(latest["step"])


def build_actors(config, scheduler, backend, dataset, handle, steps, run_dir, rows, on_step) -> Actors:
    lag = scheduler.lag()
    # every admitted-but-untrained batch can be in flight at once; more queue room buys nothing
    in_flight = config.batch_size * (lag + 1)
    rollout_q = Channel(max(in_flight, 1), "rollout")
    reward_q = Channel(max(config.batch_size, 1), "reward")
    learner_q = Channel(max(in_flight, 1), "learner")
    sampler = SamplerActor(backend.sampling, handle)
    spec = EpisodeSpec(
        SamplingParams(
            max_tokens=config.sampling.max_tokens,
            temperature=config.sampling.temperature,
            top_p=config.sampling.top_p,
            top_k=config.sampling.top_k,
        ),
        config.max_turns,
        config.seed,
    )
    retry = RetryPolicy(config.retry.budget, config.retry.rollout_timeout_s, config.retry.partial_groups)
    rollouts = RolloutActor(rollout_q, reward_q, sampler, spec, retry, config.rollout_workers or in_flight)
    rewards = RewardActor(
        reward_q,
        learner_q,
        AdvantagePolicy(config.advantages.normalize_std, config.advantages.filter_constant, config.retry.max_consecutive_dropped),
    )
    policy = LearnerPolicy(
        minibatches=scheduler.minibatches(),
        loss=LossSpec(config.loss.name, {"clip_low_threshold": config.loss.clip_low_threshold, "clip_high_threshold": config.loss.clip_high_threshold}),
        adam=AdamParams(**config.optim.model_dump()),
        pipeline=config.pipeline,
        save_every=config.save_every,
    )
    gate = AdmissionGate(dataset, rollout_q, sampler, steps, lag)
    meter = StepMeter((rollout_q, reward_q, learner_q), rollouts.error_counts)

    async def report(step: StepReport) -> None:
        row = meter.row(step)
        run_dir.append_metrics(row)
        if step.checkpoint:
            run_dir.record_checkpoint(step.step + 1, step.checkpoint)
        rows.append(row)
        if on_step:
            on_step(row)

    learner = LearnerActor(learner_q, backend.training, sampler, policy, steps, report)
    return Actors(gate, rollouts, rewards, sampler, learner)
