"""What the HTTP server (``http.py``) bounds, and how it tells what it refused.

``Limits`` is read on every connection and request (the emulator's knobs can change while it
runs; ``headrace serve``'s come from ``serve.*``). The connection cap is also bounded by the
open-file limit, measured when the server starts, so that the process never runs out of
descriptors: past the cap a new connection is answered 503 and closed at once.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from headrace.core import logs

BACKLOG = 64  # connections the kernel queues for accept(): asyncio accepts up to this many in one go
SPARE_FDS = BACKLOG + 64  # descriptors left free: sockets accepted in one go, and the files the process opens
UNBOUNDED = 1 << 30

log = logging.getLogger(__name__)
run_log = logs.get_logger()


class Limits(Protocol):
    max_body_mib: float  # a larger body is answered 413 as soon as its size is known
    idle_connection_s: float  # a keep-alive connection with no request this long is closed; 0 = never
    header_timeout_s: float  # a request's line and headers must arrive within this; 0 = no limit
    max_connections: int  # connections served at once; past it, 503


@dataclass
class ServerLimits:
    """The limits of a server given none."""

    max_body_mib: float = 32.0
    idle_connection_s: float = 30.0
    header_timeout_s: float = 10.0
    max_connections: int = 1024


def descriptor_room() -> int:
    """Connections the open-file limit (``ulimit -n``) leaves room for, beside what is open now."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return UNBOUNDED
    if soft == resource.RLIM_INFINITY:
        return UNBOUNDED
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: a guess at what an idle process holds
        open_now = 64
    return max(1, soft - open_now - SPARE_FDS)


class Tally:
    """What a server refused or cut, counted by kind; the 1st, 2nd, 4th, 8th... of each kind is
    logged (to stderr, and to the run's ``log.jsonl`` when there is a run), so an attack cannot
    fill the log."""

    def __init__(self, server: str):
        self.server = server
        self.counts: Counter[str] = Counter()

    def count(self, kind: str) -> int:
        self.counts[kind] += 1
        return self.counts[kind]

    def note(self, kind: str, message: str, error: BaseException | None = None) -> None:
        n = self.count(kind)
        if n & (n - 1) == 0:
            self.say(f"{message} ({n} {kind} so far)", error, kind)

    def say(self, message: str, error: BaseException | None = None, kind: str = "limit") -> None:
        log.warning("%s: %s", self.server, message, exc_info=error)
        run_log.warning("http_" + kind, server=self.server, message=message, exc_info=error)
