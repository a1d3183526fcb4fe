"""The run directory: ``config.json``, ``metrics.jsonl``, ``log.jsonl``, a lock, and checkpoints
with an append-only index (``checkpoints/index.jsonl``) and an atomically replaced ``latest``.

Nothing on disk is lost silently. A run holds ``.lock`` (naming its PID) while it runs;
``--overwrite`` replaces only a directory that is recognisably a run; metrics rows are flushed
one by one and fsynced with each checkpoint; on resume the rows after the last checkpoint (steps
trained again) and a torn last line (a crash or a full disk) are cut off in place.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from headrace.core.errors import ConfigError
from headrace.core.files import AppendLog, atomic_write, open_no_follow, refuse_links
from headrace.plugins.registry import UnknownNameError, reference_label
from headrace.run.config import RunConfig, validate
from headrace.run.rundir_errors import RunDirError, explained
from headrace.run.runlock import LOCK, RunLock

# options that may change between a run and its resume without making it a different run
_RESUMABLE = {"resume", "overwrite", "progress", "run_dir", "steps", "checkpoint", "save_every", "log"}
# keys every headrace config.json has: what makes a directory recognisably a run (--overwrite)
_RUN_KEYS = {"env", "scheduler", "backend", "steps", "batch_size", "group_size"}


def default_run_dir(config: RunConfig) -> Path:
    env = reference_label(config.env)  # `--env dir/my_env.py:NAME` names runs/my_env-NAME-...
    return Path("runs") / f"{env}-{config.scheduler}-{config.backend}-{time.strftime('%Y%m%d-%H%M%S')}"


def _clean(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


class RunDir:
    def __init__(self, path: Path):
        self.path = path
        self.checkpoints = path / "checkpoints"
        self.lock = RunLock(path / LOCK)
        self._metrics = AppendLog(path / "metrics.jsonl")  # opened on the first row
        self._index = AppendLog(self.checkpoints / "index.jsonl", durable=True)
        self.last_row_step: int | None = None  # the newest step with a row on disk
        self._kept: list[dict[str, Any]] | None = None  # checkpoints on record, read from the index once
        self.began = False  # set-up done: the run's own work begins (until then a refusal leaves no trace)
        self._new = False  # a new run (not --resume), in a directory ``_made`` by it or not
        self._made = False
        self._before: set[str] = set()  # the names in the directory before this run opened it

    # -- opening ---------------------------------------------------------------------------
    @classmethod
    @contextlib.contextmanager
    def open(cls, config: RunConfig) -> Iterator[RunDir]:
        """Lock, check and prepare the directory; the lock is released when the block exits."""
        path = Path(config.run_dir) if config.run_dir else default_run_dir(config)
        run = cls(path)
        with explained(path):
            run._prepare(config)
        undone = False
        try:
            yield run
        except (ConfigError, UnknownNameError):
            # refused at set-up (an env's options, a backend's check): the corrected rerun must not
            # find "a run" here, so what opening the directory wrote goes, while the lock is held
            with contextlib.suppress(OSError):  # a directory that cannot be tidied keeps the refusal's own words
                undone = run._new and not run.began and run._undo_opening()
            raise
        finally:
            run.close()
            if undone and run._made:
                with contextlib.suppress(OSError):
                    path.rmdir()

    def _prepare(self, config: RunConfig) -> None:
        path, saved = self.path, self.path / "config.json"
        if config.resume and config.overwrite:
            raise RunDirError("--resume continues a run and --overwrite replaces it: pass one of them, not both.")
        if config.resume and not saved.is_file():
            raise RunDirError(
                f"nothing to resume: run directory '{path}' "
                f"{'holds no headrace run (no config.json)' if path.exists() else 'does not exist'}. "
                "Check the --run-dir path, or drop --resume to start a new run."
            )
        if config.overwrite:  # checked before anything is written there
            _refuse_to_replace(path)
        self._new, self._made = not config.resume, not path.exists()
        self._before = set() if self._made or not path.is_dir() else {p.name for p in path.iterdir()}
        path.mkdir(parents=True, exist_ok=True)
        self.lock.acquire()
        try:
            if saved.exists():
                if config.overwrite:
                    self._clear()
                    self._before = set()  # what was there is gone: a refusal now leaves the directory empty
                elif config.resume:
                    self._check_same_run(_load_config(saved), config)
                else:
                    raise RunDirError(
                        f"run directory '{path}' already holds a run. Pass --resume to continue it, "
                        "--overwrite to replace it, or --run-dir to pick another directory."
                    )
            elif (path / "metrics.jsonl").exists():
                raise RunDirError(
                    f"'{path}' holds a metrics.jsonl but no config.json: it is not a run this version "
                    "can continue. Pass another --run-dir."
                )
            self.checkpoints.mkdir(exist_ok=True)
            # the files a run appends to, refused now rather than at the step that first writes one
            refuse_links(path / "metrics.jsonl", path / "log.jsonl", self._index.path)
            # temp files of a run that died mid-write (kill -9, a second Ctrl-C, a full disk)
            for tmp in [*self.checkpoints.glob("*.tmp"), *path.glob(".*.tmp")]:
                shutil.rmtree(tmp) if tmp.is_dir() and not tmp.is_symlink() else tmp.unlink()
            atomic_write(saved, json.dumps(config.model_dump(), indent=2))
        except BaseException:
            self.lock.release()
            raise

    def _undo_opening(self) -> bool:
        """Remove what opening wrote (``config.json``, ``log.jsonl``, the lock, the empty ``checkpoints/``),
        if nothing else appeared since. True when it was all."""
        ours = {"config.json", "log.jsonl", LOCK}
        new = [p for p in self.path.iterdir() if p.name not in self._before]
        if any(p.name not in ours and not _empty(p) for p in new):
            return False  # something else wrote here (a tracker, a backend): kept as it is
        for p in new:  # the lock too, while held: nobody can be waiting on it (the lock is never waited for)
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        return True

    def _clear(self) -> None:
        """--overwrite: the directory is a run (checked before); empty it, keeping our lock."""
        for child in self.path.iterdir():
            if child.name == LOCK:
                continue
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()

    def _check_same_run(self, saved: dict[str, Any], config: RunConfig) -> None:
        try:  # as this version reads it: an option added since takes its default, a renamed one its new name
            saved = validate(saved).model_dump()
        except ConfigError:
            pass  # compared as saved: the differences are listed
        before = _flat(saved)
        now = _flat(config.model_dump())
        changed = sorted(
            k
            for k in before.keys() | now.keys()
            if k.split(".")[0] not in _RESUMABLE and before.get(k, "<unset>") != now.get(k, "<unset>")
        )
        if changed:
            listed = "; ".join(
                f"{k}: {before.get(k, '<unset>')!r} in the run, {now.get(k, '<unset>')!r} now" for k in changed
            )
            raise RunDirError(
                f"run directory '{self.path}' holds a different run (options differ: {listed}). Resume with just "
                "--resume --run-dir (the run's own options apply), or pass --overwrite to start over."
            )

    @staticmethod
    def saved_options(path: Path) -> dict[str, Any] | None:
        """The options a run in ``path`` was started with (for ``--resume --run-dir`` alone)."""
        saved = path / "config.json"
        if not saved.is_file():
            return None
        with explained(path):
            options = _load_config(saved)
        return {k: v for k, v in options.items() if k not in {"resume", "overwrite", "progress", "run_dir"}}

    def close(self) -> None:
        self._metrics.close()
        self._index.close()
        self.lock.release()

    # -- metrics ---------------------------------------------------------------------------
    def append_metrics(self, row: dict[str, Any]) -> None:
        """One row, written through (no buffer); a write cut short by a full disk is undone so
        the file never ends in a partial line."""
        self._metrics.append_line(json.dumps({k: _clean(v) for k, v in row.items()}))
        self.last_row_step = row["step"]

    def cut_metrics(self, before_step: int) -> tuple[int, bool, int]:
        """On resume: cut ``metrics.jsonl`` back to the rows of the steps before ``before_step``
        (those after it are trained again), in place, streaming (no copy: works on a full disk,
        memory stays flat). A torn last line is cut too. Returns (rows removed, torn, rows kept)."""
        p = self.path / "metrics.jsonl"
        if not p.exists():
            return 0, False, 0
        kept = removed = 0
        end: int | None = None
        torn = False
        offset = 0
        with open_no_follow(p, "rb+") as f:
            for number, line in enumerate(f, 1):
                complete = line.endswith(b"\n")
                if end is not None:  # cut already: count what goes
                    removed += complete
                    torn |= not complete
                    continue
                step = _row_step(line)
                if step is None:
                    if complete and f.read(1):
                        raise RunDirError(
                            f"line {number} of {p} is not a metrics row, and lines follow it: the file was "
                            "changed by something else. Fix or remove that line, or pass --overwrite to start over."
                        )
                    torn, end = True, offset  # the last line: cut off mid-write
                elif step >= before_step:
                    removed, end = 1, offset
                else:
                    kept += 1
                    offset += len(line)
                    self.last_row_step = step
            if end is not None:
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
        return removed, torn, kept

    # -- checkpoints -----------------------------------------------------------------------
    def record_checkpoint(self, step: int, path: str) -> None:
        # the rows before the checkpoint reach the disk first: a checkpoint never outlives them
        self._metrics.sync()
        entry = {"step": step, "path": path, "time": time.time()}
        kept = self.kept_checkpoints()
        self._index.append(entry)
        atomic_write(self.checkpoints / "latest", json.dumps(entry))
        kept[:] = [e for e in kept if e["path"] != path] + [entry]

    def kept_checkpoints(self) -> list[dict[str, Any]]:
        """Checkpoints recorded and not deleted since, oldest first (a torn line is skipped)."""
        if self._kept is not None:
            return self._kept
        live: dict[str, dict[str, Any]] = {}
        for entry in self._index.read():
            if entry.get("deleted"):
                live.pop(entry["path"], None)
            else:
                live[entry["path"]] = entry
        self._kept = sorted(live.values(), key=lambda e: e["step"])
        return self._kept

    def prunable(self, keep_last: int, keep_every: int) -> list[dict[str, Any]]:
        """Checkpoints beyond the newest ``keep_last`` (0: keep all; the newest, which ``latest``
        names, always stays), except those whose step is a multiple of ``keep_every``."""
        if keep_last <= 0:
            return []
        old = self.kept_checkpoints()[:-keep_last]
        return [e for e in old if not (keep_every and e["step"] % keep_every == 0)]

    def forget_checkpoint(self, entry: dict[str, Any]) -> None:
        """A deleted checkpoint, recorded in the index so a resumed run does not look for it."""
        self._index.append({"step": entry["step"], "path": entry["path"], "deleted": time.time()})
        self.kept_checkpoints().remove(entry)

    def last_checkpoint_step(self) -> int | None:
        latest = self.latest_checkpoint()
        return latest["step"] if latest else None

    def latest_checkpoint(self) -> dict[str, Any] | None:
        p = self.checkpoints / "latest"
        if not p.exists():
            return None
        try:
            entry = json.loads(p.read_text())
            step = entry["step"]
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise ValueError(step)
            return {"step": step, "path": str(entry["path"])}
        except (OSError, ValueError, KeyError, TypeError):
            raise RunDirError(
                f'checkpoint pointer \'{p}\' is corrupt (it must be a file holding {{"step": N >= 0, "path": ...}}). '
                f"Replace it with a line of {self.checkpoints / 'index.jsonl'}, or pass --overwrite to start over."
            ) from None

    def disk_full_message(self, error: BaseException) -> str:
        rows = "no metrics rows" if self.last_row_step is None else f"metrics rows up to step {self.last_row_step}"
        try:
            ckpt = self.last_checkpoint_step()
        except RunDirError:
            ckpt = None
        saved = f"the checkpoint after step {ckpt}" if ckpt is not None else "no checkpoint (--resume starts over)"
        return (
            f"the disk of run directory '{self.path}' is full ({error}). Saved: {rows} and {saved}; steps after the "
            "checkpoint are trained again. Free some space, then continue with "
            f"`headrace run --resume --run-dir {self.path}`."
        )


def _empty(path: Path) -> bool:
    """A file of no bytes, or a directory of nothing but such (not a link)."""
    if path.is_symlink():
        return False
    if path.is_dir():
        return all(_empty(p) for p in path.iterdir())
    return path.stat().st_size == 0


def _row_step(line: bytes) -> int | None:
    """The step of a complete metrics row, or None for a torn or foreign line."""
    if not line.endswith(b"\n"):
        return None
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None


def _load_config(saved: Path) -> dict[str, Any]:
    try:
        options = json.loads(saved.read_text())
    except ValueError:
        options = None
    if not isinstance(options, dict):
        raise RunDirError(
            f"'{saved}' is not a headrace config (not a JSON object). Fix it, or pass --overwrite to start over."
        )
    return options


def _is_run_config(saved: Path) -> bool:
    try:
        options = json.loads(saved.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(options, dict) and _RUN_KEYS <= options.keys()


def _refuse_to_replace(path: Path) -> None:
    """--overwrite replaces only a directory that is recognisably a run (a headrace config.json;
    metrics.jsonl optional, a run killed before its first step has none) or empty, and never the
    working directory, one of its ancestors, or the home directory."""
    target = path.resolve()
    cwd, home = Path.cwd().resolve(), Path.home().resolve()
    if target == home or target == cwd or target in cwd.parents:
        what = (
            "the home directory"
            if target == home
            else "the current directory"
            if target == cwd
            else "an ancestor of the current directory"
        )
        raise RunDirError(f"--overwrite refused: '{path}' is {what}. Pass --run-dir with the run's own directory.")
    if not path.is_dir():
        return
    if (path / "config.json").exists():
        if not _is_run_config(path / "config.json"):
            raise RunDirError(
                f"--overwrite refused: '{path / 'config.json'}' is not a headrace run's config, so '{path}' may hold "
                "files that are not a run's. Remove it yourself, or pass another --run-dir."
            )
    elif any(p.name != LOCK for p in path.iterdir()):
        raise RunDirError(
            f"--overwrite refused: '{path}' is not a headrace run directory (it has no config.json) and is not "
            "empty, so replacing it could delete files that are not a run's. Remove it yourself, or pass another "
            "--run-dir."
        )
