"""Opening a run directory's files without following a symbolic link, and where a file's last
whole line ends: the descriptor-level part of ``files.py`` that the run log (``logs.py``) needs
too, kept apart so that ``files.py`` may log through ``logs.py``."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import IO, Any

from headrace.core.errors import ConfigError

NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_TAIL_CHUNK = 1 << 16


class LinkRefused(ConfigError):
    """A file headrace keeps is a symbolic link: it is not written (or read) through."""

    def __init__(self, path: Path | str):
        try:
            target = f" (to '{os.readlink(path)}')"
        except OSError:
            target = ""
        super().__init__(
            f"'{path}' is a symbolic link{target}, and headrace does not write through a link in a run directory: "
            "it would change or empty the file the link points to. Replace the link with the file itself (or "
            "remove it), or pass another --run-dir."
        )


def open_fd(path: Path | str, flags: int, mode: int = 0o644) -> int:
    """``os.open`` that refuses a symbolic link at ``path`` itself (``LinkRefused``)."""
    try:
        return os.open(path, flags | NO_FOLLOW, mode)
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(path):
            raise LinkRefused(path) from None
        raise


def open_no_follow(path: Path, mode: str = "r", **kwargs: Any) -> IO[Any]:
    """``open(path, mode)``, refusing a symbolic link at ``path`` itself (``LinkRefused``)."""
    return open(path, mode, opener=open_fd, **kwargs)  # noqa: SIM115 - the caller closes it


def refuse_links(*paths: Path) -> None:
    """Refuse now, before any work, a file that would be refused when it is first written."""
    for path in paths:
        if path.is_symlink():
            raise LinkRefused(path)


def end_of_last_line(fd: int, size: int) -> int:
    """The offset just after the file's last newline (0 if it has none)."""
    end = size
    while end > 0:
        start = max(0, end - _TAIL_CHUNK)
        chunk = os.pread(fd, end - start, start)
        cut = chunk.rfind(b"\n")
        if cut >= 0:
            return start + cut + 1
        end = start
    return 0


def cut_after_last_line(fd: int) -> int:
    """Cut the bytes after the last newline of the file open (for reading too) as ``fd``, fsynced:
    a line cut short, which the next line written must not be glued onto. Returns how many."""
    size = os.fstat(fd).st_size
    whole = end_of_last_line(fd, size)
    if whole < size:
        os.ftruncate(fd, whole)
        os.fsync(fd)
    return size - whole
