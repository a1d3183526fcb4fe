"""A training run: open the run directory and the backend, restore, run the actor graph
(``headrace/run/graph.py``) step by step, save, and return the summary."""

from __future__ import annotations

import asyncio
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable
from contextlib import AsyncExitStack, ExitStack
from dataclasses import dataclass, field
from typing import Any

from headrace.core import logs
from headrace.core.admission import check_dataset
from headrace.core.errors import BackendError, ConfigError
from headrace.core.evaluate import EVAL_SEED_OFFSET
from headrace.core.lifespan import lifespans
from headrace.core.protocols import Backend, DeletesState, Distributes, ExportsWeights
from headrace.core.trace import RunStarted, Tracer
from headrace.core.types import RLDataset
from headrace.envs.context import EnvContext
from headrace.models.registry import check_model_name
from headrace.plugins import registry
from headrace.run import distill
from headrace.run.backends import make_backend
from headrace.run.config import MAX_SEED, RunConfig
from headrace.run.defaults import apply_model_defaults
from headrace.run.graph import build_graph
from headrace.run.interrupt import stop_on_signals
from headrace.run.rundir import RunDir
from headrace.run.rundir_errors import DiskFullError, RunDirError, explained, is_disk_full
from headrace.run.scheduling import make_scheduler
from headrace.run.stalls import warn_when_blocked
from headrace.run.trackers import open_trackers
from headrace.schedulers.base import Scheduler
from headrace.viewer.samples import RolloutSampleWriter

log = logs.get_logger()
KEEP_ROWS = 100


@dataclass
class RunSummary:
    run_dir: str
    steps: int  # the run's steps done, by this process and the ones it resumed
    wall_s: float
    metrics: list[dict[str, Any]] = field(default_factory=list)  # this process's newest rows
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


def check_names(config: RunConfig, dataset: RLDataset | None = None) -> None:
    """What can be refused before anything is written: a model name that is a misspelt registered
    one, and the env's options (and the eval env's) against what the envs declare, each with the
    closest name. ``dataset``: the run brings its own, and only the eval env's are checked."""
    check_model_name(config.model)
    if dataset is None:
        _check_options(config)
    if config.eval.every:
        try:
            _check_options(eval_config(config))
        except (ConfigError, registry.UnknownNameError) as e:
            raise ConfigError(f"eval: {e} (the eval env and its options are eval.env and eval.env_options)") from e


def _check_options(config: RunConfig) -> None:
    try:
        registry.check_env_options(config.env, config.env_options)
    except ConfigError:  # the env itself could not be loaded: its own paragraph
        raise
    except ValueError as e:
        raise ConfigError(f"env '{config.env}' rejected its options {config.env_options}: {e}") from e


def eval_config(config: RunConfig) -> RunConfig:
    """The run's config reshaped to build the eval dataset with ``make_dataset``: one batch of
    ``eval.problems`` groups of ``eval.samples``, from the eval env and its options."""
    ev = config.eval
    same_env = ev.env is None or ev.env == config.env
    options = {**config.env_options, **ev.env_options} if same_env else dict(ev.env_options)
    return config.model_copy(
        update={
            "env": ev.env or config.env,
            "env_options": options,
            "batch_size": ev.problems,
            "group_size": ev.samples,
            "steps": 1,
            "seed": (config.seed + EVAL_SEED_OFFSET) % (MAX_SEED + 1),
        }
    )


def _eval_dataset(config: RunConfig, backend: Backend) -> RLDataset | None:
    if not config.eval.every:
        return None
    try:
        return make_dataset(eval_config(config), backend)
    except (ConfigError, registry.UnknownNameError) as e:
        raise ConfigError(f"eval: {e} (the eval env and its options are eval.env and eval.env_options)") from e


async def train(
    config: RunConfig,
    *,
    dataset: RLDataset | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    tracer: Tracer | None = None,
    handle_signals: bool = False,
) -> RunSummary:
    """Train for ``config.steps`` steps (resuming if asked). ``on_step`` gets each metrics row as
    it is written, ``tracer`` every event (``headrace.core.trace``). With ``handle_signals``, the
    first SIGINT/SIGTERM stops at the next step boundary and checkpoints; a second exits at once."""
    # a pretrained model's sampling length, learning rate and LoRA rank, where the user set none
    config = apply_model_defaults(config)
    scheduler = make_scheduler(config)
    check_names(config, dataset)
    # the directory is locked while the run lives: a second run there is refused
    with RunDir.open(config) as run_dir, ExitStack() as scope:
        # backends keep their checkpoints and manifests in the run directory, also when it was defaulted
        config = config.model_copy(update={"run_dir": str(run_dir.path)})
        with explained(run_dir.path):
            scope.enter_context(logs.run_log(run_dir.path / "log.jsonl"))  # this run's lines only
        track = scope.enter_context(open_trackers(config.log, config, run_dir.path))  # --log wandb,tensorboard
        try:
            return await _train(config, scheduler, run_dir, dataset, on_step, track, tracer, handle_signals)
        except Exception as e:
            if is_disk_full(e, run_dir.path):
                raise DiskFullError(run_dir.disk_full_message(e)) from e
            raise


async def _train(
    config: RunConfig,
    scheduler: Scheduler,
    run_dir: RunDir,
    dataset: RLDataset | None,
    on_step: Callable[[dict[str, Any]], None] | None,
    track: Callable[[dict[str, Any]], None],
    tracer: Tracer | None,
    handle_signals: bool,
) -> RunSummary:
    latest = run_dir.latest_checkpoint() if config.resume else None
    resume_checkpoint = (latest["step"], latest["path"]) if latest else None
    backend = make_backend(config, scheduler=scheduler, resume_checkpoint=resume_checkpoint)
    started = time.perf_counter()
    async with backend, AsyncExitStack() as scope:
        dataset = dataset if dataset is not None else make_dataset(config, backend)
        eval_dataset = _eval_dataset(config, backend)
        # --cluster ray: the envs are made and stepped on the rollout workers
        if isinstance(backend, Distributes):
            dataset = backend.distribute(dataset)
            eval_dataset = backend.distribute(eval_dataset) if eval_dataset is not None else None
        start_step, handle = await _restore(config, run_dir, backend)
        rows = _Rows()

        async def record_step(row: dict[str, Any], checkpoint: str | None, done: int) -> None:
            run_dir.append_metrics(row)
            track(row)
            if checkpoint:
                await _record_checkpoint(config, run_dir, backend.training, done, checkpoint)
            rows.add(row)
            if on_step:
                on_step(row)

        samples = RolloutSampleWriter(run_dir.path, config.log_rollouts, backend.tokenizer)
        teacher = await scope.enter_async_context(
            distill.teacher(config, getattr(backend.tokenizer, "vocab_size", None))
        )
        graph = build_graph(
            config,
            scheduler,
            backend,
            dataset,
            handle,
            range(start_step, config.steps),
            record_step,
            samples.write if samples.per_step else None,
            eval_dataset,
            tracer,
            teacher,
        )
        run_dir.began = True  # set up: from here on the directory holds this run, whatever happens
        log.info(
            "run_start",
            run_dir=str(run_dir.path),
            start_step=start_step,
            lock_taken_from=run_dir.lock.taken_over,
            **backend.describe(),
        )
        if tracer is not None:
            tracer(RunStarted(str(run_dir.path), start_step, config.steps, backend, time.perf_counter()))
        with (
            stop_on_signals(graph.learner.request_stop, enabled=handle_signals) as stopped_by,
            warn_when_blocked(f"'{config.env}'"),
        ):
            async with lifespans(dataset, eval_dataset):  # what the datasets serve beside the run (an agents' endpoint)
                try:
                    await graph.run()
                finally:
                    samples.close()
            done = graph.learner.completed
            # under the signal handler still: a second Ctrl-C during this save exits at once, and
            # --resume then trains the steps after the last checkpoint again
            if done > start_step and run_dir.last_checkpoint_step() != done:
                path = await backend.training.save_state(f"step_{done:06d}")
                await _record_checkpoint(config, run_dir, backend.training, done, path)
            if done > start_step and not stopped_by:
                await _export_hosted(backend, run_dir, done)
        log.info("run_end", steps=done, wall_s=time.perf_counter() - started, stopped_by=stopped_by.get("signal"))
        if not stopped_by and (no_update := graph.meter.no_update_error()):
            raise no_update
    return RunSummary(
        str(run_dir.path),
        done,
        time.perf_counter() - started,
        list(rows.newest),
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


async def _export_hosted(backend: Backend, run_dir: RunDir, version: int) -> None:
    """``RUN_DIR/final`` (``ExportsWeights``) when the run's checkpoints are not on this machine but
    named by a URL (``tinker://``: a service holds them): the last version's weights as a directory
    others load. A run whose checkpoints are local directories has its weights already."""
    latest = run_dir.latest_checkpoint()
    if not isinstance(backend, ExportsWeights) or latest is None or "://" not in str(latest["path"]):
        return
    handle = await backend.training.publish(version)
    final = run_dir.path / "final"
    if final.exists():
        await asyncio.to_thread(shutil.rmtree, final)
    try:
        path = await asyncio.to_thread(backend.export_weights, handle, final)
    except BackendError as e:  # the run's steps and checkpoints stand; only the local copy is missing
        log.warning("final_not_exported", version=version, error=f"{type(e).__name__}: {e}")
        print(f"headrace: RUN_DIR/final not written: {e}", file=sys.stderr)
        return
    log.info("exported", path=path, version=version)


async def _record_checkpoint(config: RunConfig, run_dir: RunDir, training: Any, step: int, path: str) -> None:
    """Record a checkpoint, then delete the local ones beyond ``checkpoint.keep_last`` (a backend
    whose states live elsewhere, like Tinker's, has no ``delete_state`` and keeps every one)."""
    run_dir.record_checkpoint(step, path)
    if not isinstance(training, DeletesState):
        return
    for entry in run_dir.prunable(config.checkpoint.keep_last, config.checkpoint.keep_every):
        try:
            await training.delete_state(entry["path"])
        except Exception as e:  # noqa: BLE001 - a checkpoint left behind costs disk space, not the run
            log.warning("checkpoint_not_deleted", path=entry["path"], error=f"{type(e).__name__}: {e}")
            continue
        run_dir.forget_checkpoint(entry)
