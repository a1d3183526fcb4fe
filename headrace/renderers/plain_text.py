"""``plain_text``: no chat format at all, the messages' text bare, for the model to continue."""

from __future__ import annotations

from collections.abc import Sequence

from headrace.core.types import Tokenizer

from .base import Message, Renderer, split_at_stop


class PlainText(Renderer):
    """No chat format: every message is its text alone, one after another, and the model continues
    it up to the tokenizer's EOS. No roles, no turn markers: ``[user "guess 0-9:"]`` is the prompt
    ``guess 0-9:``; a sampled ``5<eos>`` and the user message ``" higher:"`` make the next one
    ``guess 0-9:5<eos> higher:``. A turn cut off before EOS is continued as sampled, since nothing
    in this format closes a turn.

    For a model that learns from scratch whatever text it is given, as the embedded tiny model
    does. Built from a bare tokenizer, so the env needs nothing the run does not already have.
    """

    name = "plain_text"
    end_of_turn: tuple[int, ...] = ()

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.stop_token_ids = (tokenizer.eos_token_id,)

    def build_generation_prompt(self, messages: Sequence[Message]) -> list[int]:
        return self.continuation(messages)

    def continuation(self, messages: Sequence[Message]) -> list[int]:
        return list(self.tok.encode("".join([m["content"] for m in messages])))

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, bool]:
        body, ok = split_at_stop(tokens, self.stop_token_ids)
        return {"role": "assistant", "content": self.tok.decode(body)}, ok
