"""Helpers for the common shape of an env: a dataset of problems, G identical envs per problem."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from headrace.engine.types import Env, EnvGroupBuilder, RLDataset


@dataclass(frozen=True)
class GroupOf(EnvGroupBuilder):
    """G envs of one problem: ``env_cls(**kwargs)`` each. Picklable when its arguments are."""

    env_cls: type[Env]
    kwargs: dict[str, Any]
    group_size: int
    tags: tuple[str, ...] = ()

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

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        return [self.make_group(random.Random(f"{self.seed}/{index}/{j}")) for j in range(self.batch_size)]

    def __len__(self) -> int:
        return self.num_batches
