"""``pairwise_judge``: group rewards from pairwise comparisons by a judge, as the Tinker
cookbook's preference recipes do.

Every member answers the same prompt (one turn, reward 0 from the env). Once the group is in,
``compute_group_rewards`` has the judge compare every pair of answers (both orders by default,
so a judge's bias for the first position cancels) and gives each member its win rate over the
comparisons it took part in: 1 beats everyone, 0 loses to everyone, 0.5 is the middle.

Options: ``judge`` (``openai``: an OpenAI-compatible endpoint, which needs ``judge_url`` and
``judge_model``, key from the variable named by ``judge_api_key_env``, default
``OPENAI_API_KEY``; ``shorter``: prefers the shorter answer, no endpoint), ``both_orders``
(true), ``max_concurrency`` (8 comparisons in flight per group), ``path`` (a JSONL/JSON/Parquet
file of rows with a ``prompt`` field; default: a small built-in list), ``split`` (``train``;
``test``: the held-out prompts, chosen by a hash of their text).

Metrics: ``win_rate``, ``judge_invalid`` (the share of comparisons without a usable verdict,
counted as ties), ``length`` (characters in the answer).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

import anyio

from headrace.core.types import Env, EnvGroupBuilder, Metrics, RLDataset, Trajectory
from headrace.envs.base import ProblemDataset
from headrace.envs.context import EnvContext
from headrace.envs.message import MessageEnv, MessageStep
from headrace.plugins.registry import register_env
from headrace.renderers import Message, Renderer
from headrace.tasks.datasets import read_records
from headrace.tasks.judges import Judge, OpenAIJudge, ShorterJudge
from headrace.tasks.word_math import split_of

PROMPTS = (
    "describe the sea in one sentence.",
    "give one tip for sleeping better.",
    "what is a good name for a cat?",
    "explain what a noun is.",
    "say something kind to a friend.",
    "how do you boil an egg?",
    "why is the sky blue?",
    "name a fruit and say why you like it.",
    "write a short greeting for a letter.",
    "what should i pack for a day at the beach?",
    "give a reason to learn a new language.",
    "how can i keep a plant alive?",
    "describe a city at night.",
    "what makes a good teacher?",
    "suggest a game for two people.",
    "how do you make a cup of tea?",
    "what is the best way to start the day?",
    "tell me a fact about the moon.",
    "how do you say thank you politely?",
    "describe the taste of an apple.",
    "what is one way to save money?",
    "give advice to someone starting a new job.",
    "why do people like music?",
    "what do bees do?",
)


class PairwiseEnv(MessageEnv):
    """One answer to ``prompt``; the reward comes from the group's comparisons."""

    def __init__(self, prompt: str, renderer: Renderer, max_tokens: int):
        super().__init__(renderer, max_tokens, max_turns=1)
        self.prompt = prompt

    def initial_messages(self) -> Sequence[Message]:
        return [{"role": "user", "content": self.prompt}]

    async def respond(self, text: str, clean: bool) -> MessageStep:
        return MessageStep(0.0, done=True, metrics={"length": float(len(text))})


def pairs(n: int, both_orders: bool) -> list[tuple[int, int]]:
    return list(itertools.permutations(range(n), 2) if both_orders else itertools.combinations(range(n), 2))


@dataclass(frozen=True)
class PairwiseGroup(EnvGroupBuilder):
    """Picklable when its judge is (both built-in ones are)."""

    prompt: str
    renderer: Renderer
    max_tokens: int
    group_size: int
    judge: Judge
    both_orders: bool = True
    max_concurrency: int = 8

    async def make_envs(self) -> Sequence[Env]:
        return [PairwiseEnv(self.prompt, self.renderer, self.max_tokens) for _ in range(self.group_size)]

    def answer(self, trajectory: Trajectory) -> str:
        return self.renderer.parse_response(trajectory.transitions[-1].action.tokens)[0]["content"]

    async def compute_group_rewards(self, trajectories_G: Sequence[Trajectory]) -> list[tuple[float, Metrics]]:
        answers = [self.answer(t) for t in trajectories_G]
        matchups = pairs(len(answers), self.both_orders)
        verdicts: list[float | None] = [None] * len(matchups)
        limiter = anyio.CapacityLimiter(self.max_concurrency)

        async def compare(k: int, i: int, j: int) -> None:
            async with limiter:
                verdicts[k] = await self.judge.prefer(self.prompt, answers[i], answers[j])

        try:
            async with anyio.create_task_group() as tg:
                for k, (i, j) in enumerate(matchups):
                    tg.start_soon(compare, k, i, j)
        except ExceptionGroup as group:  # the judge's own error, so the engine counts it by its name
            raise _first(group) from group
        wins, games = [0.0] * len(answers), [0] * len(answers)
        for (i, j), verdict in zip(matchups, verdicts, strict=True):
            p = 0.5 if verdict is None else verdict
            wins[i], wins[j] = wins[i] + p, wins[j] + 1.0 - p
            games[i], games[j] = games[i] + 1, games[j] + 1
        invalid = sum(v is None for v in verdicts) / len(verdicts) if verdicts else 0.0
        rates = [w / g if g else 0.5 for w, g in zip(wins, games, strict=True)]
        return [(rate, {"win_rate": rate, "judge_invalid": invalid}) for rate in rates]

    def logging_tags(self) -> list[str]:
        return ["pairwise_judge"]


def _first(group: BaseExceptionGroup) -> BaseException:
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def make_judge(options: dict) -> Judge:
    if options["judge"] == "shorter":
        return ShorterJudge()
    if options["judge"] != "openai":
        raise ValueError(f"the pairwise_judge env's judge must be 'openai' or 'shorter' (got {options['judge']!r})")
    if not options["judge_url"] or not options["judge_model"]:
        raise ValueError(
            "the pairwise_judge env's openai judge needs an endpoint: set env_options.judge_url (e.g. "
            "http://127.0.0.1:8000/v1) and env_options.judge_model; or use env_options.judge=shorter"
        )
    return OpenAIJudge(options["judge_url"], options["judge_model"], api_key_env=options["judge_api_key_env"])


def load_prompts(path: str | None, split: str) -> list[str]:
    if path is None:
        prompts = list(PROMPTS)
    else:
        rows = read_records(path, split)
        if (bad := next((i for i, row in enumerate(rows) if not isinstance(row.get("prompt"), str)), None)) is not None:
            raise ValueError(
                f"pairwise_judge: row {bad} of {path} has no text field 'prompt' (it has {sorted(rows[bad])})"
            )
        prompts = [row["prompt"] for row in rows]
    chosen = [p for p in prompts if split_of(p) == split]
    if not chosen:
        raise ValueError(f"pairwise_judge: none of the {len(prompts)} prompts falls in the {split} split; add prompts")
    return chosen


OPTIONS = {
    "judge": "openai",
    "judge_url": "",
    "judge_model": "",
    "judge_api_key_env": "OPENAI_API_KEY",
    "both_orders": True,
    "max_concurrency": 8,
    "path": None,
    "split": "train",
}


@register_env("pairwise_judge", options=OPTIONS)
def make_dataset(ctx: EnvContext) -> RLDataset:
    """Rewards from a judge's pairwise comparisons within a group (win rate)."""
    options = ctx.options
    if ctx.group_size < 2:
        raise ValueError(
            f"pairwise_judge compares the answers of a group: group_size must be >= 2 (got {ctx.group_size})"
        )
    judge, prompts, renderer = make_judge(options), load_prompts(options["path"], options["split"]), ctx.renderer

    def group(rng: random.Random) -> PairwiseGroup:
        return PairwiseGroup(
            rng.choice(prompts),
            renderer,
            ctx.max_tokens,
            ctx.group_size,
            judge,
            options["both_orders"],
            options["max_concurrency"],
        )

    return ProblemDataset.from_context(ctx, group)
