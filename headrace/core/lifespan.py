"""What a dataset may run beside the run that reads it: a service for its whole life.

A dataset with a ``lifespan()`` (an async context manager) has it entered before the actors start
and left after they stop: the agents' endpoint (``headrace/agents``) serves the run's episodes
this way, its connections tasks of a group that outlives every episode.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Protocol, runtime_checkable

from headrace.core.errors import root_cause


@runtime_checkable
class HasLifespan(Protocol):
    def lifespan(self) -> AbstractAsyncContextManager[None]: ...


@contextlib.asynccontextmanager
async def lifespans(*owners: object) -> AsyncIterator[None]:
    """Each owner's lifespan, entered in order and left in reverse (owners without one are skipped).
    A lifespan that holds a task group (the agents' endpoint) wraps the error the run raised
    inside it in an ``ExceptionGroup``; the error is raised as itself."""
    try:
        async with contextlib.AsyncExitStack() as stack:
            for owner in owners:
                if isinstance(owner, HasLifespan):
                    await stack.enter_async_context(owner.lifespan())
            yield
    except BaseExceptionGroup as group:
        raise root_cause(group) from None
