"""What every renderer does: messages to prompt tokens, sampled tokens back to a message, and the
next observation of a multi-turn episode, token in / token out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, NotRequired, TypedDict

from headrace.core.types import StopCondition

from .tools import HERMES, Reply, Tool, ToolFormat, lower_tools


class Message(TypedDict):
    role: str  # system | user | assistant | tool (what the format knows)
    content: str
    name: NotRequired[str]
    tool_calls: NotRequired[list[dict[str, Any]]]  # an assistant's calls, OpenAI's shape (renderers/tools.py)
    tool_call_id: NotRequired[str]  # a tool result's call


class Renderer(ABC):
    """Messages <-> tokens for one prompt format.

    ``build_generation_prompt`` renders a conversation and opens the assistant's turn.
    ``parse_response`` turns the sampled tokens back into an assistant message, and says whether
    the turn ended cleanly (at a stop token, not cut off by ``max_tokens``).
    ``next_observation`` continues an episode without re-tokenising anything: the previous
    prompt, the sampled tokens exactly as sampled (closed with the end-of-turn tokens when the
    sample was cut off before them), then the new messages and the next generation prompt. So
    every observation extends the previous observation + action, and the episode trains as one
    sequence.

    Tools (OpenAI's ``tools``, calls in assistant messages, ``tool`` results): ``prompt_with_tools``
    and ``continuation_with_tools`` write them in the renderer's ``tool_format`` (Hermes unless
    the format needs its own), and ``parse_reply`` reads the calls back out of a reply's text.
    """

    name: ClassVar[str]
    tool_format: ToolFormat = HERMES
    stop_token_ids: tuple[int, ...]  # the sampler stops at any of them
    end_of_turn: tuple[int, ...]  # what closes an assistant turn in this format

    @abstractmethod
    def __init__(self, tokenizer: Any):
        """Every renderer is built from the model's tokenizer alone (``get_renderer`` does so by name)."""

    @abstractmethod
    def build_generation_prompt(self, messages: Sequence[Message]) -> list[int]: ...

    @abstractmethod
    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, bool]: ...

    @abstractmethod
    def continuation(self, messages: Sequence[Message]) -> list[int]:
        """The tokens after a closed assistant turn: ``messages`` rendered, then the generation prompt."""

    def next_observation(self, prompt: Sequence[int], action: Sequence[int], messages: Sequence[Message]) -> list[int]:
        tokens = [*prompt, *action]
        if not self.closes_turn(action):
            tokens += self.end_of_turn
        return tokens + self.continuation(messages)

    def prompt_with_tools(self, messages: Sequence[Message], tools: Sequence[Tool] | None) -> list[int]:
        """``build_generation_prompt`` for a conversation that may offer tools, call them and hold their results."""
        return self.build_generation_prompt(lower_tools(messages, tools, self.tool_format))  # type: ignore[arg-type]

    def continuation_with_tools(self, messages: Sequence[Message], tools: Sequence[Tool] | None) -> list[int]:
        """``continuation`` for such a conversation (the tools were offered at its start)."""
        return self.continuation(lower_tools(messages, None, self.tool_format))  # type: ignore[arg-type]

    def parse_reply(self, text: str, tools: Sequence[Tool] | None) -> Reply:
        """A reply's text and the tool calls in it (none when no tools were offered)."""
        return self.tool_format.parse(text, tools or ())

    def with_template_kwargs(self, kwargs: dict[str, Any]) -> Renderer:
        """This renderer with extra variables for its chat template (``chat_template_kwargs``,
        such as ``enable_thinking``); a format with no template takes none."""
        if not kwargs:
            return self
        raise ValueError(
            f"chat_template_kwargs ({', '.join(kwargs)}) are variables of a chat template, and this model's "
            f"'{self.name}' renderer has no template to pass them to; leave them out, or serve a model whose "
            "tokenizer has a chat template (--renderer chat_template)"
        )

    def closes_turn(self, action: Sequence[int]) -> bool:
        n = len(self.end_of_turn)
        return len(action) >= n and tuple(action[len(action) - n :]) == self.end_of_turn

    def stop_condition(self, max_tokens: int) -> StopCondition:
        # one (immutable) object per limit: every env of a run asks for it, and a group's prompts
        # then compare by identity (``GroupRunner`` checks that its members share a prompt)
        key = (max_tokens, self.stop_token_ids)
        stops = self.__dict__.setdefault("_stop_conditions", {})
        stop = stops.get(key)
        if stop is None:
            stop = stops[key] = StopCondition(max_tokens, self.stop_token_ids)
        return stop


def split_at_stop(tokens: Sequence[int], stops: Sequence[int]) -> tuple[list[int], bool]:
    """The tokens before the first stop token, and whether the response ended exactly there."""
    if len(stops) == 1:  # the usual case, at C speed: this runs for every sampled turn
        try:
            i = tokens.index(stops[0])
        except ValueError:
            return list(tokens), False
        return list(tokens[:i]), i == len(tokens) - 1
    tokens = list(tokens)
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[:i], i == len(tokens) - 1
    return tokens, False


def check_roles(messages: Sequence[Message], known: Sequence[str], renderer: str) -> None:
    for m in messages:
        if m.get("role") not in known:
            raise ValueError(
                f"the '{renderer}' renderer knows the roles {', '.join(known)}; got a message with role "
                f"{m.get('role')!r}. Use one of those roles, or a renderer whose format has this one."
            )
