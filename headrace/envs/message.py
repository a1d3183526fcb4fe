"""Message-level envs: written in messages and strings; the run's renderer makes the tokens.

Two layers, as the Tinker cookbook has them:

- :class:`MessageEnv`, multi-turn over messages. ``initial_messages()`` opens the conversation;
  ``respond(text, clean)`` answers each assistant turn with a :class:`MessageStep` (a reward,
  whether the episode is over, the next user or tool messages). The next observation is built
  token in / token out (``Renderer.next_observation``): the previous prompt, the sampled tokens
  exactly as sampled, then the new messages, so the episode trains as one sequence and nothing
  sampled is ever re-tokenised.
- :class:`ProblemEnv`, one question and a grader: ``question()`` and ``check_answer(text)``;
  the reward is the grade plus an optional format term, ``correct + format_coef * (format_ok - 1)``.

``clean`` says whether the turn ended at the renderer's stop token (not cut off by
``max_tokens``). Every step reports ``truncated``; a ``ProblemEnv`` also ``correct`` and
``format_ok``. Envs are single use; group them with ``headrace.envs.base.GroupOf`` (picklable
when their arguments are: a renderer and plain data).

:class:`PlainText` renders no chat format at all: the messages' text, bare, for the model to
continue (``2+3=`` -> ``5``). :func:`completion_or_chat` picks it for an env that has a bare form
as well as a chat one (``arithmetic``, ``guess_number``) on the embedded tiny model.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from headrace.core.errors import ConfigError
from headrace.core.frozen import quick_init
from headrace.core.types import Env, Metrics, SampledTokens, StepResult, StopCondition, Tokens
from headrace.envs.context import EnvContext
from headrace.renderers import Message, Renderer
from headrace.renderers.plain_text import PlainText


@quick_init
@dataclass(frozen=True)
class MessageStep:
    """An env's answer to one assistant turn. ``messages``: what comes next in the conversation
    (a bare string is a user message); ignored once ``done``."""

    reward: float = 0.0
    done: bool = False
    messages: Sequence[Message | str] = ()
    metrics: Metrics = field(default_factory=dict)


@quick_init
@dataclass(frozen=True)
class Verdict:
    """A grade with figures of its own (``check_answer`` may also return a bool or a float)."""

    score: float
    metrics: Metrics = field(default_factory=dict)


def as_message(m: Message | str) -> Message:
    return {"role": "user", "content": m} if isinstance(m, str) else m


class MessageEnv(Env):
    """A multi-turn episode over messages; ``max_turns`` (None: no limit of its own) ends it
    after that many assistant turns (``turn_limit`` in the metrics) when ``respond`` has not.

    The engine asks each env for its first prompt once; ``initial_observation`` still starts
    over if called again, so ``initial_messages`` must not depend on earlier calls.
    """

    def __init__(self, renderer: Renderer, max_tokens: int, max_turns: int | None = None):
        self.renderer, self.max_tokens, self.max_turns = renderer, max_tokens, max_turns
        self.messages: list[Message] = []  # the conversation so far
        self.turns = 0
        self._observation: Tokens = []

    @abstractmethod
    def initial_messages(self) -> Sequence[Message]: ...

    @abstractmethod
    async def respond(self, text: str, clean: bool) -> MessageStep: ...

    @property
    def last_turn(self) -> bool:
        """True while answering the last turn ``max_turns`` allows: score it, the episode ends."""
        return self.max_turns is not None and self.turns >= self.max_turns

    def stop(self) -> StopCondition:
        return self.renderer.stop_condition(self.max_tokens)

    async def initial_observation(self) -> tuple[Tokens, StopCondition]:
        self.messages, self.turns = [as_message(m) for m in self.initial_messages()], 0
        self._observation = self.renderer.build_generation_prompt(self.messages)
        return list(self._observation), self.stop()

    async def step(self, action: SampledTokens) -> StepResult:
        message, clean = self.renderer.parse_response(action.tokens)
        self.messages.append(message)
        self.turns += 1
        result = await self.respond(message["content"], clean)
        metrics = {"truncated": 0.0 if clean else 1.0, **result.metrics}
        if result.done:
            return StepResult(result.reward, True, [], None, metrics)
        if self.last_turn:
            metrics["turn_limit"] = 1.0
            return StepResult(result.reward, True, [], None, metrics)
        new = [as_message(m) for m in result.messages]
        self.messages += new
        self._observation = self.renderer.next_observation(self._observation, action.tokens, new)
        return StepResult(result.reward, False, list(self._observation), self.stop(), metrics)


class ProblemEnv(MessageEnv):
    """One question, one answer, one grade. ``prefix``: messages before the question (a system
    prompt, few-shot turns). ``format_ok`` needs a clean stop and ``check_format(text)``; a
    malformed answer costs ``format_coef`` (0: format is only reported)."""

    def __init__(
        self, renderer: Renderer, max_tokens: int, *, prefix: Sequence[Message] = (), format_coef: float = 0.0
    ):
        super().__init__(renderer, max_tokens, max_turns=1)
        self.prefix, self.format_coef = tuple(prefix), format_coef

    @abstractmethod
    def question(self) -> str | Sequence[Message]: ...

    @abstractmethod
    async def check_answer(self, text: str) -> bool | float | Verdict: ...

    def check_format(self, text: str) -> bool:
        return True

    def initial_messages(self) -> list[Message]:
        question = self.question()
        if isinstance(question, str):  # a user message, made here once (``as_message`` passes it on as it is)
            return [*self.prefix, {"role": "user", "content": question}]
        return [*self.prefix, *question]

    async def respond(self, text: str, clean: bool) -> MessageStep:
        verdict = await self.check_answer(text)
        if type(verdict) is Verdict or isinstance(verdict, Verdict):
            score, extra = verdict.score, verdict.metrics
        else:
            score, extra = float(verdict), {}
        format_ok = float(self.check_format(text)) if clean else 0.0
        reward = score + self.format_coef * (format_ok - 1.0)
        metrics = {"correct": score, "format_ok": format_ok}
        if extra:
            metrics.update(extra)
        return MessageStep(reward, True, (), metrics)


def completion_or_chat(ctx: EnvContext) -> Renderer:
    """The renderer for an env written both ways, a bare completion (``2+3=``) and a chat question
    ("What is 2+3? Answer with the number only."); the env writes the bare form when
    ``renderer.name == PlainText.name``.

    :class:`PlainText` where the run's format is ``tiny`` (the embedded model's, which learns from
    scratch: its benchmarks and learning figures were measured on the bare form), and where the
    model's default format cannot be written by its tokenizer (a random model on the character
    tokenizer, which has no newline for ``role_colon`` and no chat template): the bare form needs
    none. Else the run's renderer (``ctx.renderer``). A format asked for by name
    (``--renderer``) that cannot be built is still refused, with the renderer's own message.
    """
    try:
        renderer = ctx.renderer
    except ConfigError:
        if ctx.renderer_name is not None:
            raise
        return PlainText(ctx.tokenizer)
    return PlainText(ctx.tokenizer) if renderer.name == "tiny" else renderer


__all__ = ["MessageEnv", "MessageStep", "PlainText", "ProblemEnv", "Verdict", "as_message", "completion_or_chat"]
