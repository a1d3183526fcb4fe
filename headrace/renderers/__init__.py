"""Renderers: messages <-> tokens, so envs are written in messages and strings, not token ids.

``get_renderer(name, tokenizer)`` makes one by name (``--renderer``); ``renderer_for(model,
tokenizer)`` makes the model's default (from :mod:`headrace.models`): ``tiny`` for the embedded
model, ``chat_template`` for models whose tokenizer has a chat template, ``role_colon`` otherwise;
``plain_text`` (no format: the messages' text bare, for the model to continue) by name only.
"""

from __future__ import annotations

import difflib
from typing import Any

from headrace.core.errors import ConfigError

from .base import Message, Renderer
from .chat_template import ChatTemplateRenderer
from .plain_text import PlainText
from .role_colon import RoleColonRenderer
from .tiny import TinyRenderer

RENDERERS: dict[str, type[Renderer]] = {
    r.name: r for r in (ChatTemplateRenderer, RoleColonRenderer, TinyRenderer, PlainText)
}


def get_renderer(name: str, tokenizer: Any) -> Renderer:
    cls = RENDERERS.get(name)
    if cls is None:
        match = difflib.get_close_matches(name, list(RENDERERS), n=1)
        hint = f" (did you mean '{match[0]}'?)" if match else ""
        raise ConfigError(f"unknown renderer '{name}'{hint}; valid renderers: {', '.join(RENDERERS)}")
    return cls(tokenizer)


def default_renderer_name(model: str, tokenizer: Any) -> str:
    from headrace.models import model_spec

    named = model_spec(model).renderer
    if named:
        return named
    return "chat_template" if getattr(getattr(tokenizer, "hf", tokenizer), "chat_template", None) else "role_colon"


def renderer_for(model: str, tokenizer: Any, name: str | None = None) -> Renderer:
    """``--renderer name``, or the model's default when it is None."""
    return get_renderer(name or default_renderer_name(model, tokenizer), tokenizer)


__all__ = ["RENDERERS", "Message", "Renderer", "default_renderer_name", "get_renderer", "renderer_for"]
