"""No file of a run directory is written through a symbolic link (issue 22, item 7): a link put in
place of the lock, a log or a state file is refused with one paragraph (or, for a file that is
replaced whole, replaced itself), and the file it points to is never changed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_argv

from tests.serve_support import serving

pytestmark = pytest.mark.timeout(180)
QUICK = {"advantages.filter_constant": "false"}  # the sim's constant groups still train
PRECIOUS = "a file of the user's, not the run's\n"


def headrace(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "headrace", *argv], capture_output=True, text=True, timeout=120)


def link_in(run_dir: Path, name: str, tmp_path: Path) -> Path:
    """Replace ``run_dir/name`` by a link to a file of the user's; that file is returned."""
    precious = tmp_path / "precious.txt"
    precious.write_text(PRECIOUS)
    (run_dir / name).unlink(missing_ok=True)
    (run_dir / name).symlink_to(precious)
    return precious


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    done = headrace(*run_argv(steps=2, run_dir=run_dir, set=QUICK))
    assert done.returncode == 0, done.stderr
    return run_dir


@pytest.mark.parametrize("name", [".lock", "metrics.jsonl", "log.jsonl", "checkpoints/index.jsonl"])
def test_resume_refuses_a_run_dir_whose_lock_or_log_is_a_link_and_leaves_its_target_alone(run_dir, tmp_path, name):
    precious = link_in(run_dir, name, tmp_path)
    resumed = headrace(*run_argv(steps=4, run_dir=run_dir, set=QUICK), "--resume")
    assert resumed.returncode == 2, resumed.stderr
    assert f"'{run_dir / name}' is a symbolic link (to '{precious}')" in resumed.stderr
    assert "Replace the link with the file itself" in resumed.stderr
    assert len(resumed.stderr.strip().splitlines()) == 1, resumed.stderr
    assert precious.read_text() == PRECIOUS


def test_a_file_replaced_whole_replaces_the_link_not_its_target(run_dir, tmp_path):
    precious = link_in(run_dir, "rollouts/step_000002.jsonl", tmp_path)
    (run_dir / "view.html").symlink_to(tmp_path / "precious.txt")
    resumed = headrace(*run_argv(steps=3, run_dir=run_dir, set=QUICK), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    viewed = headrace("view", str(run_dir))
    assert viewed.returncode == 0, viewed.stderr
    assert precious.read_text() == PRECIOUS
    for name in ("rollouts/step_000002.jsonl", "view.html"):
        assert not (run_dir / name).is_symlink() and (run_dir / name).stat().st_size > 0


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Path:
    """A service's run directory, once: it served a completion and has a reward."""
    run_dir = tmp_path_factory.mktemp("served") / "d"
    with serving(run_dir) as server:
        completion, _ = server.chat("hello")
        assert server.post("/v1/feedback", {"id": completion.id, "reward": 1.0}).status_code == 200
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("name", [".lock", "completions.jsonl", "feedback.jsonl", "versions.jsonl"])
def test_serve_refuses_a_link_in_its_run_dir(served, tmp_path, name):
    run_dir = tmp_path / "d"
    shutil.copytree(served, run_dir)
    precious = link_in(run_dir, name, tmp_path)
    with pytest.raises(AssertionError, match="exited before it was ready") as refused, serving(run_dir, "--resume"):
        pass
    assert f"'{run_dir / name}' is a symbolic link" in str(refused.value)
    assert precious.read_text() == PRECIOUS
