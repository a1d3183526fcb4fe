"""The step loop the recipes share: step k's calls are submitted before step k-1's results are
awaited (the device never waits on Python, as in the RL learner), each step's row is written once
its results are in, evaluations go in the row of the step they follow, and checkpoints are taken
every ``checkpoint.every`` steps and at the end."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .loop import Session
from .render import token_batches

Submit = Callable[[int], Awaitable[dict[str, Any]]]  # step -> (awaitable of) its row's figures
Evaluate = Callable[[int], Awaitable[dict[str, float]]]  # steps trained -> figures


def schedule(sizes: Sequence[int], budget: int, epochs: float, max_steps: int, seed: int) -> list[list[int]]:
    """Every step's example indices: each epoch a fresh seeded shuffle cut into token-budget
    batches, until ``epochs`` passes or ``max_steps`` steps, whichever comes first. The same for
    the same data and seed, so a resumed run trains the steps it had not."""

    def epoch(e: int) -> list[list[int]]:
        order = list(range(len(sizes)))
        random.Random(seed * 1_000_003 + e).shuffle(order)
        return token_batches(sizes, budget, order)

    first = epoch(0)
    total = min(max_steps, max(1, round(epochs * len(first))))
    steps, e = list(first), 0
    while len(steps) < total:
        e += 1
        steps += epoch(e)
    return steps[:total]


async def run_steps(s: Session, steps: int, submit: Submit, evaluate: Evaluate, eval_every: int) -> None:
    """Steps ``s.start_step`` .. ``steps - 1``; ``evaluate`` before the first (its figures go in
    the first row, named ``start_<name>``), every ``eval_every`` steps and after the last."""
    start = s.start_step
    if start >= steps:
        return
    if s.view is not None:
        s.view.begin(start, steps)
    extra = {_start_name(k): v for k, v in (await evaluate(0)).items()} if start == 0 else {}
    every = s.config.checkpoint.every

    def boundary(k: int) -> bool:  # an evaluation or a save follows step k: nothing later may be queued before it
        return bool((eval_every and (k + 1) % eval_every == 0) or (every and (k + 1) % every == 0))

    pending: tuple[int, Awaitable[dict[str, Any]]] | None = None
    for k in range(start, steps):
        if pending is not None and boundary(pending[0]):
            await _finish(s, *pending, steps, evaluate, eval_every, extra)
            pending, extra = None, {}
        current = submit(k)  # submitted now; awaited after the previous step's row is written
        if pending is not None:
            await _finish(s, *pending, steps, evaluate, eval_every, extra)
            extra = {}
        pending = (k, current)
    assert pending is not None
    await _finish(s, *pending, steps, evaluate, eval_every, extra)
    s.exported = await s.export(steps)


async def _finish(
    s: Session, k: int, result: Awaitable[dict[str, Any]], steps: int, evaluate: Evaluate, eval_every: int, extra: dict
) -> None:
    row: dict[str, Any] = {"step": k, **(await result), **extra}
    last = k + 1 == steps
    if last or (eval_every and (k + 1) % eval_every == 0):
        row |= await evaluate(k + 1)
    s.record(row)
    every = s.config.checkpoint.every
    if last or (every and (k + 1) % every == 0):
        await s.checkpoint(k + 1)


def _start_name(key: str) -> str:
    head, _, leaf = key.rpartition("/")
    return f"{head}/start_{leaf}" if head else f"start_{key}"
