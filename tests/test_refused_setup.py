"""A run refused at set-up leaves the directory as it found it and prints only its refusal (issue
22, item 14): the corrected rerun in the same --run-dir is not refused as "already holds a run"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_argv

from tests.serve_support import serving

pytestmark = pytest.mark.timeout(180)
BAD_OPTION = {"env_options.max_operand": "abc"}
QUICK = {"advantages.filter_constant": "false"}  # the sim's constant groups still train


def headrace(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "headrace", *argv], capture_output=True, text=True, timeout=120)


def test_a_run_refused_at_set_up_leaves_no_run_behind_and_prints_only_its_refusal(tmp_path):
    run_dir = tmp_path / "run"
    refused = headrace(*run_argv(steps=2, run_dir=run_dir, progress=True, set=BAD_OPTION))
    assert refused.returncode == 2, refused.stderr
    assert refused.stdout == "", "the run dir line and the legend were printed before the refusal"
    assert refused.stderr.startswith("headrace: error: env 'arithmetic' rejected its options")
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())
    rerun = headrace(*run_argv(steps=2, run_dir=run_dir, progress=True, set=QUICK))
    assert rerun.returncode == 0, rerun.stderr
    assert rerun.stdout.startswith(f"headrace: run dir {run_dir}")  # a run that starts still says where


def test_a_refusal_in_a_directory_of_the_users_keeps_its_files_and_removes_only_the_runs(tmp_path):
    run_dir = tmp_path / "mine"
    (run_dir / "notes").mkdir(parents=True)
    (run_dir / "notes" / "plan.txt").write_text("mine\n")
    (run_dir / "empty.txt").touch()
    refused = headrace(*run_argv(steps=2, run_dir=run_dir, set=BAD_OPTION))
    assert refused.returncode == 2, refused.stderr
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == ["empty.txt", "notes", "notes/plan.txt"]
    assert headrace(*run_argv(steps=2, run_dir=run_dir, set=QUICK)).returncode == 0


def test_a_run_that_started_and_failed_keeps_its_directory(tmp_path):
    """Only a refusal at set-up is undone: a resumed run refused, or any run once it began, keeps all."""
    run_dir = tmp_path / "run"
    assert headrace(*run_argv(steps=2, run_dir=run_dir, set=QUICK)).returncode == 0
    before = sorted(p.name for p in Path(run_dir).iterdir())
    differs = headrace(*run_argv(steps=3, run_dir=run_dir, set={**QUICK, "env_options.max_operand": "5"}), "--resume")
    assert differs.returncode == 2 and "options differ" in differs.stderr, differs.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == before
    rejected = headrace(*run_argv(steps=3, run_dir=run_dir, set=BAD_OPTION), "--resume")
    assert rejected.returncode == 2 and "rejected its options" in rejected.stderr, rejected.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == before


@pytest.mark.slow
def test_serve_refused_at_set_up_leaves_no_run_behind(tmp_path):
    run_dir = tmp_path / "d"
    refused = subprocess.run(
        [sys.executable, "-m", "headrace", "serve", "--backend", "sim", "--no-auth", "--port", "0",
         "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2 and "cannot fork a training state" in refused.stderr, refused.stderr
    assert not run_dir.exists()
    with serving(run_dir) as server:  # the corrected command serves in the same directory
        assert server.version_at_start == 0
