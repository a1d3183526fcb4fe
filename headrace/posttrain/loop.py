"""What every post-training command shares with ``headrace run``: the run directory and its lock,
``log.jsonl``, the trackers (``--log``), the backend (``--backend``), resume from the last
checkpoint, one metrics row a step, checkpoints and their pruning, and held-out evaluation of an
env through the run's evaluator. The step loop itself is each recipe's."""

from __future__ import annotations

import asyncio
import shutil
import sys
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from headrace.core import logs
from headrace.core.episode import EpisodeSpec
from headrace.core.evaluate import Evaluator
from headrace.core.protocols import Backend, ComputesCustomLoss, DeletesState, ExportsWeights
from headrace.core.sampler import SamplerActor
from headrace.core.types import AdamParams, Datum, SamplingParams
from headrace.models.registry import check_model_name
from headrace.run.backends import make_backend
from headrace.run.config import RunConfig
from headrace.run.defaults import apply_model_defaults
from headrace.run.rundir import RunDir
from headrace.run.trackers import open_trackers
from headrace.run.train import eval_config, make_dataset

log = logs.get_logger()


@dataclass
class Session:
    config: RunConfig
    run_dir: RunDir
    backend: Backend
    start_step: int  # the checkpoint resumed from, else 0
    track: Any
    rows: list[dict[str, Any]] = field(default_factory=list)  # this process's
    started: float = field(default_factory=time.perf_counter)
    exported: str | None = None  # RUN_DIR/final, once written
    view: Any = None  # the live line (progress.StepProgress): begin(start, steps), row(row)

    @property
    def adam(self) -> AdamParams:
        return AdamParams(**self.config.optim.model_dump())

    def record(self, row: dict[str, Any]) -> None:
        row = {**row, "wall_s": round(time.perf_counter() - self.started, 3)}
        self.run_dir.append_metrics(row)
        self.track(row)
        self.rows.append(row)
        if self.view is not None:
            self.view.row(row)

    async def checkpoint(self, step: int) -> str:
        """Save after ``step`` steps, record it, and delete those beyond ``checkpoint.keep_last``."""
        training = self.backend.training
        path = await training.save_state(f"step_{step:06d}")
        self.run_dir.record_checkpoint(step, path)
        if isinstance(training, DeletesState):
            cfg = self.config.checkpoint
            for entry in self.run_dir.prunable(cfg.keep_last, cfg.keep_every):
                try:
                    await training.delete_state(entry["path"])
                except Exception as e:  # noqa: BLE001 - a checkpoint left behind costs disk, not the run
                    log.warning("checkpoint_not_deleted", path=entry["path"], error=f"{type(e).__name__}: {e}")
                    continue
                self.run_dir.forget_checkpoint(entry)
        return path

    async def export(self, version: int) -> str | None:
        """The final weights as ``RUN_DIR/final`` (a PEFT adapter for LoRA, a model directory for
        full fine-tuning), where the backend can write them (``ExportsWeights``)."""
        if not isinstance(self.backend, ExportsWeights):
            return None
        handle = await self.backend.training.publish(version)
        final = self.run_dir.path / "final"
        if final.exists():
            shutil.rmtree(final)
        path = await asyncio.to_thread(self.backend.export_weights, handle, final)
        log.info("exported", path=path, version=version)
        return path

    async def forward(self, datums: list[Datum]) -> list[list[float]]:
        """The current weights' target logprobs. A backend without ``forward`` is asked for a
        ``cross_entropy`` ``forward_backward`` of zero weights: logprobs, and no gradient."""
        training = self.backend.training
        if isinstance(training, ComputesCustomLoss):
            return await training.forward(datums)
        from headrace.core.types import LossSpec

        zero = [Datum(d.model_input, d.target_tokens, d.logprobs, d.advantages, [0.0] * len(d.mask)) for d in datums]
        return (await training.forward_backward(zero, LossSpec("cross_entropy"))).logprobs_D

    async def env_figures(self, env: str | None, trained: int, steps: int) -> dict[str, float]:
        """``env``'s held-out accuracy, reward mean and pass@k before the first step and after the
        last (``trained`` 0 or ``steps``; nothing between, where an evaluation would only cost)."""
        if not env or trained not in (0, steps):
            return {}
        got = await self.evaluate_env(env, trained)
        keep = ("/accuracy", "/reward_mean", f"/pass@{self.config.eval.samples}")
        return {k: v for k, v in got.items() if k.endswith(keep)}

    async def evaluate_env(self, env: str, version: int) -> dict[str, float]:
        """The env's held-out accuracy (``eval.*``: problems, samples, greedy) on the current weights."""
        config = self.config.model_copy(update={"env": env})
        dataset = make_dataset(eval_config(config), self.backend)
        handle = await self.backend.training.publish(version)
        sampler = SamplerActor(self.backend.sampling, handle)
        s = config.sampling
        spec = EpisodeSpec(
            SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k),
            config.max_turns,
            config.seed,
            getattr(self.backend.tokenizer, "vocab_size", None),
        )
        return await Evaluator(config.eval, env, dataset, sampler, spec).evaluate(handle)


@asynccontextmanager
async def session(config: RunConfig, view: Any = None) -> AsyncIterator[Session]:
    """Open the run directory (``--resume`` / ``--overwrite`` as for runs) and the backend,
    restored to the last checkpoint when resuming."""
    config = apply_model_defaults(config)
    check_model_name(config.model)
    with RunDir.open(config) as run_dir, ExitStack() as scope:
        config = config.model_copy(update={"run_dir": str(run_dir.path)})
        scope.enter_context(logs.run_log(run_dir.path / "log.jsonl"))
        track = scope.enter_context(open_trackers(config.log, config, run_dir.path))
        latest = run_dir.latest_checkpoint() if config.resume else None
        restore = (latest["step"], latest["path"]) if latest else None
        async with make_backend(config, resume_checkpoint=restore) as backend:
            start = 0
            if latest is not None:
                await backend.training.load_state(latest["path"])
                start = int(latest["step"])
                _notice(f"resuming {run_dir.path} from its checkpoint after step {start}")
            if config.resume:
                run_dir.cut_metrics(start)
            run_dir.began = True
            log.info("run_start", run_dir=str(run_dir.path), start_step=start, **backend.describe())
            yield Session(config, run_dir, backend, start, track, view=view)


def _notice(text: str) -> None:
    log.warning("notice", text=text)
    print(f"headrace: {text}", file=sys.stderr, flush=True)
