"""Resume keeps every step exactly once, whatever stopped the run: kill -9 before any checkpoint,
a second Ctrl-C during the final save, an env raising KeyboardInterrupt, a torn last line.
`--resume --run-dir D` alone continues D with its own options; the summary counts this process's
steps (issue 10, items 1, 4, 11, 12)."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import run_argv
from test_resume import rows, wait_for_steps

from headrace.app.cli import main

pytestmark = pytest.mark.timeout(120)

# the issue's command: slow enough to kill mid-run, 100 steps of 8 x 8
ISSUE_RUN = [
    "--backend",
    "sim",
    "--steps",
    "100",
    "--batch-size",
    "8",
    "--group-size",
    "8",
    "--set",
    "sim.sample_request_s=0.01",
    "--no-progress",
]

# runs `headrace run ARGS` with one fault planted, chosen by HR_FAULT
SCRIPT = textwrap.dedent("""
    import asyncio, os, sys
    fault = os.environ.get("HR_FAULT", "")
    if fault == "slow_final_save":  # the final save takes a minute and says when it starts
        from headrace.backends import sim
        async def save_state(self, name):
            open(os.environ["HR_MARKER"], "w").close()
            await asyncio.sleep(60)
        sim.SimTraining.save_state = save_state
    if fault == "env_interrupt":  # the env raises KeyboardInterrupt in its 161st step (step 5 of 8 x 4)
        from headrace.envs import arithmetic
        step, calls = arithmetic.ArithmeticEnv.step, [0]
        async def interrupting(self, action):
            calls[0] += 1
            if calls[0] == 161:
                raise KeyboardInterrupt
            return await step(self, action)
        arithmetic.ArithmeticEnv.step = interrupting
    from headrace.app.cli import main
    sys.exit(main(["run", *sys.argv[1:]]))
""")


def headrace(tmp_path: Path, *args: str, fault: str = "", **popen) -> subprocess.Popen:
    script = tmp_path / "run_with_fault.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "HR_FAULT": fault, "HR_MARKER": str(tmp_path / "saving")}
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def steps_once(run_dir: Path, steps: int) -> None:
    got = [r["step"] for r in rows(run_dir)]
    repeated = {s: n for s, n in collections.Counter(got).items() if n > 1}
    assert not repeated, f"{len(got)} rows, steps repeated: {sorted(repeated)[:10]}..."
    assert got == list(range(steps))


def resume(tmp_path: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    proc = headrace(tmp_path, *ISSUE_RUN, "--run-dir", str(run_dir), "--resume", *extra)
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 0, err
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
def test_kill_9_before_any_checkpoint_then_resume_trains_each_step_once(tmp_path):
    run_dir = tmp_path / "D"
    proc = headrace(tmp_path, *ISSUE_RUN, "--run-dir", str(run_dir))
    wait_for_steps(run_dir, 40, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=10)
    killed_at = len(rows(run_dir))
    assert 40 <= killed_at < 100 and not (run_dir / "checkpoints" / "latest").exists()

    done = resume(tmp_path, run_dir)
    steps_once(run_dir, 100)
    assert "no checkpoint" in done.stderr and "starting over from step 0" in done.stderr
    assert f"its {killed_at} metrics rows are removed" in done.stderr


@pytest.mark.slow
def test_second_ctrl_c_during_the_final_save_then_resume_trains_each_step_once(tmp_path):
    run_dir = tmp_path / "D"
    proc = headrace(tmp_path, *ISSUE_RUN, "--run-dir", str(run_dir), fault="slow_final_save")
    wait_for_steps(run_dir, 20, proc)
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 30
    while not (tmp_path / "saving").exists():  # the final save has started
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 130, err
    assert not (run_dir / "checkpoints" / "latest").exists()

    resume(tmp_path, run_dir)
    steps_once(run_dir, 100)


@pytest.mark.slow
def test_env_raising_keyboard_interrupt_then_resume_trains_each_step_once(tmp_path):
    run_dir = tmp_path / "D"
    args = [*ISSUE_RUN, "--batch-size", "4", "--group-size", "8", "--steps", "12", "--run-dir", str(run_dir)]
    proc = headrace(tmp_path, *args, fault="env_interrupt")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert 1 <= len(rows(run_dir)) < 12

    proc = headrace(tmp_path, *args, "--resume")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    steps_once(run_dir, 12)


def _run(run_dir: Path, *extra: str) -> list[str]:
    return run_argv(*extra, steps=None, group_size=2, run_dir=run_dir, set={"advantages.filter_constant": "false"})


def test_torn_last_line_is_dropped_with_a_warning_and_its_step_trained_again(tmp_path, capsys):
    run_dir = tmp_path / "D"
    assert main(_run(run_dir, "--steps", "3")) == 0
    with open(run_dir / "metrics.jsonl", "a") as f:  # a full disk cut the next row short
        f.write('{"step": 3, "reward/mean": 0.5, "rewar')
    capsys.readouterr()
    assert main(_run(run_dir, "--steps", "6", "--resume")) == 0
    assert "ended in a partial line" in capsys.readouterr().err
    steps_once(run_dir, 6)


def test_torn_last_line_without_a_checkpoint_starts_over(tmp_path, capsys):
    run_dir = tmp_path / "D"
    assert main(_run(run_dir, "--steps", "3")) == 0
    (run_dir / "checkpoints" / "latest").unlink()  # killed before the final save
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rew')
    assert main(_run(run_dir, "--steps", "4", "--resume")) == 0
    err = capsys.readouterr().err
    assert "starting over from step 0" in err and "partial line" in err
    steps_once(run_dir, 4)


def test_a_damaged_line_in_the_middle_is_refused_and_nothing_is_cut(tmp_path, capsys):
    run_dir = tmp_path / "D"
    assert main(_run(run_dir, "--steps", "3")) == 0
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    damaged = "".join([lines[0], "garbage\n", *lines[1:]])
    (run_dir / "metrics.jsonl").write_text(damaged)
    assert main(_run(run_dir, "--steps", "5", "--resume")) == 2
    assert "line 2 of" in capsys.readouterr().err
    assert (run_dir / "metrics.jsonl").read_text() == damaged


def test_resume_of_a_directory_that_does_not_exist_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "typo"
    assert main(_run(run_dir, "--resume")) == 2
    assert "nothing to resume" in capsys.readouterr().err
    assert not run_dir.exists()


def test_resume_with_only_the_run_dir_continues_with_the_runs_options(tmp_path, capsys):
    run_dir = tmp_path / "D"
    assert main(_run(run_dir, "--steps", "3", "--env", "guess_number", "--set", "sim.sample_request_s=0.001")) == 0
    # nothing but the directory (and a longer run): backend, env, sizes and sim knobs come from D
    assert main(["run", "--resume", "--run-dir", str(run_dir), "--steps", "5", "--no-progress"]) == 0
    steps_once(run_dir, 5)
    saved = json.loads((run_dir / "config.json").read_text())
    assert (saved["backend"], saved["env"], saved["steps"], saved["sim"]["sample_request_s"]) == (
        "sim",
        "guess_number",
        5,
        0.001,
    )
    capsys.readouterr()
    assert main(["run", "--resume", "--run-dir", str(run_dir), "--no-progress"]) == 0  # all 5 done: nothing to train
    assert "nothing to train" in capsys.readouterr().out
    steps_once(run_dir, 5)


def test_resume_with_different_options_lists_both_values(tmp_path, capsys):
    run_dir = tmp_path / "D"
    assert main(_run(run_dir, "--steps", "2")) == 0
    assert main(["run", "--resume", "--run-dir", str(run_dir), "--group-size", "4", "--backend", "torch"]) == 2
    err = capsys.readouterr().err
    assert "group_size: 2 in the run, 4 now" in err and "backend: 'sim' in the run, 'torch' now" in err


def test_summary_counts_the_steps_of_this_process_without_reading_the_metrics_file(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "D"
    assert main(_run(run_dir, "--steps", "40")) == 0
    capsys.readouterr()
    read_text = Path.read_text

    def no_metrics_read(self, *args, **kwargs):
        assert self.name != "metrics.jsonl", "the summary read all of metrics.jsonl into memory"
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", no_metrics_read)
    assert main(_run(run_dir, "--steps", "50", "--resume")) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "10 steps in" in out and "resumed after step 40" in out


def test_a_run_saved_before_an_option_existed_resumes_with_its_default(tmp_path, capsys):
    """config.json of an older headrace lacks the options added since (here `log`, and it still
    has the retired `pipeline`): --resume reads it as this version would, not as a different run."""
    run_dir = tmp_path / "run"
    assert main(run_argv(run_dir=run_dir, steps=2, set={"advantages.filter_constant": "false"})) == 0
    saved = json.loads((run_dir / "config.json").read_text())
    del saved["log"]
    saved["pipeline"] = True
    (run_dir / "config.json").write_text(json.dumps(saved))
    assert main(["run", "--resume", "--run-dir", str(run_dir), "--steps", "3", "--no-progress"]) == 0, (
        capsys.readouterr().err
    )
    assert [r["step"] for r in rows(run_dir)] == [0, 1, 2]
    capsys.readouterr()
    saved["batch_size"] = 7  # a real difference is still refused
    (run_dir / "config.json").write_text(json.dumps(saved))
    assert (
        main(["run", "--resume", "--run-dir", str(run_dir), "--steps", "4", "--batch-size", "2", "--no-progress"]) == 2
    )
    assert "batch_size: 7 in the run, 2 now" in capsys.readouterr().err
