"""The one error a model lookup raises."""

from __future__ import annotations

from headrace.core.errors import ConfigError


class ModelLoadError(ConfigError):
    """The model (or its tokenizer) could not be found or loaded."""


def first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0].rstrip(".")
