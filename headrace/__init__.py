"""headrace: asyncio actor-style reinforcement learning for language models.

Write an env, register it, pick a scheduler and a backend by name::

    from headrace import Env, EnvGroupBuilder, register_env

then ``await headrace.train(config)``, or ``headrace.run_with_progress(config)`` from a script for
the live line and summary of ``headrace run``. Every error headrace raises on purpose is a
``HeadraceError``, on one of its branches ``ConfigError``, ``EnvError``, ``BackendError``,
``RunError`` (``headrace.core.errors``); those a run raises are exported here too, to catch:
``EnvContractError``, ``TooManyDroppedGroups``, ``NoUpdateApplied``, ``NonFiniteError``,
``UnknownNameError``, ``BackendFailure``; a backend implements the protocols
``Backend``, ``TrainingBackend``, ``SamplingBackend`` and raises ``TransientBackendError`` for
what is worth retrying; a ``BackendPlugin`` registers it (its factory gets a ``BackendContext``);
the optional capabilities it may add are listed in ``headrace.core.protocols``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from headrace.core.advantages import NonFiniteError
from headrace.core.episode import EnvContractError
from headrace.core.errors import (
    BackendError,
    BackendFailure,
    ConfigError,
    EnvError,
    HeadraceError,
    RunError,
)
from headrace.core.protocols import (
    Backend,
    BackendContext,
    BackendPlugin,
    SamplingBackend,
    TrainingBackend,
    TransientBackendError,
)
from headrace.core.trace import (
    CallCompleted,
    CallSubmitted,
    Event,
    RolloutFinished,
    RolloutStarted,
    RunStarted,
    StepPublished,
    Tracer,
)
from headrace.core.types import (
    AdamParams,
    Datum,
    Env,
    EnvGroupBuilder,
    LossSpec,
    RLDataset,
    SampledTokens,
    SamplerHandle,
    SamplingParams,
    StepResult,
    StopCondition,
    StopReason,
    Tokenizer,
    Trajectory,
    TrajectoryGroup,
    Transition,
)
from headrace.envs.base import GroupOf, ProblemDataset
from headrace.envs.context import EnvContext
from headrace.plugins.registry import UnknownNameError, register_env
from headrace.run.config import RunConfig, build_config

if TYPE_CHECKING:
    from headrace.core.rollout import TooManyDroppedGroups
    from headrace.run.metrics import NoUpdateApplied
    from headrace.run.train import RunSummary

# imported when first used, not by `import headrace`: they pull in the actors and the logging
_LAZY = {
    "NoUpdateApplied": "headrace.run.metrics",
    "TooManyDroppedGroups": "headrace.core.rollout",
    "RunSummary": "headrace.run.train",
}

__version__ = "0.1.0"


async def train(
    config: RunConfig,
    *,
    dataset: RLDataset | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    tracer: Tracer | None = None,
    handle_signals: bool = False,
) -> RunSummary:
    """Train for ``config.steps`` steps (resuming if ``config.resume``) and return the summary.

    ``dataset`` replaces the one ``config.env`` names; ``on_step`` gets each step's metrics row
    as it is written; ``tracer`` every event of the run (``headrace.core.trace``: rollouts, backend
    calls, published steps); with ``handle_signals`` the first SIGINT/SIGTERM checkpoints and stops
    the run at the next step (``RunSummary.stopped_by``), a second exits at once."""
    from headrace.run.train import train as _train

    return await _train(config, on_step=on_step, dataset=dataset, tracer=tracer, handle_signals=handle_signals)


def run_with_progress(
    config: RunConfig, *, dataset: RLDataset | None = None, tracer: Tracer | None = None
) -> RunSummary:
    """``train`` with the live line and summary of ``headrace run``, blocking (for a script; see
    ``headrace.app.progress.run_with_progress``)."""
    from headrace.app.progress import run_with_progress as _run

    return _run(config, dataset=dataset, tracer=tracer)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'headrace' has no attribute '{name}'")


__all__ = [
    "AdamParams",
    "CallCompleted",
    "CallSubmitted",
    "Event",
    "RolloutFinished",
    "RolloutStarted",
    "RunStarted",
    "StepPublished",
    "Tracer",
    "Backend",
    "BackendError",
    "BackendFailure",
    "BackendContext",
    "BackendPlugin",
    "ConfigError",
    "Datum",
    "Env",
    "EnvContext",
    "EnvContractError",
    "EnvError",
    "EnvGroupBuilder",
    "GroupOf",
    "HeadraceError",
    "LossSpec",
    "NoUpdateApplied",
    "NonFiniteError",
    "ProblemDataset",
    "RLDataset",
    "RunConfig",
    "RunError",
    "RunSummary",
    "SamplingBackend",
    "SampledTokens",
    "SamplerHandle",
    "SamplingParams",
    "StepResult",
    "StopCondition",
    "StopReason",
    "Tokenizer",
    "TooManyDroppedGroups",
    "TrainingBackend",
    "Trajectory",
    "TrajectoryGroup",
    "TransientBackendError",
    "Transition",
    "UnknownNameError",
    "build_config",
    "register_env",
    "run_with_progress",
    "train",
]
