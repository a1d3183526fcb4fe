"""Kill and resume on the torch backend (CPU, fixed seed): the resumed run ends with the same
weights and the same metrics as a run that was never interrupted."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from helpers import run_argv
from test_resume import rows, stable, wait_for_steps

pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors.torch")

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

STEPS = 8


def cmd(run_dir, *extra):
    argv = run_argv(
        *extra,
        backend="torch",
        scheduler="sync",
        steps=STEPS,
        batch_size=8,
        group_size=8,
        save_every=1,
        seed=3,
        run_dir=run_dir,
        # constant groups train too: the untrained model is rarely right (the digit and its end token)
        set={"advantages.filter_constant": "false"},
    )
    return [sys.executable, "-m", "headrace", *argv]


def final_weights(run_dir):
    return safetensors.load_file(str(run_dir / "checkpoints" / f"step_{STEPS:06d}" / "weights.safetensors"))


def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path):
    reference = tmp_path / "reference"
    subprocess.run(cmd(reference), check=True, capture_output=True, timeout=200)

    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(cmd(run_dir), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_steps(run_dir, 3, proc, limit=200)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert len(rows(run_dir)) < STEPS, "the run finished before it was killed"

    resumed = subprocess.run(cmd(run_dir, "--resume"), capture_output=True, text=True, timeout=200)
    assert resumed.returncode == 0, resumed.stderr
    got, want = rows(run_dir), rows(reference)
    assert [r["step"] for r in got] == list(range(STEPS))
    assert [stable(r) for r in got] == [stable(r) for r in want]
    a, b = final_weights(run_dir), final_weights(reference)
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] == b[name]).all(), f"{name} differs after resume"
