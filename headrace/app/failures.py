"""How a failed command is told: its exit status and one paragraph (what failed, why, where it
was raised, what the run directory keeps and how to go on), never a traceback from deep inside.
Status 2 for a wrong name, option or path; 1 for a run that started and failed; 130 for SIGINT."""

from __future__ import annotations

import errno
import os
import select
import sys
import sysconfig
import traceback
from pathlib import Path

from headrace.core.advantages import NonFiniteError
from headrace.core.episode import EnvContractError, PromptTooLongError
from headrace.core.errors import BackendFailure, ConfigError, root_cause
from headrace.core.rollout import TooManyDroppedGroups
from headrace.plugins import registry
from headrace.run.metrics import NoUpdateApplied
from headrace.run.rundir import RunDir
from headrace.run.rundir_errors import DiskFullError

# Errors of a run that started and failed for a reason its message explains: exit status 1.
RUN_FAILED: tuple[type[BaseException], ...] = (
    BackendFailure,
    EnvContractError,
    TooManyDroppedGroups,
    PromptTooLongError,
    NoUpdateApplied,
    DiskFullError,
    NonFiniteError,
)
# A wrong name, option or run directory: exit status 2 (RunDirError is a ConfigError).
USAGE_ERRORS: tuple[type[BaseException], ...] = (ConfigError, registry.UnknownNameError)
# OSErrors that say the machine ran out of something, not that a path given was wrong: exit 1.
RESOURCE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG, errno.ENOMEM, errno.EMFILE, errno.ENFILE}
OS_HINTS = {
    errno.ENOSPC: ": the disk is full",
    errno.EDQUOT: ": the disk quota is used up",
    errno.EROFS: ": pick a writable place",
    errno.ENOTDIR: ": a file is in the way of a directory",
    errno.EEXIST: ": a file is in the way of a directory",
    errno.EISDIR: ": a directory where a file is expected",
    errno.ENAMETOOLONG: ": pick a shorter path",
    errno.EACCES: ": no permission",
    errno.EPERM: ": no permission",
}


def explain(raised: BaseException, command: str, run_dir: str | None, debug: bool) -> tuple[int, str]:
    """Exit status and one paragraph: what failed, why, where the run directory stands."""
    error = root_cause(raised) if isinstance(raised, BaseExceptionGroup) else raised
    failed = "run failed" if command == "run" else f"{command} failed"
    more = "" if debug else " Rerun with --debug for the traceback."
    if isinstance(error, KeyboardInterrupt):
        return 130, "headrace: interrupted"
    if isinstance(error, BrokenPipeError) and _stdout_gone():
        return 1, ""  # the reader left (`headrace envs | head`): nothing to say, nowhere to say it
    if isinstance(error, USAGE_ERRORS):
        return 2, f"headrace: error: {error}"
    if isinstance(error, RUN_FAILED):
        said = "--resume" in str(error)  # the message already says how to go on
        return 1, f"headrace: {failed}: {_sentence(error)} {'' if said else _run_dir_state(run_dir)}"
    if isinstance(error, OSError):
        path = " -> ".join(f"'{name}'" for name in (error.filename, error.filename2) if name is not None)
        code = errno.errorcode.get(error.errno or 0, "")
        reason = f"{error.strerror or error} ({code}{OS_HINTS.get(error.errno or 0, '')})" if code else str(error)
        where = f"{path}: {reason}" if path else reason
        origin = f"(raised in {_origin(error)})"
        if error.errno in RESOURCE_ERRNOS or not path:
            return 1, f"headrace: {failed}: {where} {origin}. {_run_dir_state(run_dir)}{more}"
        return 2, (
            f"headrace: error: cannot use {where} {origin}. "
            f"Fix the path (--run-dir, --config, the env's options) and try again.{more}"
        )
    return 1, (
        f"headrace: {failed} with an unexpected error in {_origin(error)}: {type(error).__name__}: "
        f"{_sentence(error)} {_run_dir_state(run_dir)}{more}"
    )


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports an error on it)."""
    try:
        fd = sys.stdout.fileno()
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        if not any(events & select.POLLERR for _, events in poll.poll(0)):
            return False
        # stdout to /dev/null, so the interpreter's own flush at exit stays quiet too
        os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    except (OSError, ValueError, AttributeError):  # no real stdout (captured, closed, no poll)
        return False
    return True


def _sentence(error: BaseException) -> str:
    text = str(error).strip() or "(no message)"
    return text if text[-1] in ".!?" else f"{text}."


def _origin(error: BaseException) -> str:
    """The function and line that raised: the innermost frame in headrace or the user's code
    (an env, a script), not in the standard library or a third-party package it called."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "headrace"
    libraries = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}

    def ours(filename: str) -> bool:
        return "/headrace/" in filename or not any(filename.startswith(lib) for lib in libraries)

    frame = next((f for f in reversed(frames) if ours(f.filename)), frames[-1])
    path = Path(frame.filename)
    if path.is_relative_to(Path.cwd()):
        path = path.relative_to(Path.cwd())
    return f"{frame.name} ({path}:{frame.lineno})"


def _run_dir_state(run_dir: str | None) -> str:
    """One sentence: what the run directory keeps and how to go on from it."""
    if run_dir is None:
        return ""
    path = Path(run_dir)
    try:
        if not (path / "config.json").is_file():
            return f"Nothing was written to {path}."
    except OSError:  # the path itself is unusable (name too long, a file in the way)
        return ""
    try:
        rows = 0
        if (path / "metrics.jsonl").is_file():
            with open(path / "metrics.jsonl", "rb") as f:
                rows = sum(1 for _ in f)  # streamed: the file can be large
        latest = RunDir(path).latest_checkpoint()
    except Exception:  # noqa: BLE001 - a broken run directory must not hide the error being reported
        return f"See {path} for what was saved."
    if latest is not None:
        return (
            f"{path} keeps metrics for {rows} steps and a checkpoint after {latest['step']} steps; "
            f"continue with `headrace run --resume --run-dir {path}`."
        )
    if rows:
        return f"{path} keeps metrics for {rows} steps but no checkpoint, so --resume would start over."
    return f"No step was trained; {path} holds only the run's config (start again with --overwrite)."
