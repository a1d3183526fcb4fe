"""A ``transformers`` tokenizer behind the engine's small ``Tokenizer`` protocol."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class HFTokenizer:
    """encode/decode without implicit specials (envs add the ones they mean), plus the chat
    template when the model has one."""

    def __init__(self, hf_tokenizer: Any):
        self.hf = hf_tokenizer
        eos = hf_tokenizer.eos_token_id
        if eos is None:
            raise ValueError("the tokenizer has no EOS token; a sampler could never stop on its own")
        self.eos_token_id: int = eos
        pad = hf_tokenizer.pad_token_id
        self.pad_token_id: int = pad if pad is not None else eos
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.hf)  # includes added tokens, unlike hf.vocab_size

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, tokens: Sequence[int]) -> str:
        return self.hf.decode(list(tokens), skip_special_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation, ready for the next assistant turn."""
        if not self.has_chat_template:
            raise ValueError("this tokenizer has no chat template")
        out = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):  # transformers 5 may return a BatchEncoding
            out = out["input_ids"]
        return list(out)
