"""Helpers for the common shape of an env: a dataset of problems, G identical envs per problem."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec

from headrace.core.types import Env, EnvGroupBuilder, RLDataset
from headrace.envs.context import EnvContext

P = ParamSpec("P")


@dataclass(frozen=True)
class GroupOf(EnvGroupBuilder):
    """G envs of one problem: ``env_cls(**kwargs)`` each. Picklable when its arguments are (issue
    14 ships builders to other processes). ``GroupOf.of(Env, G, word=...)`` builds one with the
    arguments checked against the env's ``__init__`` by a type checker."""

    env_cls: Callable[..., Env]
    kwargs: dict[str, Any]
    group_size: int
    tags: tuple[str, ...] = ()

    @classmethod
    def of(cls, env_cls: Callable[P, Env], group_size: int, /, *args: P.args, **kwargs: P.kwargs) -> GroupOf:
        """``group_size`` envs ``env_cls(**kwargs)``; keyword arguments only (they are stored by name)."""
        if args:
            name = getattr(env_cls, "__name__", env_cls)
            raise TypeError(f"GroupOf.of({name}, ...): pass the env's arguments by name")
        return cls(env_cls, dict(kwargs), group_size)

    async def make_envs(self) -> Sequence[Env]:
        return [self.env_cls(**self.kwargs) for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return list(self.tags)


class ProblemDataset(RLDataset):
    """``batch_size`` groups per batch; problem j of batch i is drawn from a generator seeded by
    (seed, i, j), so any batch can be rebuilt on its own (resume needs exactly that)."""

    def __init__(
        self,
        make_group: Callable[[random.Random], EnvGroupBuilder],
        batch_size: int,
        num_batches: int,
        seed: int,
    ):
        self.make_group, self.batch_size, self.num_batches, self.seed = make_group, batch_size, num_batches, seed

    @classmethod
    def from_context(cls, ctx: EnvContext, make_group: Callable[[random.Random], EnvGroupBuilder]) -> ProblemDataset:
        """The run's shape from ``ctx``: ``ctx.batch_size`` groups per batch, a batch per step, ``ctx.seed``."""
        return cls(make_group, ctx.batch_size, max(ctx.steps, 1), ctx.seed)

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        return [self.make_group(random.Random(f"{self.seed}/{index}/{j}")) for j in range(self.batch_size)]

    def __len__(self) -> int:
        return self.num_batches
