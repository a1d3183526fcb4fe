"""The embedded character-level tokenizer: tiny, dependency-free, shipped with the package.

The same vocabulary backs ``headrace/assets/tokenizer.json`` (a Hugging Face ``tokenizers``
file, written by ``python -m headrace.tokenizers.tiny_hf``), so the sim backend and the embedded
torch model agree on token ids.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from itertools import repeat

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = string.digits + "+-*/=?<>!., :;()" + string.ascii_lowercase


class CharTokenizer:
    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    unk_token_id = 3

    def __init__(self) -> None:
        self.id_to_token = [*SPECIALS, *CHARS]
        self.token_to_id = {t: i for i, t in enumerate(self.id_to_token)}
        self._text = {i: t for i, t in enumerate(self.id_to_token) if i >= len(SPECIALS)}

    @property
    def vocab_size(self) -> int:
        return len(self.id_to_token)

    def encode(self, text: str) -> list[int]:
        return list(map(self.token_to_id.get, text.lower(), repeat(self.unk_token_id)))  # C speed: per prompt

    def decode(self, tokens: Sequence[int]) -> str:
        # ids outside the vocabulary (e.g. the sim's version stamps) and specials decode to nothing
        return "".join(map(self._text.get, tokens, repeat("")))
