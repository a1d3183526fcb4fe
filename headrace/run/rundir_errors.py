"""What can go wrong with a run directory on disk, said as one paragraph: a directory that cannot
be used (``RunDirError``, with the fix) and a disk that filled up during the run (``DiskFullError``)."""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

from headrace.core.errors import ConfigError, RunError

DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


class RunDirError(ConfigError):
    """The run directory can't be used as asked; the message says what to pass instead."""


class DiskFullError(RunError, OSError):
    """The disk filled up during the run (ENOSPC); the message says what was saved and how to resume."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return str(self.strerror)


def is_disk_full(error: BaseException, path: Path) -> bool:
    """A write failed for want of space: ENOSPC in the chain, or said in words (safetensors), or
    a RuntimeError (torch.save says "unexpected pos") while the run's disk has no room left."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in DISK_FULL or "No space left on device" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return isinstance(error, (OSError, RuntimeError)) and shutil.disk_usage(path).free < (1 << 16)
    except OSError:
        return False


@contextlib.contextmanager
def explained(path: Path) -> Iterator[None]:
    """OSErrors while setting up the directory, as one paragraph that names the fix."""
    try:
        yield
    except OSError as e:
        where = "it" if e.filename in (None, str(path)) else f"'{e.filename}'"
        reasons = {
            errno.EROFS: ("is on a read-only file system", "Pass --run-dir with a writable directory."),
            errno.EACCES: ("is not writable (permission denied)", "Pass --run-dir with a directory you can write."),
            errno.EPERM: ("is not writable (not permitted)", "Pass --run-dir with a directory you can write."),
            errno.EEXIST: ("is a file, not a directory", "Pass --run-dir with a directory path."),
            errno.ENOTDIR: ("has a file where a directory should be", "Pass --run-dir with a directory path."),
            errno.EISDIR: ("is a directory where a file should be", "Remove it or pass --overwrite to start over."),
            errno.ENAMETOOLONG: ("has a name too long for the file system", "Pass a shorter --run-dir."),
            errno.ENOSPC: ("is on a full disk", "Free some space or pass --run-dir on another disk."),
            errno.EDQUOT: ("is over its disk quota", "Free some space or pass --run-dir on another disk."),
        }
        what, fix = reasons.get(e.errno or 0, (f"cannot be used ({e.strerror or e})", "Pass another --run-dir."))
        raise RunDirError(f"run directory '{path}' cannot be used: {where} {what}. {fix}") from None
