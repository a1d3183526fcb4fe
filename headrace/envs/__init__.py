"""Built-in envs and the helpers for writing one."""

from headrace.envs.base import GroupOf, ProblemDataset

__all__ = ["GroupOf", "ProblemDataset"]
