"""On-policy distillation's teacher (``--teacher MODEL_OR_RUN_DIR``): a second backend of the
same kind on the teacher's weights, whose ``forward`` (``ComputesCustomLoss``) scores the tokens
the student sampled. ``MODEL``: any name ``--model`` takes; a run directory: the model and backend
sections it was run with, restored from its last checkpoint (an adapter trained by RL there)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from headrace.core import logs
from headrace.core.advantage_actor import Teacher
from headrace.core.errors import ConfigError
from headrace.core.protocols import ComputesCustomLoss
from headrace.run.backends import make_backend
from headrace.run.config import RunConfig, validate
from headrace.run.defaults import apply_model_defaults
from headrace.run.rundir import RunDir

log = logs.get_logger()


def teacher_config(config: RunConfig) -> tuple[RunConfig, str | None]:
    """The teacher's config (no run directory of its own) and the checkpoint it starts from."""
    assert config.teacher is not None
    path = Path(config.teacher)
    if (path / "config.json").is_file():
        saved = RunDir.saved_options(path) or {}
        latest = RunDir(path).latest_checkpoint()
        if latest is None:
            raise ConfigError(
                f"--teacher '{path}' is a run directory without a checkpoint: nothing trained there to teach. "
                "Pass a run directory that finished a step, or a model name."
            )
        tree: dict[str, Any] = {**saved, "run_dir": None, "resume": False, "teacher": None}
        return apply_model_defaults(validate(tree)), latest["path"]
    update = {"model": config.teacher, "run_dir": None, "resume": False, "teacher": None}
    return apply_model_defaults(config.model_copy(update=update)), None


@asynccontextmanager
async def teacher(config: RunConfig, student_vocab: int | None) -> AsyncIterator[Teacher | None]:
    """The teacher's scoring function while the run lives; None without ``--teacher``."""
    if not config.teacher:
        yield None
        return
    tconfig, checkpoint = teacher_config(config)
    async with make_backend(tconfig) as backend:
        if checkpoint is not None:
            await backend.training.load_state(checkpoint)
        training = backend.training
        if not isinstance(training, ComputesCustomLoss):
            raise ConfigError(
                f"--teacher needs a backend that scores tokens without training (a forward); '{tconfig.backend}' "
                "has none. Use the torch or tinker backend."
            )
        vocab = getattr(backend.tokenizer, "vocab_size", None)
        if student_vocab is not None and vocab is not None and vocab != student_vocab:
            raise ConfigError(
                f"--teacher '{config.teacher}' has a vocabulary of {vocab} tokens and the student '{config.model}' "
                f"{student_vocab}: the teacher scores the student's token ids, so both need the same tokenizer."
            )
        log.info("teacher", checkpoint=checkpoint, **backend.describe())
        yield training.forward
