"""headrace: asyncio actor-style reinforcement learning for language models.

Write an env, register it, pick a scheduler and a backend by name::

    from headrace import Env, EnvGroupBuilder, register_env
"""

from headrace.engine.config import ConfigError, RunConfig, build_config
from headrace.engine.registry import UnknownNameError, register_env
from headrace.engine.types import (
    AdamParams,
    Datum,
    Env,
    EnvContext,
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

__version__ = "0.1.0"


async def train(config: RunConfig, **kwargs):
    """Run training for ``config`` (see ``headrace.engine.run.train``)."""
    from headrace.engine.run import train as _train

    return await _train(config, **kwargs)


__all__ = [
    "AdamParams",
    "ConfigError",
    "Datum",
    "Env",
    "EnvContext",
    "EnvGroupBuilder",
    "GroupOf",
    "LossSpec",
    "ProblemDataset",
    "RLDataset",
    "RunConfig",
    "SampledTokens",
    "SamplerHandle",
    "SamplingParams",
    "StepResult",
    "StopCondition",
    "StopReason",
    "Tokenizer",
    "Trajectory",
    "TrajectoryGroup",
    "Transition",
    "UnknownNameError",
    "build_config",
    "register_env",
    "train",
]
