"""Which Tinker errors leave a call's outcome uncertain (recover, or retry a sample) and which
are deterministic (a bad request: fail loudly, retrying only hides it)."""

from __future__ import annotations

import asyncio

import tinker

from headrace.core.advantages import NonFiniteError
from headrace.core.errors import BackendError, BackendFailure, ConfigError
from headrace.core.retry import TransientBackendError


class TinkerRecoveryError(BackendFailure):
    """Exactly-once recovery could not restore a committed state; the run stops."""


class TinkerNonFiniteError(NonFiniteError, BackendError):
    """The service returned a NaN or infinite loss (or optimizer metric): the run stops, and
    nothing from that step on is committed or recorded as a checkpoint (exit status 1)."""


class TinkerResumeError(ConfigError):
    """``--resume`` names a saved state the service does not have (404): nothing was created
    (exit status 2)."""


class TinkerTransientError(TransientBackendError):
    """A sampling error that may go away when the same request is made again."""


_DETERMINISTIC_STATUS = {400, 401, 402, 403, 404, 422}


def is_uncertain(error: BaseException) -> bool:
    if isinstance(error, tinker.RequestFailedError):
        return str(getattr(error.category, "value", error.category)).lower() != "user"
    if isinstance(error, tinker.APIStatusError):
        return error.status_code not in _DETERMINISTIC_STATUS
    if isinstance(error, tinker.APIConnectionError | asyncio.TimeoutError | TimeoutError | ConnectionError):
        return True
    if isinstance(error, tinker.TinkerError):
        return True
    # the SDK's "promise expired" (HTTP 410) and a poisoned client surface as these
    return type(error).__name__ in ("RetryableException",) or (
        isinstance(error, RuntimeError) and "poisoned" in str(error)
    )


def as_sampling_error(error: BaseException) -> BaseException:
    """Transient sampling errors become ``TransientBackendError`` so the engine retries them."""
    if is_uncertain(error):
        return TinkerTransientError(f"{type(error).__name__}: {error}")
    return error


def _words(error: BaseException) -> str:
    body = getattr(error, "body", None)
    detail = (body.get("detail") or body.get("error")) if isinstance(body, dict) else None
    return str(detail or error)


def service_detail(error: BaseException) -> str:
    """The service's own words for a refused request, to end a sentence with."""
    return _words(error).rstrip(".")


def service_answer(error: BaseException) -> str:
    """How the service refused a request, for an error message: its status and its own words."""
    kind = f"HTTP {error.status_code} {type(error).__name__}" if hasattr(error, "status_code") else type(error).__name__
    return f"{kind}: {' '.join(_words(error).split())}"
