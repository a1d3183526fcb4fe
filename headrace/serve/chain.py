"""``D/versions.jsonl``: every version the service made, and what became of it, one line each.

A line is appended (and fsynced) only after what it names is durable: a published version's
checkpoint is saved before its line, and the server switches to it after. So kill -9 at any
moment loses no published version, and ``--resume`` serves the last incumbent the file names.

Outcomes: ``initial`` (version 0, the weights the service started from), ``published`` (a
candidate that passed its gate and became the incumbent), ``rejected`` (one the gate refused),
``discarded`` (one whose parent stopped being the incumbent while it trained: a rollback), and
``rollback`` (an earlier version re-published). The incumbent is the version of the last line that
changed it (``initial``, ``published``, ``rollback``); such a line starts an *epoch*, and a
completion's staleness is the number of epochs since the one that served it.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headrace.core.errors import ConfigError
from headrace.core.files import AppendLog

FILENAME = "versions.jsonl"
CHANGES_INCUMBENT = ("initial", "published", "rollback")
SCENARIO_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # serve.per_scenario: a scenario names a directory


@dataclass(frozen=True)
class Incumbent:
    version: int
    checkpoint: str
    epoch: int  # the line (its index) that made it the incumbent


class VersionChain:
    def __init__(self, run_dir: Path):
        self.path = run_dir / FILENAME
        self._log = AppendLog(self.path, durable=True)
        self.entries: list[dict[str, Any]] = _read(self._log)

    def append(self, outcome: str, version: int, **fields: Any) -> dict[str, Any]:
        entry = {"line": len(self.entries), "version": version, "outcome": outcome, "time": time.time(), **fields}
        self._log.append(entry)  # fsynced; a torn last line left by kill -9 is cut off first
        self.entries.append(entry)
        return entry

    def open(self) -> None:
        """Open to append now (a torn last line cut, a link refused), not at the first append."""
        self._log.open()

    def close(self) -> None:
        self._log.close()

    def incumbent(self) -> Incumbent | None:
        for entry in reversed(self.entries):
            if entry["outcome"] in CHANGES_INCUMBENT:
                return Incumbent(entry["version"], entry["checkpoint"], entry["line"])
        return None

    def next_version(self) -> int:
        return 1 + max((e["version"] for e in self.entries), default=-1)

    def checkpoint_of(self, version: int) -> str | None:
        """Where a version that once served is saved (None: never published)."""
        for entry in self.entries:
            if entry["version"] == version and entry["outcome"] in CHANGES_INCUMBENT:
                return entry["checkpoint"]
        return None

    def epochs_since(self, epoch: int) -> int:
        """How many times the incumbent changed after line ``epoch``."""
        return sum(1 for e in self.entries[epoch + 1 :] if e["outcome"] in CHANGES_INCUMBENT)

    def used_completions(self) -> set[str]:
        return {cid for e in self.entries for cid in e.get("completions", ())}

    def baselines(self) -> dict[str, float]:
        """The per-scenario reward baselines as the last candidate left them."""
        for entry in reversed(self.entries):
            if "baselines" in entry:
                return dict(entry["baselines"])
        return {}

    def rollback_to(self, version: int) -> dict[str, Any]:
        """Re-publish ``version`` (offline: ``headrace rollback``, with the server stopped)."""
        checkpoint = self.checkpoint_of(version)
        if checkpoint is None:
            raise ConfigError(self.cannot_roll_back(version))
        current = self.incumbent()
        return self.append("rollback", version, checkpoint=checkpoint, parent=current.version if current else None)

    def cannot_roll_back(self, version: int) -> str:
        served = sorted({e["version"] for e in self.entries if e["outcome"] in CHANGES_INCUMBENT})
        return (
            f"version {version} was never published in {self.path.parent}, so there is nothing to roll back to; "
            f"the versions that served are {', '.join(map(str, served)) or 'none'} (see {self.path})."
        )


def _read(log: AppendLog) -> list[dict[str, Any]]:
    """The chain's lines. A last line cut short by kill -9 mid-write is dropped (its version had
    not been switched to: the switch comes after the fsync)."""

    def damaged(number: int, text: str) -> None:
        raise ConfigError(
            f"{log.path}, line {number}, is not JSON: the version chain was edited or damaged. Restore it, or "
            "start the service over in another --run-dir."
        )

    entries = list(log.read(on_bad_line=damaged))
    for i, entry in enumerate(entries):
        entry["line"] = i
    return entries
