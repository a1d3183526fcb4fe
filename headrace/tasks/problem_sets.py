"""A dataset over a fixed list of problems: shuffled afresh each epoch for training, or each
problem once, in order, for evaluation (``headrace.envs.base.ProblemDataset`` draws generated
problems instead)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from headrace.core.types import EnvGroupBuilder, RLDataset

T = TypeVar("T")


class ListDataset(RLDataset, Generic[T]):
    """``batch_size`` groups per batch, one per item. ``num_batches=None`` (evaluation): every
    item once, in order, the last batch possibly short. Otherwise (training) ``num_batches``
    batches walk the items epoch by epoch, each epoch in its own order seeded by (seed, epoch),
    so any batch can be rebuilt on its own (resume needs exactly that)."""

    def __init__(
        self,
        items: Sequence[T],
        make_group: Callable[[T], EnvGroupBuilder],
        batch_size: int,
        num_batches: int | None = None,
        seed: int = 0,
    ):
        if not items:
            raise ValueError("a ListDataset needs at least one item")
        self.items, self.make_group, self.batch_size, self.seed = items, make_group, batch_size, seed
        self.num_batches = num_batches if num_batches is not None else math.ceil(len(items) / batch_size)
        self.shuffle = num_batches is not None
        self._orders: dict[int, list[int]] = {}

    def _item(self, position: int) -> T:
        epoch, offset = divmod(position, len(self.items))
        if not self.shuffle:
            return self.items[offset]
        if epoch not in self._orders:
            order = list(range(len(self.items)))
            random.Random(f"{self.seed}/epoch/{epoch}").shuffle(order)
            self._orders = {epoch: order}  # batches are drawn in order: keep one epoch's
        return self.items[self._orders[epoch][offset]]

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        start = index * self.batch_size
        stop = start + self.batch_size if self.shuffle else min(start + self.batch_size, len(self.items))
        return [self.make_group(self._item(p)) for p in range(start, stop)]

    def __len__(self) -> int:
        return self.num_batches
