"""Writes ``headrace/assets/tokenizer.json``: the embedded character tokenizer as a Hugging Face
``tokenizers`` file, with exactly the ids of :class:`headrace.tokenizers.char.CharTokenizer`.

The engine itself uses ``CharTokenizer`` (no dependency); the JSON exists so a model directory
exported from the embedded model (``save_pretrained``) loads anywhere with ``AutoTokenizer``,
e.g. in vLLM. Regenerate with ``python -m headrace.tokenizers.tiny_hf``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from headrace.tokenizers.char import SPECIALS, CharTokenizer

ASSET_PATH = Path(__file__).resolve().parents[1] / "assets" / "tokenizer.json"
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}


def build_tokenizer():  # -> tokenizers.Tokenizer
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel

    chars = CharTokenizer()
    tok = Tokenizer(WordLevel(vocab=dict(chars.token_to_id), unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()  # CharTokenizer.encode lower-cases too
    # every character is its own word; [\s\S] so that a newline is one (unknown) token as well
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters without the spaces WordLevel would add
    tok.add_special_tokens(list(SPECIALS))
    return tok


def write(path: Path = ASSET_PATH) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(path), pretty=True)
    return path


def hf_tokenizer(path: Path = ASSET_PATH):  # -> transformers.PreTrainedTokenizerFast
    """The shipped file as a ``transformers`` tokenizer, for saving a loadable model directory."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(path), **SPECIAL_TOKENS)


if __name__ == "__main__":
    out = write(Path(sys.argv[1]) if len(sys.argv) > 1 else ASSET_PATH)
    print(f"wrote {out}")
