"""``tiny``: a compact format inside the embedded character tokenizer's 56 symbols (lower-case
letters, digits, ``+-*/=?<>!., :;()``; no newline, no capitals)::

    u:what is 2+3?<eos>a:5<eos>

Every turn is ``<role letter>:content`` closed by the EOS token; the assistant's turn opens with
``a:`` and the sampler stops at EOS. Text outside the vocabulary is lower-cased, and what is
still unknown becomes ``<unk>``, exactly as ``CharTokenizer.encode`` does.

Tool calls are written ``<call>name(key=value)</call>`` (``tools.CompactFormat``: the alphabet
has no braces or quotes for JSON), results as ``t:`` turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import Message, Renderer, check_roles, split_at_stop
from .tools import CompactFormat

ROLES = {"system": "s", "user": "u", "assistant": "a", "tool": "t"}


class TinyRenderer(Renderer):
    name = "tiny"

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self.end_of_turn = (tokenizer.eos_token_id,)
        self.stop_token_ids = self.end_of_turn
        self.tool_format = CompactFormat(tokenizer)

    def build_generation_prompt(self, messages: Sequence[Message]) -> list[int]:
        return self.continuation(messages)

    def continuation(self, messages: Sequence[Message]) -> list[int]:
        check_roles(messages, list(ROLES), self.name)
        tokens: list[int] = []
        for m in messages:
            tokens += self.tok.encode(f"{ROLES[m['role']]}:{m['content']}") + list(self.end_of_turn)
        return tokens + self.tok.encode(f"{ROLES['assistant']}:")

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, bool]:
        body, ok = split_at_stop(tokens, self.stop_token_ids)
        return {"role": "assistant", "content": self.tok.decode(body)}, ok
