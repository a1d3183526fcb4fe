"""``chat_template``: the tokenizer's own Jinja chat template (ChatML for SmolLM2 and Qwen, Llama 3's
headers, ...), stopping at the template's end-of-turn token (``<|im_end|>``, ``<|eot_id|>``).

The end-of-turn token and what follows it are read off the template itself: a probe
conversation ending in an assistant turn is rendered, and the first special token after the
assistant's text is the end of its turn. Continuing an episode renders the new messages after
that same probe, so the template decides what goes between turns and nothing already sampled is
ever re-tokenised. A template that rewrites earlier turns once more follow (e.g. one that drops
past reasoning) cannot be continued this way; ``continuation`` says so instead of drifting.

Tools: a template that writes Hermes tool calls itself (Qwen2.5's and its kin: it takes ``tools``
and writes ``<tool_call>``) is given them (``apply_chat_template(tools=...)``); any other
(SmolLM2's knows no tools) gets the Hermes text written into its messages (``tools.lower_tools``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from headrace.core.errors import ConfigError

from .base import Message, Renderer, split_at_stop
from .tools import Tool, template_messages

_PROBE = "HEADRACE_PROBE_7f3a"  # an assistant text no template alters (no whitespace to trim)
REWRITES = (
    "this chat template renders an earlier assistant turn differently once more messages follow it, "
    "so the next observation cannot extend the previous one token for token. Build each turn's "
    "prompt with build_generation_prompt (and train the turns as separate sequences), or use a "
    "template without that rewrite."
)


class ChatTemplateRenderer(Renderer):
    name = "chat_template"

    def __init__(self, tokenizer: Any):
        self.hf = getattr(tokenizer, "hf", tokenizer)  # headrace's HFTokenizer wraps a transformers one
        self._template_kwargs: dict[str, Any] = {}
        if not getattr(self.hf, "chat_template", None):
            raise ConfigError(
                "the 'chat_template' renderer needs a tokenizer with a chat template, and this model's has none "
                "(a base model?). Use --renderer role_colon, or a model directory whose tokenizer_config.json "
                "or chat_template.jinja carries a template."
            )
        self._probe: list[Message] = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE}]
        self._closed = self._text(self._probe, add_generation_prompt=False)
        after = self._closed[self._closed.rindex(_PROBE) + len(_PROBE) :]  # e.g. "<|im_end|>\n"
        eot = self._first_special(after)
        eos = self.hf.eos_token_id
        if eot is None:
            if eos is None:
                raise ConfigError(
                    "the chat template closes an assistant turn without a special token and the "
                    "tokenizer has no EOS: a sample could never stop. Use --renderer role_colon."
                )
            eot, self._after_eot = eos, after
        else:
            token = self.hf.convert_ids_to_tokens(eot)
            self._after_eot = after[after.index(token) + len(token) :]
        self.end_of_turn = (eot,)
        self.stop_token_ids = tuple(dict.fromkeys(t for t in (eot, eos) if t is not None))
        template = self.hf.chat_template
        self.native_tools = isinstance(template, str) and "tools" in template and "<tool_call>" in template

    def build_generation_prompt(self, messages: Sequence[Message]) -> list[int]:
        return self._encode(self._text(messages, add_generation_prompt=True))

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, bool]:
        body, ok = split_at_stop(tokens, self.stop_token_ids)
        return {"role": "assistant", "content": self.hf.decode(body, skip_special_tokens=False)}, ok

    def continuation(self, messages: Sequence[Message]) -> list[int]:
        full = self._text([*self._probe, *messages], add_generation_prompt=True)
        if not full.startswith(self._closed):
            raise ValueError(REWRITES)
        return self._encode(self._after_eot + full[len(self._closed) :])

    def prompt_with_tools(self, messages: Sequence[Message], tools: Sequence[Tool] | None) -> list[int]:
        if not self.native_tools:
            return super().prompt_with_tools(messages, tools)
        return self._encode(self._text(template_messages(messages), add_generation_prompt=True, tools=tools))  # type: ignore[arg-type]

    def continuation_with_tools(self, messages: Sequence[Message], tools: Sequence[Tool] | None) -> list[int]:
        if not self.native_tools:
            return super().continuation_with_tools(messages, tools)
        # the probe with the same tools: they are written at the start, before the probe's turns
        closed = self._text(self._probe, add_generation_prompt=False, tools=tools)
        full = self._text([*self._probe, *template_messages(messages)], add_generation_prompt=True, tools=tools)  # type: ignore[list-item]
        if not full.startswith(closed):
            raise ValueError(REWRITES)
        return self._encode(self._after_eot + full[len(closed) :])

    def with_template_kwargs(self, kwargs: dict[str, Any]) -> ChatTemplateRenderer:
        if not kwargs:
            return self
        # a copy for one request: the end-of-turn token read off the probe stays the served model's
        other = copy.copy(self)
        other._template_kwargs = {**self._template_kwargs, **kwargs}
        return other

    def _text(
        self, messages: Sequence[Message], add_generation_prompt: bool, tools: Sequence[Tool] | None = None
    ) -> str:
        return self.hf.apply_chat_template(
            [dict(m) for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **({"tools": list(tools)} if tools else {}),
            **self._template_kwargs,
        )

    def _encode(self, text: str) -> list[int]:
        # the template writes its special tokens (<|im_start|>, a BOS) as text: nothing to add
        return list(self.hf.encode(text, add_special_tokens=False))

    def _first_special(self, text: str) -> int | None:
        special = set(self.hf.all_special_ids) | {
            i for i, t in getattr(self.hf, "added_tokens_decoder", {}).items() if getattr(t, "special", False)
        }
        return next((t for t in self._encode(text) if t in special), None)
