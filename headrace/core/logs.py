"""Structured logs, scoped to a run: each run writes JSON lines into its own ``log.jsonl``.

headrace's modules log through ``get_logger``; a ContextVar set by ``run_log`` picks the file, so
two runs in one process, even concurrently in one event loop, each write their own, and a line
logged outside any run goes nowhere. structlog's global configuration is left to the application.
The tasks a run starts inherit its context; a thread it starts must be given it
(``contextvars.copy_context().run``, which ``asyncio.to_thread`` and anyio already do).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, TextIO, cast

import structlog

from headrace.core.nofollow import cut_after_last_line, open_no_follow

_current: ContextVar[TextIO | None] = ContextVar("headrace_run_log", default=None)

PROCESSORS = [
    structlog.contextvars.merge_contextvars,
    structlog.processors.add_log_level,
    structlog.processors.TimeStamper(fmt="iso"),
    structlog.processors.format_exc_info,
    structlog.processors.JSONRenderer(),
]


class _RunLogFile:
    """structlog's last step: a rendered line goes to the current run's file, if there is one."""

    def msg(self, message: str) -> None:
        handle = _current.get()
        if handle is not None:
            handle.write(message + "\n")

    log = debug = info = warn = warning = err = error = critical = fatal = exception = failure = msg


_Logger: Any = structlog.make_filtering_bound_logger(logging.INFO)  # a class; typed as its protocol


def get_logger() -> Any:
    """A logger that writes to whichever run is current where it is called."""
    return _Logger(_RunLogFile(), PROCESSORS, {})


@contextmanager
def run_log(path: Path) -> Iterator[None]:
    """Send this context's log lines (and those of the tasks it starts) to ``path``, appending."""
    handle = cast(TextIO, open_no_follow(path, "a+", buffering=1))  # closed on exit below
    try:
        cut_after_last_line(handle.fileno())  # a line kill -9 cut short would swallow this run's first
    except BaseException:
        handle.close()
        raise
    token = _current.set(handle)
    try:
        yield
    finally:
        _current.reset(token)
        handle.close()
