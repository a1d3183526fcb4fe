"""Math envs: ``word_math`` (generated word problems), ``gsm8k`` and ``math`` (the real datasets,
from a local file). Single turn on :class:`~headrace.envs.message.ProblemEnv`: the question and
an instruction saying how to write the answer, graded by ``grading.grade`` (the last
``\\boxed{}``, else ``#### N``, else the last number; math-verify for symbolic answers when it
is installed).

Options (``--set env_options.NAME=VALUE``):

- all: ``split`` (``train``; ``test`` is the held-out split, for evaluation), ``answer_format``
  (``boxed``: "... put your final answer within \\boxed{}"; ``hash``: a last line ``#### N``;
  ``number``: the number alone), ``format_coef`` (0.1: what an answer not written that way costs).
- ``word_math``: ``difficulty`` (1-5, default 2), ``steps`` and ``max_value`` (0: the level's;
  set, they replace its operation count and largest number, e.g. ``difficulty=1 steps=1`` for
  one-step problems, which SmolLM2-135M can pass when two steps are beyond it), ``templates``
  (comma-separated names from ``word_math.TEMPLATES``; default all), ``eval_size`` (200: the
  test split's fixed problems).
- ``gsm8k`` / ``math``: ``path`` (a ``.jsonl``/``.json``/``.parquet`` file, or a directory of
  ``<split>*`` files; without it the ``datasets`` library is tried, and a clear error says how to
  save the dataset locally when that fails).

Training draws problems (``word_math``: generated afresh; files: each epoch in its own order);
``split=test`` gives each held-out problem once, in order (the dataset's length is then the
number of batches that covers them).
"""

from __future__ import annotations

from headrace.core.types import RLDataset
from headrace.envs.base import GroupOf, ProblemDataset
from headrace.envs.context import EnvContext
from headrace.envs.message import ProblemEnv, Verdict
from headrace.plugins.registry import register_env
from headrace.renderers import Renderer
from headrace.tasks import word_math
from headrace.tasks.datasets import LOADERS, MathProblem
from headrace.tasks.grading import extract_answer, grade_async, parse_number
from headrace.tasks.problem_sets import ListDataset

# the boxed one is the usual math prompt (Qwen's, the cookbook's); a placeholder such as \boxed{N}
# is copied literally by small models
INSTRUCTIONS = {
    "boxed": "Please reason step by step, and put your final answer within \\boxed{}.",
    "hash": "Please reason step by step, and write the final answer on a last line that starts with ####.",
    "number": "Answer with the final number only.",
}
COMMON = {"split": "train", "answer_format": "boxed", "format_coef": 0.1}


class MathEnv(ProblemEnv):
    """A question with a reference answer (a number or a LaTeX expression)."""

    def __init__(
        self,
        question: str,
        answer: str,
        renderer: Renderer,
        max_tokens: int,
        answer_format: str = "boxed",
        format_coef: float = 0.1,
    ):
        super().__init__(renderer, max_tokens, format_coef=format_coef)
        self._question, self.answer, self.answer_format = question, answer, answer_format

    def question(self) -> str:
        return f"{self._question} {INSTRUCTIONS[self.answer_format]}"

    async def check_answer(self, text: str) -> Verdict:
        graded = await grade_async(text, self.answer)
        return Verdict(float(graded.correct), {"answered": float(graded.extracted is not None)})

    def check_format(self, text: str) -> bool:
        if self.answer_format == "number":
            return parse_number(text.strip()) is not None
        return extract_answer(text, [self.answer_format])[0] is not None


def _check_common(env: str, options: dict) -> None:
    if options["answer_format"] not in INSTRUCTIONS:
        raise ValueError(
            f"the {env} env's answer_format must be one of {', '.join(INSTRUCTIONS)} (got {options['answer_format']!r})"
        )


def _group(ctx: EnvContext, renderer: Renderer, options: dict, tag: str, question: str, answer: str) -> GroupOf:
    kwargs = {
        "question": question,
        "answer": answer,
        "renderer": renderer,
        "max_tokens": ctx.max_tokens,
        "answer_format": options["answer_format"],
        "format_coef": options["format_coef"],
    }
    return GroupOf(MathEnv, kwargs, ctx.group_size, tags=(tag,))


@register_env(
    "word_math", options={**COMMON, "difficulty": 2, "steps": 0, "max_value": 0, "templates": "", "eval_size": 200}
)
def make_word_math(ctx: EnvContext) -> RLDataset:
    """Generated multi-step word problems with exact answers (single turn, graded)."""
    options = ctx.options
    _check_common("word_math", options)
    difficulty = word_math.difficulty_of(options["difficulty"], options["steps"], options["max_value"])
    templates = tuple(t.strip() for t in options["templates"].split(",") if t.strip()) or None
    renderer = ctx.renderer

    def problem(index: int, split: str) -> GroupOf:
        p = word_math.generate(index, difficulty=difficulty, split=split, templates=templates)
        return _group(ctx, renderer, options, "word_math", p.question, str(p.answer))

    problem(0, options["split"])  # a wrong difficulty or template name fails here, not in a rollout
    if options["split"] == "test":
        return ListDataset(range(options["eval_size"]), lambda i: problem(i, "test"), ctx.batch_size)
    return ProblemDataset(
        lambda rng: problem(rng.getrandbits(48), "train"), ctx.batch_size, max(ctx.steps, 1), ctx.seed
    )


def _file_dataset(name: str, ctx: EnvContext) -> RLDataset:
    options = ctx.options
    _check_common(name, options)
    problems: list[MathProblem] = LOADERS[name](options["path"], split=options["split"])
    renderer = ctx.renderer

    def group(p: MathProblem) -> GroupOf:
        return _group(ctx, renderer, options, name, p.question, p.answer)

    if options["split"] == "test":
        return ListDataset(problems, group, ctx.batch_size)
    return ListDataset(problems, group, ctx.batch_size, num_batches=max(ctx.steps, 1), seed=ctx.seed)


@register_env("gsm8k", options={**COMMON, "path": None})
def make_gsm8k(ctx: EnvContext) -> RLDataset:
    """GSM8K from a local file (env_options.path), answers checked against its #### lines."""
    return _file_dataset("gsm8k", ctx)


@register_env("math", options={**COMMON, "path": None})
def make_math(ctx: EnvContext) -> RLDataset:
    """MATH from a local file (env_options.path), answers checked against its last \\boxed{}."""
    return _file_dataset("math", ctx)


__all__ = ["INSTRUCTIONS", "MathEnv", "make_gsm8k", "make_math", "make_word_math"]
