"""Kill and resume, Ctrl-C, and a lossless record: no step lost or repeated."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import run_argv

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

# slow enough to be killed mid-run, fast enough for CI
SIM = ["--set", "sim.sample_token_s=0.004", "--set", "sim.train_step_s=0.01", "--set", "sim.optim_step_s=0.01"]
VOLATILE = ("time/", "throughput/trajectories_per_s", "throughput/tokens_per_s", "queue/", "perf/")  # perf/: rates, MFU


def cmd(run_dir: Path, scheduler: str, steps: int = 24, *extra: str) -> list[str]:
    argv = run_argv(*SIM, *extra, scheduler=scheduler, steps=steps, batch_size=4, save_every=1, run_dir=run_dir)
    return [sys.executable, "-m", "headrace", *argv]


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def wait_for_steps(run_dir: Path, n: int, proc: subprocess.Popen, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while len(rows(run_dir)) < n:
        assert proc.poll() is None, f"run ended early: {proc.stderr.read() if proc.stderr else ''}"
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.02)


def latest_step(run_dir: Path) -> int:
    return json.loads((run_dir / "checkpoints" / "latest").read_text())["step"]


@pytest.mark.parametrize("scheduler", ["sync", "async"])
def test_sigkill_then_resume_loses_and_repeats_no_step(tmp_path, scheduler):
    reference = tmp_path / "reference"
    subprocess.run(cmd(reference, scheduler), check=True, capture_output=True, timeout=100)

    run_dir = tmp_path / "killed"
    kill_after = random.Random(scheduler).randint(3, 18)
    proc = subprocess.Popen(cmd(run_dir, scheduler), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_steps(run_dir, kill_after, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    died_at = len(rows(run_dir))
    assert died_at < 24, "the run finished before it was killed"

    resumed = subprocess.run(
        cmd(run_dir, scheduler, 24, "--resume"), check=False, capture_output=True, text=True, timeout=100
    )
    assert resumed.returncode == 0, resumed.stderr
    got = rows(run_dir)
    assert [r["step"] for r in got] == list(range(24)), "a step was lost or repeated"
    assert latest_step(run_dir) == 24
    if scheduler == "sync":  # deterministic backend: identical to the run that was never killed
        assert [stable(r) for r in got] == [stable(r) for r in rows(reference)]
    else:  # every batch that was in flight at the kill was rolled out again: all trained once
        assert sum(r["groups/trained"] + r["groups/filtered"] + r["groups/dropped"] for r in got) == 24 * 4


def test_ctrl_c_checkpoints_and_exits_130_then_resume_finishes(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(cmd(run_dir, "async", 40), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_steps(run_dir, 3, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "--resume" in err
    done = len(rows(run_dir))
    assert 3 <= done < 40
    assert latest_step(run_dir) == done, "the checkpoint is not the last reported step"
    resumed = subprocess.run(
        cmd(run_dir, "async", 40, "--resume"), check=False, capture_output=True, text=True, timeout=100
    )
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in rows(run_dir)] == list(range(40))


def test_second_ctrl_c_exits_at_once(tmp_path):
    run_dir = tmp_path / "run"
    # a training step that takes a minute: the first Ctrl-C would wait for it
    slow = cmd(run_dir, "sync", 5) + ["--set", "sim.train_step_s=60", "--set", "advantages.filter_constant=false"]
    proc = subprocess.Popen(slow, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    deadline = time.monotonic() + 30
    while "run_start" not in (run_dir / "log.jsonl").read_text() if (run_dir / "log.jsonl").exists() else True:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)  # the first step is on the (virtual) device
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 130
    assert time.monotonic() - started < 5
    assert "exiting now" in err
