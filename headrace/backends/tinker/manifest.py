"""``tinker_manifest.json`` in the run directory: references to what lives on the service.

It holds paths, never weights: every ``save_state`` path (the run's checkpoints and the
backend's own commits), every sampler-weights path, and every recovery (what failed, which
state it restarted from, how many calls it re-ran). Each update rewrites the file atomically
(temp file + fsync + ``os.replace``), so a crash leaves the old manifest or the new one.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from headrace.core.files import atomic_write

FILENAME = "tinker_manifest.json"
_LOCK = threading.RLock()


class Manifest:
    def __init__(self, path: Path | None, header: dict[str, Any]):
        self.path = path
        self.data: dict[str, Any] = {
            "version": 1, **header, "states": [], "samplers": [], "recoveries": [], "adapters": {},
        }  # fmt: skip
        if path is not None and path.exists():
            old = json.loads(path.read_text())
            for key in ("states", "samplers", "recoveries"):
                self.data[key] = old.get(key, [])
            self.data["adapters"] = old.get("adapters", {})

    @classmethod
    def in_run_dir(cls, run_dir: str | None, header: dict[str, Any]) -> Manifest:
        if run_dir is None:
            return cls(None, header)
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        return cls(Path(run_dir) / FILENAME, header)

    def _write(self) -> None:
        if self.path is None:
            return
        with _LOCK:  # adapters are recorded from the threads that download them
            atomic_write(self.path, json.dumps(self.data, indent=1))

    def add_state(self, name: str, path: str, step: int, kind: str) -> None:
        self.data["states"].append({"name": name, "path": path, "step": step, "kind": kind, "t": time.time()})
        self._write()

    def add_sampler(self, name: str, path: str, step: int) -> None:
        self.data["samplers"].append({"name": name, "path": path, "step": step, "t": time.time()})
        self._write()

    def add_adapter(self, version: int, tinker_path: str, directory: str, sha256: dict[str, str]) -> None:
        """A version's sampler weights downloaded as a local adapter (``adapters.py``)."""
        with _LOCK:
            self.data["adapters"][str(version)] = {
                "tinker_path": tinker_path, "directory": directory, "sha256": sha256, "t": time.time(),
            }  # fmt: skip
        self._write()

    def drop_adapter(self, version: int) -> None:
        with _LOCK:
            dropped = self.data["adapters"].pop(str(version), None)
        if dropped is not None:
            self._write()

    def add_recovery(self, record: dict[str, Any]) -> None:
        self.data["recoveries"].append({**record, "t": time.time()})
        self._write()

    def latest_state(self) -> dict[str, Any] | None:
        return self.data["states"][-1] if self.data["states"] else None


def resolve_state_path(path: str) -> tuple[str, int | None]:
    """A ``tinker://`` path as is; a manifest file or a run directory → its latest state."""
    if path.startswith("tinker://"):
        return path, None
    p = Path(path)
    if p.is_dir():
        p = p / FILENAME
    if not p.is_file():
        raise ValueError(f"'{path}' is neither a tinker:// path nor a run directory or manifest with saved states")
    states = json.loads(p.read_text()).get("states") or []
    if not states:
        raise ValueError(f"the manifest '{p}' records no saved state to resume from")
    return states[-1]["path"], states[-1]["step"]
