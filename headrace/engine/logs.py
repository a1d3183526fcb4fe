"""structlog, configured per run to write JSON lines into the run directory's ``log.jsonl``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TextIO

import structlog

_open: list[TextIO] = []  # the current log file, closed when the next run reconfigures


def configure(path: Path) -> None:
    while _open:
        _open.pop().close()
    handle = open(path, "a", buffering=1)  # noqa: SIM115 - lives until the next run
    _open.append(handle)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.WriteLoggerFactory(file=handle),
        cache_logger_on_first_use=False,
    )
