"""The run directory refuses before damage: --overwrite replaces only a run (never the working
directory, an ancestor or home), one run at a time holds it (the second is told the holder's
PID), and an unusable directory or checkpoint pointer gets one paragraph, exit 2 (issue 10,
items 3, 5, 10)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_argv
from test_resume import rows, wait_for_steps

from headrace.app.cli import main
from headrace.run.config import build_config
from headrace.run.rundir import RunDir, RunDirError

pytestmark = pytest.mark.timeout(60)


def _run(run_dir: Path | str, *extra: str) -> list[str]:
    return run_argv(*extra, steps=2, group_size=2, run_dir=run_dir, set={"advantages.filter_constant": "false"})


def refused(argv: list[str], capsys, fragment: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err, err


# -- --overwrite ------------------------------------------------------------------------------
def test_overwrite_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    refused(_run(precious, "--overwrite"), capsys, "is not a headrace run directory")
    assert (precious / "thesis.tex").read_text() == "years of work"


def test_overwrite_refuses_a_folder_whose_config_json_is_not_a_runs(tmp_path, capsys):
    app = tmp_path / "app"
    app.mkdir()
    (app / "config.json").write_text(json.dumps({"name": "my web app"}))
    (app / "server.py").write_text("print('hi')")
    refused(_run(app, "--overwrite"), capsys, "is not a headrace run's config")
    assert sorted(p.name for p in app.iterdir()) == ["config.json", "server.py"]


@pytest.mark.parametrize("where", ["cwd", "ancestor", "home"])
def test_overwrite_never_empties_the_working_directory_an_ancestor_or_home(tmp_path, monkeypatch, capsys, where):
    run_dir = tmp_path / "D"
    assert main(_run(run_dir)) == 0  # a real run: only where it is protects it
    (run_dir / "notes.txt").write_text("mine")
    target = {"cwd": ".", "ancestor": "..", "home": str(run_dir)}[where]
    cwd = {"cwd": run_dir, "ancestor": run_dir / "sub", "home": tmp_path}[where]
    cwd.mkdir(exist_ok=True)
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(run_dir) if where == "home" else str(tmp_path / "elsewhere"))
    refused(_run(target, "--overwrite"), capsys, "--overwrite refused")
    assert (run_dir / "notes.txt").read_text() == "mine" and len(rows(run_dir)) == 2


def test_overwrite_replaces_a_run_killed_before_its_first_step(tmp_path):
    run_dir = tmp_path / "D"
    assert main(_run(run_dir)) == 0
    (run_dir / "metrics.jsonl").unlink()  # only config.json (and log.jsonl) were written
    assert main(_run(run_dir, "--overwrite", "--steps", "3")) == 0
    assert len(rows(run_dir)) == 3


def test_resume_and_overwrite_together_are_refused(tmp_path, capsys):
    run_dir = tmp_path / "D"
    assert main(_run(run_dir)) == 0
    refused(_run(run_dir, "--overwrite", "--resume"), capsys, "not both")
    assert len(rows(run_dir)) == 2


# -- one run at a time ------------------------------------------------------------------------
@pytest.mark.slow
def test_a_second_run_in_the_same_directory_is_refused_naming_the_holder(tmp_path):
    run_dir = tmp_path / "D"
    argv = run_argv(steps=100, batch_size=8, group_size=8, set={"sim.sample_request_s": 0.05}, run_dir=run_dir)
    cmd = [sys.executable, "-m", "headrace", *argv]
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_steps(run_dir, 3, first)
        # --resume would be accepted (the run exists): only the lock keeps the two apart
        second = subprocess.run([*cmd, "--resume"], check=False, capture_output=True, text=True, timeout=60)
        assert second.returncode == 2, second.stderr
        assert f"PID {first.pid}" in second.stderr and "Traceback" not in second.stderr
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            first.kill()
    assert first.returncode == 130
    assert [r["step"] for r in rows(run_dir)] == list(range(len(rows(run_dir))))
    assert (run_dir / ".lock").read_text() == "", "the lock was not released on exit"


def test_the_lock_names_this_process_and_is_released(tmp_path):
    config = build_config(flags={"backend": "sim", "run_dir": str(tmp_path / "D")})
    again = config.model_copy(update={"resume": True})
    with RunDir.open(config):
        assert (tmp_path / "D" / ".lock").read_text().strip() == str(os.getpid())
        refused = pytest.raises(RunDirError, match=f"in use by another headrace run \\(PID {os.getpid()}\\)")
        with refused, RunDir.open(again):
            pass
    with RunDir.open(again):  # released
        pass


def test_a_stale_lock_of_a_dead_run_is_taken_over(tmp_path):
    run_dir = tmp_path / "D"
    assert main(_run(run_dir)) == 0
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_dir / ".lock").write_text(f"{dead.pid}\n")
    assert main(_run(run_dir, "--steps", "4", "--resume")) == 0
    assert [r["step"] for r in rows(run_dir)] == [0, 1, 2, 3]
    assert str(dead.pid) in (run_dir / "log.jsonl").read_text()  # run_start says whose lock it took


# -- an unusable directory or pointer: one paragraph, exit 2 ----------------------------------
def test_run_dir_that_is_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    refused(_run(tmp_path / "f"), capsys, "is a file, not a directory")
    refused(_run(tmp_path / "f" / "sub"), capsys, "has a file where a directory should be")


def test_run_dir_name_too_long(tmp_path, capsys):
    refused(_run(tmp_path / ("x" * 300)), capsys, "has a name too long")


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A real small file system, where the test runs as root; skipped otherwise."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=False, capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_run_dir_on_a_read_only_file_system(tmp_path, capsys):
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        refused(_run(ro / "D"), capsys, "is on a read-only file system")


def test_run_dir_on_a_full_disk(tmp_path, capsys):
    with tmpfs(tmp_path / "full", "size=64k") as full:
        with contextlib.suppress(OSError), open(full / "filler", "wb") as f:
            f.write(b"x" * (1 << 20))
        refused(_run(full / "D"), capsys, "is on a full disk")


@pytest.mark.parametrize(
    "damage",
    [lambda p: (p.unlink(), p.mkdir()), lambda p: p.write_text(json.dumps({"step": -3, "path": "sim://x?step=-3"}))],
    ids=["a directory", "a negative step"],
)
def test_checkpoint_pointer_that_is_a_directory_or_names_a_negative_step(tmp_path, capsys, damage):
    run_dir = tmp_path / "D"
    assert main(_run(run_dir)) == 0
    damage(run_dir / "checkpoints" / "latest")
    refused(_run(run_dir, "--resume", "--steps", "4"), capsys, "checkpoint pointer")
    assert len(rows(run_dir)) == 2
