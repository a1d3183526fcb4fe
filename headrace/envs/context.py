"""What an env factory gets (``EnvContext``): the tokenizer of the model in use, the run's shape,
its options, and the renderer for its model. Here, not in ``core``: the renderer is built from
``headrace.renderers``, which sits above the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from headrace.core.types import Tokenizer


@dataclass(frozen=True)
class EnvContext:
    """What an env factory gets: the tokenizer of the model in use, the run's shape, its options."""

    tokenizer: Tokenizer
    group_size: int
    batch_size: int
    steps: int
    seed: int
    max_tokens: int
    options: dict[str, Any] = field(default_factory=dict)
    model: str = "tiny"
    renderer_name: str | None = None  # --renderer; None = the model's default

    @cached_property  # frozen, but cached_property writes the instance dict directly
    def renderer(self) -> Any:
        """Messages <-> tokens for this model (``headrace.renderers``), made once, on first use."""
        from headrace.renderers import renderer_for

        return renderer_for(self.model, self.tokenizer, self.renderer_name)
