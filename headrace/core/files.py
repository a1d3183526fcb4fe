"""Files a run or a service keeps: append-only JSONL logs that survive kill -9, files replaced whole,
and both opened without following a symbolic link.

An append-only log (``AppendLog``) holds whole lines only. kill -9 (or a crash, or a full disk) can
leave its last line without its newline: a *torn* line, whose record was never acknowledged (a
record counts once its whole line is written, and fsynced where the log asks for it). Reading skips
it; opening the log to append cuts it off first, so the next record starts on a line of its own
instead of being glued onto the torn one and lost with it.

Nothing in a run directory is opened through a symbolic link: a link put in place of ``.lock`` or a
log would have the run write into (or empty) whatever file it points to. ``os.O_NOFOLLOW`` makes
such an open fail, and it is refused as ``LinkRefused`` (a ``ConfigError``: the directory needs fixing).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from headrace.core import logs
from headrace.core.nofollow import LinkRefused, cut_after_last_line, open_fd, open_no_follow, refuse_links

log = logs.get_logger()
__all__ = ["AppendLog", "LinkRefused", "atomic_write", "cut_torn_line", "open_fd", "open_no_follow", "refuse_links"]


def atomic_write(path: Path, text: str) -> None:
    """Replace ``path`` whole: a temp file, fsynced, renamed over it (a crash leaves the old or the new)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open_no_follow(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # replaces a link at ``path`` itself, never what it points to
    except BaseException:
        if not tmp.is_symlink():
            tmp.unlink(missing_ok=True)  # a full disk leaves no half-written temp file behind
        raise


def whole_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(number from 1, line without its newline) for each whole line of ``path``; a torn last line
    (no newline) is not one. Streamed: the file can be large."""
    with open_no_follow(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if line.endswith(b"\n"):
                yield number, line[:-1]


class AppendLog:
    """An append-only JSONL file: ``read`` its records, ``append`` one line each, whole or not at all.

    ``durable``: each append is fsynced before it returns (for a line something else waits on, such
    as a version chain's). Otherwise it reaches the kernel, so kill -9 cannot lose it."""

    def __init__(self, path: Path, *, durable: bool = False):
        self.path = path
        self.durable = durable
        self._file: Any = None  # raw (unbuffered) append handle, opened by open() or the first append
        self._size = 0

    def read(self, on_bad_line: Callable[[int, str], None] | None = None) -> Iterator[Any]:
        """The records of the whole lines. A line that is not JSON goes to ``on_bad_line(number,
        text)`` (by default: a warning, and skipped), unless it is a torn line with a whole record
        after it (what versions before this one wrote after a torn line): then that record is kept."""
        if not self.path.exists():
            return
        for number, raw in whole_lines(self.path):
            if not raw.strip():
                continue
            text = raw.decode(errors="replace")
            try:
                yield json.loads(text)
            except ValueError:
                salvaged = _record_after_torn_line(text)
                if salvaged is not None:
                    log.warning("jsonl_torn_line_joined", file=str(self.path), line=number)
                    yield salvaged
                elif on_bad_line is not None:
                    on_bad_line(number, text)
                else:
                    log.warning("jsonl_skipped_line", file=str(self.path), line=number)

    def open(self) -> None:
        """Open to append (creating the file), cutting a torn last line first."""
        if self._file is not None:
            return
        f = open_no_follow(self.path, "ab+", buffering=0)
        try:
            cut_torn_line(f.fileno(), self.path)
            self._size = os.fstat(f.fileno()).st_size
        except BaseException:
            f.close()
            raise
        self._file = f

    def append(self, record: Any) -> None:
        self.append_line(json.dumps(record))

    def append_line(self, text: str) -> None:
        """One line (``text`` holds no newline). A write cut short (a full disk) is undone, so the
        file never ends in a partial line that this process would then write after."""
        self.open()
        data = (text + "\n").encode()
        try:
            view = memoryview(data)
            while view:
                view = view[self._file.write(view) :]
            if self.durable:
                os.fsync(self._file.fileno())
        except OSError:
            with contextlib.suppress(OSError):
                self._file.truncate(self._size)
            raise
        self._size += len(data)

    def sync(self) -> None:
        """Everything appended so far on the disk (for a record that must never outlive them)."""
        if self._file is not None:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


def cut_torn_line(fd: int, path: Path) -> int:
    """Cut a torn last line of the file open as ``fd`` (``nofollow.cut_after_last_line``), saying so."""
    if cut := cut_after_last_line(fd):
        log.warning("jsonl_torn_line_cut", file=str(path), bytes=cut)
    return cut


def _record_after_torn_line(text: str) -> Any:
    """The whole JSON object that ends ``text`` after a torn prefix, or None."""
    start = text.find("{", 1)
    while start > 0:
        try:
            record = json.loads(text[start:])
        except ValueError:
            start = text.find("{", start + 1)
            continue
        return record if isinstance(record, dict) else None
    return None
