"""A training run: build the actors from a config, let the scheduler wire them, report each step."""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from headrace.core import logs
from headrace.core.advantage_actor import AdvantageSettings, ProcessedGroup, AdvantageActor
from headrace.core.channel import Channel
from headrace.core.episode import EpisodeSpec
from headrace.core.evaluate import Evaluator, eval_config
from headrace.core.gate import AdmissionGate, check_dataset
from headrace.core.learner import LearnerActor, LearnerSettings, StepReport
from headrace.core.protocols import Backend
from headrace.core.retry import Backoff
from headrace.core.rollout import RetrySettings, RolloutActor, RolloutItem, RolloutResult
from headrace.core.sampler import SamplerActor
from headrace.core.types import AdamParams, EnvContext, LossSpec, RLDataset, SamplingParams
from headrace.models.registry import apply_model_defaults
from headrace.run import registry
from headrace.run.config import ConfigError, RunConfig
from headrace.run.graph import Actors, Scheduler
from headrace.run.interrupt import stop_on_signals
from headrace.run.metrics import StepMeter
from headrace.run.rundir import RunDir
from headrace.run.rundir_errors import DiskFullError, RunDirError, explained, is_disk_full
from headrace.viewer.samples import RolloutSampleWriter

log = logs.get_logger()
KEEP_ROWS = 100


@dataclass
class RunSummary:
    run_dir: str
    steps: int  # the run's steps done, by this process and the ones it resumed
    wall_s: float
    metrics: list[dict[str, Any]] = field(default_factory=list)  # this process's newest rows
    backend: Any = None  # the backend object, for tests that inspect its recorded timeline
    actors: Any = None  # the run's actors (sampler, learner...), for the benchmarks' busy-time figures
    stopped_by: str | None = None  # the signal that stopped the run early, if one did
    start_step: int = 0  # where this process started: the checkpoint it resumed from, else 0
    first_rows: list[dict[str, Any]] = field(default_factory=list)  # this process's first rows
    dropped_groups: int = 0  # over this process's steps

    @property
    def trained(self) -> int:
        """Steps trained by this process."""
        return self.steps - self.start_step


@dataclass
class _Rows:
    """This process's rows, bounded (metrics.jsonl holds them all): the first and the newest
    KEEP_ROWS, which the summary compares, and running totals."""

    first: list[dict[str, Any]] = field(default_factory=list)
    newest: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=KEEP_ROWS))
    dropped_groups: int = 0

    def add(self, row: dict[str, Any]) -> None:
        if len(self.first) < KEEP_ROWS:
            self.first.append(row)
        self.newest.append(row)
        self.dropped_groups += int(row.get("groups/dropped") or 0)


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
        model=config.model,
        renderer_name=config.renderer,
    )
    try:
        dataset = factory(ctx)
    except (ConfigError, registry.UnknownNameError):
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"env '{config.env}' rejected its options {config.env_options}: {e}") from e
    except Exception as e:
        raise ConfigError(
            f"env '{config.env}' failed to build its dataset ({type(e).__name__}: {e}); "
            "fix the env's factory or its options (env_options)"
        ) from e
    return check_dataset(dataset, f"env '{config.env}'")


def _eval_dataset(config: RunConfig, backend: Backend) -> RLDataset | None:
    if not config.eval.every:
        return None
    try:
        return make_dataset(eval_config(config), backend)
    except (ConfigError, registry.UnknownNameError) as e:
        raise ConfigError(f"eval: {e} (the eval env and its options are eval.env and eval.env_options)") from e


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
    # a pretrained model's sampling length, learning rate and LoRA rank, where the user set none
    config = apply_model_defaults(config)
    scheduler: Scheduler = registry.schedulers.get(config.scheduler)(config)
    # the directory is locked while the run lives: a second run there is refused
    with RunDir.open(config) as run_dir, ExitStack() as scope:
        # backends keep their checkpoints and manifests in the run directory, also when it was defaulted
        config = config.model_copy(update={"run_dir": str(run_dir.path)})
        with explained(run_dir.path):
            scope.enter_context(logs.run_log(run_dir.path / "log.jsonl"))  # this run's lines only
        try:
            return await _train(config, scheduler, run_dir, on_step, dataset, handle_signals)
        except Exception as e:
            if is_disk_full(e, run_dir.path):
                raise DiskFullError(run_dir.disk_full_message(e)) from e
            raise


async def _train(config, scheduler, run_dir, on_step, dataset, handle_signals) -> RunSummary:
    backend = make_backend(config)
    started = time.perf_counter()
    async with backend:
        dataset = dataset if dataset is not None else make_dataset(config, backend)
        eval_dataset = _eval_dataset(config, backend)
        start_step, handle = await _restore(config, run_dir, backend)
        log.info(
            "run_start",
            run_dir=str(run_dir.path),
            start_step=start_step,
            lock_taken_from=run_dir.lock.taken_over,
            **backend.describe(),
        )
        rows = _Rows()
        actors = build_actors(
            config,
            scheduler,
            backend,
            dataset,
            handle,
            range(start_step, config.steps),
            run_dir,
            rows,
            on_step,
            eval_dataset,
        )
        with stop_on_signals(actors.learner.request_stop, enabled=handle_signals) as stopped_by:
            await scheduler.run(actors)
            done = actors.learner.completed
            # under the signal handler still: a second Ctrl-C during this save exits at once, and
            # --resume then trains the steps after the last checkpoint again
            if done > start_step and run_dir.last_checkpoint_step() != done:
                path = await backend.training.save_state(f"step_{done:06d}")
                await _record_checkpoint(config, run_dir, backend.training, done, path)
        log.info("run_end", steps=done, wall_s=time.perf_counter() - started, stopped_by=stopped_by.get("signal"))
        if not stopped_by and (no_update := actors.meter.no_update_error()):
            raise no_update
    wall = time.perf_counter() - started
    return RunSummary(
        str(run_dir.path),
        done,
        wall,
        list(rows.newest),
        backend,
        actors,
        stopped_by.get("signal"),
        start_step,
        rows.first,
        rows.dropped_groups,
    )


async def _restore(config: RunConfig, run_dir: RunDir, backend: Backend):
    """Where this process starts: on resume, the last checkpoint, or step 0 when there is none.
    The metrics rows after it are cut (those steps are trained again), so every step has one row."""
    if not config.resume:
        return 0, backend.initial_handle()
    latest = run_dir.latest_checkpoint()
    if latest is not None:
        try:
            await backend.training.load_state(latest["path"])
        except Exception as e:
            raise RunDirError(
                f"cannot resume from checkpoint '{latest['path']}' (step {latest['step']}): {e}. "
                "Fix or remove the checkpoint, or pass --overwrite to start over."
            ) from e
    step = latest["step"] if latest else 0
    removed, torn, kept = run_dir.cut_metrics(step)
    if torn:
        _notice(
            "metrics.jsonl ended in a partial line (the run was cut off while writing it: a crash or a full "
            "disk); that line is dropped and its step trained again"
        )
    if latest is None:
        gone = f"; its {removed} metrics rows are removed and those steps trained again" if removed else ""
        _notice(f"no checkpoint in {run_dir.path} (the run stopped before saving one): starting over from step 0{gone}")
        return 0, backend.initial_handle()
    gone = f"; the {removed} metrics rows after it are removed and those steps trained again" if removed else ""
    _notice(f"resuming {run_dir.path} from its checkpoint after step {step}{gone}")
    if kept < step:
        _notice(f"metrics.jsonl holds rows for only {kept} of the {step} steps before the checkpoint")
    log.info("resumed", step=step, path=latest["path"], rows_removed=removed, torn_line=torn)
    return step, await backend.training.publish(step)


def _notice(text: str) -> None:
    log.warning("notice", text=text)
    print(f"headrace: {text}", file=sys.stderr, flush=True)


async def _record_checkpoint(config: RunConfig, run_dir: RunDir, training: Any, step: int, path: str) -> None:
    """Record a checkpoint, then delete the local ones beyond ``checkpoint.keep_last`` (a backend
    whose states live elsewhere, like Tinker's, has no ``delete_state`` and keeps every one)."""
    run_dir.record_checkpoint(step, path)
    delete = getattr(training, "delete_state", None)
    if delete is None:
        return
    for entry in run_dir.prunable(config.checkpoint.keep_last, config.checkpoint.keep_every):
        try:
            await delete(entry["path"])
        except Exception as e:  # noqa: BLE001 - a checkpoint left behind costs disk space, not the run
            log.warning("checkpoint_not_deleted", path=entry["path"], error=f"{type(e).__name__}: {e}")
            continue
        run_dir.forget_checkpoint(entry)


def build_actors(
    config, scheduler, backend, dataset, handle, steps, run_dir, rows, on_step, eval_dataset=None
) -> Actors:
    lag = scheduler.lag()
    # every admitted-but-untrained batch can be in flight at once; more queue room buys nothing
    in_flight = config.batch_size * (lag + 1)
    rollout_q: Channel[RolloutItem] = Channel(max(in_flight, 1), "rollout")
    reward_q: Channel[RolloutResult] = Channel(max(config.batch_size, 1), "reward")
    learner_q: Channel[ProcessedGroup] = Channel(max(in_flight, 1), "learner")
    backoff = Backoff(config.retry.backoff_attempts, config.retry.backoff_initial_s, config.retry.backoff_max_s)
    sampler = SamplerActor(backend.sampling, handle, backoff)
    spec = EpisodeSpec(
        SamplingParams(
            max_tokens=config.sampling.max_tokens,
            temperature=config.sampling.temperature,
            top_p=config.sampling.top_p,
            top_k=config.sampling.top_k,
        ),
        config.max_turns,
        config.seed,
        getattr(backend.tokenizer, "vocab_size", None),
    )
    retry = RetrySettings(
        config.retry.budget,
        config.retry.rollout_timeout_s,
        config.retry.partial_groups,
        config.retry.max_consecutive_dropped,
    )
    rollouts = RolloutActor(rollout_q, reward_q, sampler, spec, retry, config.rollout_workers or in_flight)
    samples = RolloutSampleWriter(run_dir.path, config.log_rollouts, backend.tokenizer)
    rewards = AdvantageActor(
        reward_q,
        learner_q,
        AdvantageSettings(config.advantages.normalize_std, config.advantages.filter_constant),
        samples.write if samples.per_step else None,
    )
    policy = LearnerSettings(
        minibatches=scheduler.minibatches(),
        loss=LossSpec(
            config.loss.name,
            {
                "clip_low_threshold": config.loss.clip_low_threshold,
                "clip_high_threshold": config.loss.clip_high_threshold,
            },
        ),
        adam=AdamParams(**config.optim.model_dump()),
        pipeline=config.pipeline,
        save_every=config.checkpoint.every,
        backoff=backoff,
    )
    gate = AdmissionGate(dataset, rollout_q, sampler, steps, lag)
    meter = StepMeter((rollout_q, reward_q, learner_q), rollouts.error_counts)
    evaluator = None
    if eval_dataset is not None:
        evaluator = Evaluator(config.eval, config.eval.env or config.env, eval_dataset, sampler, spec)

    async def report(step: StepReport) -> None:
        row = meter.row(step)
        if evaluator is not None:
            if step.step + 1 == steps.stop:
                await evaluator.evaluate_last(sampler.handle, config.eval.final_timeout_s)
            elif evaluator.due(step.step):
                evaluator.submit(sampler.handle)
            row |= evaluator.take()
        run_dir.append_metrics(row)
        if step.checkpoint:
            await _record_checkpoint(config, run_dir, backend.training, step.step + 1, step.checkpoint)
        rows.add(row)
        if on_step:
            on_step(row)

    learner = LearnerActor(learner_q, backend.training, sampler, policy, steps, report)
    return Actors(gate, rollouts, rewards, sampler, learner, meter, evaluator)
