"""A full disk ends the run with one clear line (what was saved, how to resume), leaves no partial
metrics line and no temp file, and the resumed run trains every step once (issue 10, item 4):
ENOSPC injected into each file the run writes, and a real 2 MB tmpfs where the test runs as root."""

from __future__ import annotations

import builtins
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_argv, run_sim
from test_rundir_safety import tmpfs

from headrace.backends import sim
from headrace.core import files, logs, nofollow
from headrace.run import rundir
from headrace.run.rundir_errors import DiskFullError

pytestmark = pytest.mark.timeout(120)
OPTIONS = {"checkpoint.every": 3, "advantages.filter_constant": "false"}


class Disk:
    """Room left for one file (by name); every other write goes through."""

    def __init__(self, target: str, room: int):
        self.target, self.room, self.filled = target, room, False

    def take(self, name: str, size: int) -> int:
        if name != self.target:
            return size
        granted = min(size, self.room)
        self.room -= granted
        self.filled |= granted < size
        return granted


class FillingFile:
    """A file on that disk: a write that does not fit is written in part, then fails with ENOSPC."""

    def __init__(self, f, name: str, disk: Disk):
        self._f, self._name, self._disk = f, name, disk

    def write(self, data):
        granted = self._disk.take(self._name, len(data))
        if granted < len(data):
            self._f.write(data[:granted])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._name)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __iter__(self):
        return iter(self._f)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def fill(monkeypatch, disk: Disk) -> None:
    def opener(file, mode="r", *args, **kwargs):
        f = builtins.open(file, mode, *args, **kwargs)  # noqa: SIM115 - the caller closes it
        return FillingFile(f, Path(file).name, disk) if set(mode) & set("wa+") else f

    monkeypatch.setattr(rundir, "open", opener, raising=False)
    monkeypatch.setattr(files, "open", opener, raising=False)  # the append-only logs and atomic writes
    monkeypatch.setattr(logs, "open", opener, raising=False)
    monkeypatch.setattr(nofollow, "open", opener, raising=False)  # the run log opens through it
    save_state = sim.SimTraining.save_state

    async def saving(self, name):
        if disk.take("save_state", 1) < 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return await save_state(self, name)

    monkeypatch.setattr(sim.SimTraining, "save_state", saving)


def assert_clean(run_dir: Path) -> None:
    """No temp file and no partial line: the directory is as a resume expects it."""
    assert not [p for p in run_dir.rglob("*") if p.name.endswith(".tmp")]
    metrics = run_dir / "metrics.jsonl"
    text = metrics.read_text() if metrics.exists() else ""
    assert text == "" or text.endswith("\n"), "metrics.jsonl ends in a partial line"
    for line in text.splitlines():
        json.loads(line)


@pytest.mark.parametrize(
    ("target", "room"),
    [
        ("metrics.jsonl", 4000),
        ("index.jsonl", 100),
        (".latest.tmp", 100),
        ("save_state", 1),
        ("log.jsonl", 50),
        ("log.jsonl", 250),
    ],
)
async def test_disk_full_while_writing_anything_then_resume_trains_each_step_once(tmp_path, monkeypatch, target, room):
    disk = Disk(target, room)
    fill(monkeypatch, disk)
    with pytest.raises(DiskFullError) as failed:
        await run_sim(tmp_path, steps=12, set=OPTIONS)
    assert disk.filled
    run_dir = tmp_path / "run"
    message = str(failed.value)
    assert "is full" in message and f"--resume --run-dir {run_dir}" in message and "Saved:" in message
    assert_clean(run_dir)

    monkeypatch.undo()  # space freed
    await run_sim(tmp_path, steps=12, resume=True, set=OPTIONS)
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == list(
        range(12)
    )


@pytest.mark.slow
def test_a_real_full_tmpfs_ends_the_run_with_one_line_then_resume_finishes(tmp_path):
    with tmpfs(tmp_path / "disk", "size=2m") as disk:
        run_dir = disk / "D"
        argv = run_argv(
            steps=None, group_size=2, set={"advantages.filter_constant": "false"}, save_every=50, run_dir=run_dir
        )
        cmd = [sys.executable, "-m", "headrace", *argv]
        full = subprocess.run([*cmd, "--steps", "100000"], check=False, capture_output=True, text=True, timeout=100)
        assert full.returncode == 1, full.stderr
        assert "Traceback" not in full.stderr and "full" in full.stderr
        assert f"--resume --run-dir {run_dir}" in full.stderr
        assert_clean(run_dir)
        latest = json.loads((run_dir / "checkpoints" / "latest").read_text())["step"]

        subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)  # space freed
        steps = latest + 20
        resumed = subprocess.run(
            [*cmd, "--steps", str(steps), "--resume"], check=False, capture_output=True, text=True, timeout=100
        )
        assert resumed.returncode == 0, resumed.stderr
        got = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert got == list(range(steps))
