"""``role_colon``: plain ``Role: content`` turns for base models (no chat template)::

    System: Be brief.

    User: What is 2+3?

    Assistant: 5

A turn ends with a blank line. The sampler stops at EOS and at the tokenizer's "\\n\\n" token
when it has one; a model that writes the blank line as two "\\n" tokens runs on into a "User:"
line, which ``parse_response`` cuts off (``stop_strings`` names it for samplers that match text).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from headrace.core.errors import ConfigError

from .base import Message, Renderer, check_roles

ROLES = ("system", "user", "assistant", "tool")
END = "\n\n"


class RoleColonRenderer(Renderer):
    name = "role_colon"
    stop_strings = (END + "User:",)

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        end = tokenizer.encode(END)
        if tokenizer.decode(end) != END:
            raise ConfigError(
                "the 'role_colon' renderer separates turns with a blank line, which this tokenizer cannot write "
                "(the embedded character tokenizer has no newline): use --renderer tiny for --model tiny."
            )
        self.end_of_turn = tuple(end)
        self.stop_token_ids = tuple(dict.fromkeys([tokenizer.eos_token_id, *(end if len(end) == 1 else ())]))
        self._bos = _own_prefix(tokenizer)

    def build_generation_prompt(self, messages: Sequence[Message]) -> list[int]:
        check_roles(messages, ROLES, self.name)
        return self._bos + self.tok.encode("".join(map(_turn, messages)) + "Assistant:")

    def continuation(self, messages: Sequence[Message]) -> list[int]:
        check_roles(messages, ROLES, self.name)
        return self.tok.encode("".join(map(_turn, messages)) + "Assistant:")

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, bool]:
        tokens = list(tokens)
        eos = bool(tokens) and tokens[-1] == self.tok.eos_token_id
        text = self.tok.decode(tokens[:-1] if eos else tokens)
        content, sep, rest = text.partition(END)
        # clean: EOS right after the text, or the blank line with at most the next "User:" after it
        ok = (eos and not sep) or (bool(sep) and not eos and rest in ("", "User:"))
        return {"role": "assistant", "content": content.removeprefix(" ")}, ok


def _turn(m: Message) -> str:
    return f"{m['role'].capitalize()}: {m['content']}{END}"


def _own_prefix(tokenizer: Any) -> list[int]:
    """The BOS the tokenizer itself puts before a text (Llama's <|begin_of_text|>), if any."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None or getattr(hf, "bos_token_id", None) is None:
        return []
    ids = hf.encode("a", add_special_tokens=True)
    return [hf.bos_token_id] if ids and ids[0] == hf.bos_token_id else []
