"""``tictactoe``: two-player self-play inside one group, zero-sum.

The members of a group pair up (0-1, 2-3, ...). A pair plays two games at once, each member X
in one and O in the other, so both start at once on the same empty board (the group shares its
first sample) and each plays both sides. A member's turn comes whenever one of its games waits
for its move; each turn is a fresh prompt of that game's board. The episode ends when both
games are over, with the sum of the member's results: win +1, loss -1, draw 0, so each pair's
rewards sum to zero. An illegal move (no number, not 1-9, a taken cell) loses that game at once
(``illegal`` in the metrics).

Why two games and not one: the engine asks every member for its first prompt before it samples
any, so the member moving second could not wait for the first's move there.

A member waits for its partner in ``step``; a partner gone for ``move_timeout_s`` (600) ends the
match (unfinished games count 0, ``aborted`` in the metrics), and a member that fails releases its
partner at once. A retried member (a fresh env after an error) plays a random-move bot instead:
its partner has moved on. The engine's ``max_turns`` must leave 9 turns.

Options: ``opponent`` (``self``, the default: self-play; ``random``: every member plays a
random-move bot, the evaluation setting, with no train/test split: the "held-out" measure is the
score against it), ``move_tokens`` (16: a move is a number, so at most this many tokens, or the
run's ``max_tokens`` when smaller), ``move_timeout_s``. Self-play needs an even group size.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio

from headrace.core.types import Env, EnvGroupBuilder, RLDataset, SampledTokens, StepResult, StopCondition
from headrace.envs.base import ProblemDataset
from headrace.envs.context import EnvContext
from headrace.plugins.registry import register_env
from headrace.renderers import Renderer

LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
PROMPT = (
    "tic-tac-toe. you play {mark}. the board, rows top to bottom: {board}. "
    "cells are numbered 1 to 9, left to right, top to bottom. reply with the number of an empty cell."
)


def parse_cell(text: str) -> int | None:
    """The cell (0-8) a reply names: its first number, 1-9; None when it names none."""
    number = re.search(r"\d+", text)
    return int(number.group()) - 1 if number and 1 <= int(number.group()) <= 9 else None


@dataclass
class Game:
    """One game: ``players[0]`` plays x, ``players[1]`` plays o. ``result``: each player's reward
    once the game is over."""

    players: tuple[int, int]
    cells: list[str] = field(default_factory=lambda: ["."] * 9)
    to_move: int = 0  # index into players: 0 = x
    result: dict[int, float] | None = None
    illegal: int | None = None  # the player whose illegal move ended it

    @property
    def mover(self) -> int:
        return self.players[self.to_move]

    def mark(self, player: int) -> str:
        return "xo"[self.players.index(player)]

    def board(self) -> str:
        return "/".join("".join(self.cells[r : r + 3]) for r in (0, 3, 6))

    def play(self, cell: int | None) -> None:
        me, other, mark = self.mover, self.players[1 - self.to_move], "xo"[self.to_move]
        if cell is None or not 0 <= cell < 9 or self.cells[cell] != ".":
            self.illegal, self.result = me, {me: -1.0, other: 1.0}
            return
        self.cells[cell] = mark
        if any(all(self.cells[i] == mark for i in line) for line in LINES):
            self.result = {me: 1.0, other: -1.0}
        elif "." not in self.cells:
            self.result = {me: 0.0, other: 0.0}
        else:
            self.to_move ^= 1


class Match:
    """Two games between players 0 and 1, each x in one. With ``bot``, player 1 is a random-move
    bot (seeded) that answers at once."""

    def __init__(self, bot: random.Random | None = None):
        self.games = [Game((0, 1)), Game((1, 0))]
        self.bot, self.aborted = bot, False
        self._changed = anyio.Event()
        self._bot_moves()

    def turn_of(self, player: int) -> Game | None:
        return next((g for g in self.games if g.result is None and g.mover == player), None)

    @property
    def over(self) -> bool:
        return self.aborted or all(g.result is not None for g in self.games)

    def play(self, game: Game, cell: int | None) -> None:
        if self.aborted:  # a late move must not change a result the partner has already been given
            return
        game.play(cell)
        self._bot_moves()
        self._notify()

    def abort(self) -> None:
        self.aborted = True
        self._notify()

    async def wait_turn(self, player: int, timeout_s: float) -> Game | None:
        """The game waiting for ``player``'s move; None once the match is over (or aborted,
        also by waiting ``timeout_s`` in vain)."""
        with anyio.move_on_after(timeout_s):
            while not self.over:
                if (game := self.turn_of(player)) is not None:
                    return game
                await self._changed.wait()
            return None
        self.abort()
        return None

    def _bot_moves(self) -> None:
        while self.bot is not None and (game := self.turn_of(1)) is not None:
            game.play(self.bot.choice([i for i, c in enumerate(game.cells) if c == "."]))

    def _notify(self) -> None:
        changed, self._changed = self._changed, anyio.Event()
        changed.set()


class TicTacToeEnv(Env):
    """Player ``me`` (0 or 1) of a shared :class:`Match`."""

    def __init__(self, match: Match, me: int, renderer: Renderer, max_tokens: int, move_timeout_s: float = 600.0):
        self.match, self.me, self.renderer, self.max_tokens = match, me, renderer, max_tokens
        self.move_timeout_s = move_timeout_s
        self._game: Game | None = None
        self.moves = 0

    def _observation(self, game: Game) -> list[int]:
        prompt = PROMPT.format(mark=game.mark(self.me), board=game.board())
        return self.renderer.build_generation_prompt([{"role": "user", "content": prompt}])

    def _stop(self) -> StopCondition:
        return self.renderer.stop_condition(self.max_tokens)

    async def initial_observation(self) -> tuple[list[int], StopCondition]:
        self._game = self.match.turn_of(self.me)  # x in one game: always this player's turn at the start
        assert self._game is not None
        return self._observation(self._game), self._stop()

    async def step(self, action: SampledTokens) -> StepResult:
        assert self._game is not None, "step() before initial_observation()"
        message, _ = self.renderer.parse_response(action.tokens)
        self.moves += 1
        try:
            self.match.play(self._game, parse_cell(message["content"]))
            self._game = await self.match.wait_turn(self.me, self.move_timeout_s)
        except BaseException:  # an error or a cancellation here: the partner must not wait for us
            self.match.abort()
            raise
        if self._game is not None:
            return StepResult(0.0, False, self._observation(self._game), self._stop())
        return StepResult(sum(self._results()), True, metrics=self._metrics())

    def _results(self) -> list[float]:
        return [g.result[self.me] for g in self.match.games if g.result is not None]

    def _metrics(self) -> dict[str, float]:
        results = self._results()
        return {
            "win": results.count(1.0) / 2,
            "loss": results.count(-1.0) / 2,
            "draw": results.count(0.0) / 2,
            "illegal": sum(g.illegal == self.me for g in self.match.games) / 2,
            "aborted": float(self.match.aborted),
            "moves": float(self.moves),
        }


@dataclass
class TicTacToeGroup(EnvGroupBuilder):
    """``group_size`` members in pairs (self-play) or each against a bot. Picklable: the matches
    are made in ``make_envs``."""

    renderer: Renderer
    max_tokens: int
    group_size: int
    opponent: str = "self"
    seed: int = 0
    move_timeout_s: float = 600.0
    _made: int = field(default=0, repr=False, compare=False)  # make_envs calls: later ones are retries

    def __post_init__(self) -> None:
        if self.opponent == "self" and self.group_size % 2:
            raise ValueError(f"tictactoe self-play needs an even group size (got {self.group_size})")

    async def make_envs(self) -> Sequence[Env]:
        retry, self._made = self._made > 0, self._made + 1
        envs: list[Env] = []
        for i in range(self.group_size):
            if self.opponent == "random" or retry:
                match, me = Match(random.Random(f"{self.seed}/{i}/{self._made}")), 0
            elif i % 2 == 0:
                match, me = Match(), 0
            else:
                me = 1  # the partner of member i - 1, in its match
            envs.append(TicTacToeEnv(match, me, self.renderer, self.max_tokens, self.move_timeout_s))
        return envs

    def logging_tags(self) -> list[str]:
        return ["tictactoe"]


@register_env("tictactoe", options={"opponent": "self", "move_timeout_s": 600.0, "move_tokens": 16})
def make_dataset(ctx: EnvContext) -> RLDataset:
    """Tic-tac-toe self-play within a group: zero-sum, illegal moves lose."""
    options = ctx.options
    if options["opponent"] not in ("self", "random"):
        raise ValueError(f"the tictactoe env's opponent must be 'self' or 'random' (got {options['opponent']!r})")
    if options["opponent"] == "self" and ctx.group_size % 2:
        raise ValueError(
            f"tictactoe self-play pairs up the members of a group, so group_size must be even (got {ctx.group_size}); "
            "or set env_options.opponent=random"
        )
    renderer = ctx.renderer

    def group(rng: random.Random) -> TicTacToeGroup:
        return TicTacToeGroup(
            renderer,
            min(ctx.max_tokens, options["move_tokens"]),
            ctx.group_size,
            options["opponent"],
            rng.getrandbits(32),
            options["move_timeout_s"],
        )

    return ProblemDataset.from_context(ctx, group)
