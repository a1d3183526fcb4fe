"""Backoff for transient backend errors (connection drops, 5xx, rate limits), through tenacity.

Deterministic errors are not retried: retrying a bad request only hides it. A backend marks an
error as transient by raising ``TransientBackendError`` (or a subclass), or by raising a
``ConnectionError``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

P = ParamSpec("P")
R = TypeVar("R")


class TransientBackendError(Exception):
    """An error that may go away if the same call is made again."""


def is_transient(error: BaseException) -> bool:
    return isinstance(error, TransientBackendError | ConnectionError)


# Module-level so tests can shorten the waits; a run never changes it.
RETRY_POLICY = {"attempts": 6, "initial": 0.05, "max": 5.0}


async def retry_transient(fn: Callable[P, Awaitable[R]], *args: P.args, **kwargs: P.kwargs) -> R:
    # The first try runs bare: tenacity's machinery costs more than a sim sample, and almost
    # every call succeeds at once.
    try:
        return await fn(*args, **kwargs)
    except Exception as e:
        if not is_transient(e):
            raise
    async for attempt in AsyncRetrying(
        retry=retry_if_exception(is_transient),
        stop=stop_after_attempt(RETRY_POLICY["attempts"] - 1),
        wait=wait_exponential_jitter(multiplier=RETRY_POLICY["initial"], max=RETRY_POLICY["max"], jitter=RETRY_POLICY["initial"]),
        reraise=True,
    ):
        with attempt:
            return await fn(*args, **kwargs)
    raise AssertionError("unreachable")  # pragma: no cover
