"""The run directory: ``config.json``, ``metrics.jsonl``, ``log.jsonl``, and checkpoints with an
append-only index (``checkpoints.jsonl``) and an atomically replaced ``latest`` pointer."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

from headrace.engine.config import ConfigError, RunConfig

# options that may change between a run and its resume without making it a different run
_RESUMABLE = {"resume", "overwrite", "progress", "run_dir", "steps"}


class RunDirError(ConfigError):
    """The run directory can't be used as asked; the message says what to pass instead."""


def default_run_dir(config: RunConfig) -> Path:
    return Path("runs") / f"{config.env}-{config.scheduler}-{config.backend}-{time.strftime('%Y%m%d-%H%M%S')}"


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _clean(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


class RunDir:
    def __init__(self, path: Path):
        self.path = path
        self.checkpoints = path / "checkpoints"

    @classmethod
    def prepare(cls, config: RunConfig) -> RunDir:
        path = Path(config.run_dir) if config.run_dir else default_run_dir(config)
        run = cls(path)
        saved = path / "config.json"
        if saved.exists() and not config.overwrite:
            if not config.resume:
                raise RunDirError(
                    f"run directory '{path}' already holds a run. Pass --resume to continue it, "
                    "--overwrite to replace it, or --run-dir to pick another directory."
                )
            run._check_same_run(json.loads(saved.read_text()), config)
        elif config.overwrite and path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True, exist_ok=True)
        run.checkpoints.mkdir(exist_ok=True)
        atomic_write(saved, json.dumps(config.model_dump(), indent=2))
        return run

    def _check_same_run(self, saved: dict[str, Any], config: RunConfig) -> None:
        current = config.model_dump()
        changed = sorted(k for k in current if k not in _RESUMABLE and saved.get(k) != current[k])
        if changed:
            raise RunDirError(
                f"run directory '{self.path}' holds a different run (options differ: {', '.join(changed)}). "
                "Resume with the same options, or pass --overwrite to start over."
            )

    # -- metrics ---------------------------------------------------------------------------
    def append_metrics(self, row: dict[str, Any]) -> None:
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        p = self.path / "metrics.jsonl"
        if not p.exists():
            return []
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]

    def truncate_metrics(self, before_step: int) -> None:
        """On resume, forget steps after the checkpoint: they are trained again, not repeated."""
        rows = [r for r in self.read_metrics() if r["step"] < before_step]
        atomic_write(self.path / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))

    # -- checkpoints -----------------------------------------------------------------------
    def record_checkpoint(self, step: int, path: str) -> None:
        entry = {"step": step, "path": path, "time": time.time()}
        with open(self.checkpoints / "index.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())
        atomic_write(self.checkpoints / "latest", json.dumps(entry))

    def last_checkpoint_step(self) -> int | None:
        latest = self.latest_checkpoint()
        return latest["step"] if latest else None

    def latest_checkpoint(self) -> dict[str, Any] | None:
        p = self.checkpoints / "latest"
        if not p.exists():
            return None
        try:
            entry = json.loads(p.read_text())
            return {"step": int(entry["step"]), "path": str(entry["path"])}
        except (ValueError, KeyError, TypeError):
            raise RunDirError(
                f"checkpoint pointer '{p}' is corrupt. Point it at a line of {self.checkpoints / 'index.jsonl'} "
                "or pass --overwrite to start over."
            ) from None
