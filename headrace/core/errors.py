"""The library's one error tree: every error headrace raises on purpose is a ``HeadraceError``
(exported as ``headrace.HeadraceError``), on one of its branches:

- ``ConfigError``: input refused before a run starts (a wrong option, name, path or file); the
  CLI answers it with its message and exit status 2.
- ``EnvError``: an env broke its contract, its code failed, or it refused its options or data.
- ``BackendError``: a backend failed (``BackendFailure`` stops the run; ``TransientBackendError``
  is worth retrying).
- ``RunError``: the run itself failed (every group dropped, a non-finite number, a full disk).
- ``RequestError``: a request one of headrace's servers refuses, answered with its HTTP status.

Each error keeps the builtin base it had (a ``ConfigError`` is a ``ValueError``, an
``EnvContractError`` a ``TypeError``), so handlers written against those still catch it; the
branches are mixins for ``except``, and the classes live (and are imported from) where they are
raised. ARCHITECTURE.md, "Errors", lists them."""

import asyncio
import difflib
from collections.abc import Iterable


class HeadraceError(Exception):
    """The base of every error headrace raises on purpose: ``except headrace.HeadraceError``."""


class ConfigError(HeadraceError, ValueError):
    """A configuration the engine refuses; the message names the problem and the fix."""


class EnvError(HeadraceError):
    """An env's failure: it broke its contract (``EnvContractError``), its code raised, or it
    refused its options or its data."""


class BackendError(HeadraceError):
    """A backend's failure: what a training or sampling backend (or the cluster under it) raised."""


class RunError(HeadraceError):
    """The run failed as a whole, for a reason its message explains (exit status 1)."""


class RequestError(HeadraceError):
    """A request a server of headrace's refuses (the agents' endpoint, ``serve``, the emulator):
    answered with its HTTP status, never raised out of the server."""


class BackendFailure(BackendError, RuntimeError):
    """A backend stopped the run for a reason its message explains (what failed and how to go on):
    the CLI shows the message as is, exit status 1. Raise a subclass from a backend of your own."""


class TransientBackendError(BackendError):
    """An error that may go away if the same call is made again: the run retries it with backoff
    (``retry.backoff_*``). Anything else a backend raises is not retried."""


def did_you_mean(name: str, choices: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or nothing: for a refusal's message."""
    match = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean '{prefix}{match[0]}'?)" if match else ""


def root_cause(group: BaseExceptionGroup) -> BaseException:
    """The error that started a failure: nested task groups wrap it, and the siblings it
    cancelled add nothing. Its own traceback is kept. What a caller of the library sees is
    this error, never a group around it (``Graph.run``, ``lifespans``, the CLI)."""
    leaves: list[BaseException] = []

    def walk(error: BaseException) -> None:
        if isinstance(error, BaseExceptionGroup):
            for inner in error.exceptions:
                walk(inner)
        else:
            leaves.append(error)

    walk(group)
    for leaf in leaves:
        if not isinstance(leaf, asyncio.CancelledError):  # anyio's, on asyncio; callable with no loop running
            return leaf
    return leaves[0] if leaves else group
