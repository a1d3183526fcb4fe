"""Backoff for transient backend errors (connection drops, 5xx, rate limits), through tenacity.

Deterministic errors are not retried: retrying a bad request only hides it. A backend marks an
error as transient by raising ``TransientBackendError`` (or a subclass), or by raising a
``ConnectionError``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

# defined with the rest of what a backend provides; imported from here by older code
from headrace.core.protocols import TransientBackendError

__all__ = ["Backoff", "TransientBackendError", "is_transient", "retry_transient"]

P = ParamSpec("P")
R = TypeVar("R")


def is_transient(error: BaseException) -> bool:
    return isinstance(error, TransientBackendError | ConnectionError)


@dataclass(frozen=True)
class Backoff:
    """How a run retries a transient error: up to ``attempts`` tries in all, waiting
    ``initial_s``·2ⁿ (plus up to ``initial_s`` of jitter, at most ``max_s``) between them.
    Built per run from the ``retry`` section of its config."""

    attempts: int = 6
    initial_s: float = 0.05
    max_s: float = 5.0


async def retry_transient(backoff: Backoff, fn: Callable[P, Awaitable[R]], *args: P.args, **kwargs: P.kwargs) -> R:
    # The first try runs bare: tenacity's machinery costs more than a sim sample, and almost
    # every call succeeds at once.
    try:
        return await fn(*args, **kwargs)
    except Exception as e:
        if not is_transient(e) or backoff.attempts <= 1:
            raise
    async for attempt in AsyncRetrying(
        retry=retry_if_exception(is_transient),
        stop=stop_after_attempt(backoff.attempts - 1),
        wait=wait_exponential_jitter(multiplier=backoff.initial_s, max=backoff.max_s, jitter=backoff.initial_s),
        reraise=True,
    ):
        with attempt:
            return await fn(*args, **kwargs)
    raise AssertionError("unreachable")  # pragma: no cover
