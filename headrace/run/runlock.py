"""The run directory's lock: one run at a time in a directory, stale locks of dead runs taken over."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from headrace.core.files import open_fd
from headrace.run.rundir_errors import RunDirError

LOCK = ".lock"


class RunLock:
    """``RUN_DIR/.lock``: an flock held while the run lives, with the holder's PID in the file.
    The kernel releases the flock when the process dies (even kill -9), so a stale lock left by
    a dead run is simply taken over."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None
        self.taken_over: str | None = None  # the PID of a dead run whose lock this one took over

    def acquire(self) -> None:
        # never through a link: the lock is emptied and rewritten, and so would be what it points to
        fd = open_fd(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirError(
                f"run directory '{self.path.parent}' is in use by another headrace run (PID {holder}); two runs "
                f"in one directory would interleave their steps. Wait for it to end, stop it (kill {holder}), "
                "or pass another --run-dir."
            ) from None
        except OSError:  # no flock on this file system: the PID alone tells
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            if holder.isdigit() and int(holder) != os.getpid() and _alive(int(holder)):
                os.close(fd)
                raise RunDirError(
                    f"run directory '{self.path.parent}' is in use by PID {holder}. "
                    "Wait for it to end, or pass another --run-dir."
                ) from None
        previous = os.pread(fd, 32, 0).decode(errors="replace").strip()
        self.taken_over = previous if previous and previous != str(os.getpid()) else None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)  # empty: nobody holds it
            os.close(self._fd)  # drops the flock
            self._fd = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
