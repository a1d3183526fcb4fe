"""A two-player game scored on the whole group: "undercut", in pairs, zero-sum.

Shows an :class:`headrace.core.types.EnvGroupBuilder` with ``compute_group_rewards``: every
member picks a number from 1 to 5 (one turn, reward 0 from its env); once the whole group is in,
the builder pairs the members up (0-1, 2-3, ...) and scores each pair. The higher number wins,
unless it is exactly one more than the other: then it was undercut and loses. Win +1, loss -1,
tie 0; a reply without a number from 1 to 5 loses (-1, and +1 to the partner). Every number
is beaten by another, so there is no single best move to memorise. (The built-in
``tictactoe`` env is a full board game in the same shape: ``--env tictactoe``.)

Run it (the group size must be even)::

    headrace run --env examples/game.py:make_dataset --steps 20

What it printed here (trimmed)::

    step 20/20  reward 0  85.5 traj/s  339 tok/s  stale 0/0  done
    metric           first 2 steps   last 2 steps
    reward/mean                  0              0
    time/step                 6.32           5.93
    20 steps in 120.8 s; 10,240 trajectories in 120.8 s of training: 84.8 traj/s, 335 tok/s; groups dropped: 0

The mean reward of a zero-sum game is 0 by construction: watch ``env/undercut/illegal`` in
``metrics.jsonl`` instead (replies without a legal move): 0.82 at step 0, 0.29 at step 19,
while ``env/undercut/win`` stays near 0.3.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from headrace import EnvContext, ProblemDataset
from headrace.core.types import Env, EnvGroupBuilder, Metrics, Trajectory
from headrace.envs.message import ProblemEnv
from headrace.renderers import Renderer

PROMPT = "undercut: pick a number from 1 to 5. higher wins, but one more than the other loses."


def pick(text: str) -> int | None:
    number = re.search(r"\d+", text)
    return int(number.group()) if number and 1 <= int(number.group()) <= 5 else None


def outcome(mine: int | None, theirs: int | None) -> float:
    """+1, -1 or 0 for the first player."""
    if mine is None or theirs is None:
        return float(mine is not None) - float(theirs is not None)  # an illegal move loses
    if mine == theirs:
        return 0.0
    if abs(mine - theirs) == 1:
        return 1.0 if mine < theirs else -1.0  # undercut: one less beats one more
    return 1.0 if mine > theirs else -1.0


class Move(ProblemEnv):
    """One member's move: the env only asks; the builder scores the pair."""

    def question(self) -> str:
        return PROMPT

    async def check_answer(self, text: str) -> float:
        return 0.0


@dataclass(frozen=True)
class UndercutGroup(EnvGroupBuilder):
    renderer: Renderer
    max_tokens: int
    group_size: int

    async def make_envs(self) -> Sequence[Env]:
        return [Move(self.renderer, self.max_tokens) for _ in range(self.group_size)]

    async def compute_group_rewards(self, trajectories_G: Sequence[Trajectory]) -> list[tuple[float, Metrics]]:
        replies = [self.renderer.parse_response(t.transitions[-1].action.tokens)[0] for t in trajectories_G]
        moves = [pick(reply["content"]) for reply in replies]
        results = []
        for i, mine in enumerate(moves):
            score = outcome(mine, moves[i ^ 1])  # i ^ 1: the partner, 0<->1, 2<->3, ...
            results.append((score, {"win": float(score > 0), "illegal": float(mine is None)}))
        return results

    def logging_tags(self) -> list[str]:
        return ["undercut"]


def make_dataset(ctx: EnvContext) -> ProblemDataset:
    if ctx.group_size % 2:
        raise ValueError(f"undercut pairs up the members of a group, so group_size must be even (got {ctx.group_size})")
    return ProblemDataset.from_context(ctx, lambda rng: UndercutGroup(ctx.renderer, ctx.max_tokens, ctx.group_size))
