"""Messages to training datums with the run's renderer, token for token as an RL episode sees
them: each assistant turn's prompt is ``build_generation_prompt`` of the turns before it (then
``continuation`` of the new ones), its tokens the reply and the format's end of turn. Only the
assistant tokens chosen to train carry weight."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from headrace.core.types import Datum

from .data import Messages


def render(
    renderer: Any, tokenizer: Any, messages: Messages, train_on: str = "all_assistant", first: int = 0
) -> tuple[list[int], list[float]]:
    """The conversation's tokens and each token's weight (1 on trained assistant tokens: every
    one, or the last, from message ``first`` on)."""
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    trained = {i for i in (assistant[-1:] if train_on == "last_assistant" else assistant) if i >= first}
    tokens: list[int] = []
    weights: list[float] = []
    start = 0  # the first message not rendered yet
    for i in assistant:
        before = messages[start:i]
        if not tokens:
            context = renderer.build_generation_prompt(before)
        else:
            context = renderer.continuation(before)
        # what ends a sampled reply: the format's end of turn, else (a bare completion) its stop token
        close = tuple(renderer.end_of_turn) or tuple(renderer.stop_token_ids[:1])
        reply = [*tokenizer.encode(messages[i]["content"]), *close]
        tokens += [*context, *reply]
        weights += [0.0] * len(context) + [1.0 if i in trained else 0.0] * len(reply)
        start = i + 1
    return tokens, weights


def to_datum(tokens: Sequence[int], weights: Sequence[float], max_length: int) -> Datum:
    """Position t predicts token t+1; the first token is only an input."""
    tokens, weights = list(tokens)[:max_length], list(weights)[:max_length]
    return Datum(
        model_input=tokens[:-1],
        target_tokens=tokens[1:],
        logprobs=[0.0] * (len(tokens) - 1),
        advantages=[0.0] * (len(tokens) - 1),
        mask=weights[1:],
    )


def scaled(datum: Datum, scale: float) -> Datum:
    return Datum(
        datum.model_input, datum.target_tokens, datum.logprobs, datum.advantages, [m * scale for m in datum.mask]
    )


def token_batches(sizes: Sequence[int], budget: int, order: Sequence[int]) -> list[list[int]]:
    """Indices in ``order`` cut into batches of at most ``budget`` tokens (an example longer than it alone)."""
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in order:
        if current and used + sizes[i] > budget:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += sizes[i]
    if current:
        batches.append(current)
    return batches
