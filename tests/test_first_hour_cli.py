"""A newcomer's first hour, through the real command line (issue 22, items 15 and 16): a misspelt
env option or model name is refused with the closest name before the run directory is written,
`headrace rollback` on a served directory points to the live rollback, `--help` and `headrace
schedulers` name and describe every scheduler, and `headrace serve` says when it publishes, rolls
back and stops."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from headrace.plugins import registry
from headrace.run.runlock import LOCK, RunLock

pytestmark = pytest.mark.timeout(120)


def headrace(*args: str, timeout: float = 100) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "headrace", *args], capture_output=True, text=True, timeout=timeout)


BUILTIN_ENVS = [name for name in registry.envs.names() if name in registry.envs._lazy]


def test_every_builtin_env_declares_its_options():
    undeclared = [name for name in BUILTIN_ENVS if registry.declared_options(name) is None]
    assert not undeclared and len(BUILTIN_ENVS) >= 10


@pytest.mark.parametrize(
    ("env", "typo", "meant"),
    [
        ("arithmetic", "max_opernd", "max_operand"),
        ("guess_number", "max_numbr", "max_number"),
        ("faulty", "fail_rat", "fail_rate"),
        ("faulty", "max_opernd", "max_operand"),  # an option of the env it wraps
        ("flaky_arithmetic", "hang_rte", "hang_rate"),
        ("word_math", "difficuly", "difficulty"),
        ("gsm8k", "pth", "path"),
        ("math", "answer_fromat", "answer_format"),
        ("tool_calc", "digts", "digits"),
        ("tictactoe", "opponet", "opponent"),
        ("pairwise_judge", "judge_modl", "judge_model"),
        ("openenv", "ulr", "url"),
        ("verifiers", "max_taks", "max_tasks"),
    ],
)
@pytest.mark.slow  # > 10 s (a server, a subprocess or a benchmark); CI runs it
def test_a_misspelt_env_option_is_refused_before_the_run_dir_is_written(tmp_path, env, typo, meant):
    run_dir = tmp_path / "run"
    out = headrace("run", "--backend", "sim", "--env", env, "--steps", "1", "--set", f"env_options.{typo}=3",
                   "--run-dir", str(run_dir), "--no-progress")  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"headrace: error: env '{env}' rejected its options")
    assert f"has no option '{typo}' (did you mean '{meant}'?)" in out.stderr and out.stderr.count("\n") == 1
    assert not run_dir.exists() and "run dir" not in out.stdout


def test_a_model_name_close_to_a_registered_one_is_refused_with_it(tmp_path):
    run_dir = tmp_path / "run"
    out = headrace("run", "--backend", "torch", "--model", "smollm2", "--steps", "1", "--run-dir", str(run_dir))
    assert out.returncode == 2, out.stderr
    assert "unknown model 'smollm2' (did you mean 'smollm2-135m'?)" in out.stderr
    assert "hf download" not in out.stderr and not run_dir.exists()


def test_rollback_of_a_served_directory_points_to_the_live_rollback(tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    (served / "versions.jsonl").write_text(json.dumps({"line": 0, "outcome": "initial", "version": 0}) + "\n")
    lock = RunLock(served / LOCK)
    lock.acquire()  # as `headrace serve` holds it while it runs
    try:
        out = headrace("rollback", str(served), "--to", "0")
    finally:
        lock.release()
    assert out.returncode == 2, out.stderr
    assert "is being served right now" in out.stderr and 'POST /v1/admin/rollback {"version": 0}' in out.stderr
    assert "interleave their steps" not in out.stderr


def test_help_and_the_schedulers_listing_name_and_describe_every_scheduler():
    names = registry.schedulers.names()
    assert "inflight" in names
    help_text = " ".join(headrace("run", "--help").stdout.split())
    line = help_text[help_text.index("--scheduler SCHEDULER", help_text.index("options:")) :][:120]
    assert all(name in line for name in names), line
    listing = headrace("schedulers")
    assert listing.returncode == 0, listing.stderr
    described = dict(row.split(maxsplit=1) for row in listing.stdout.splitlines())
    assert sorted(described) == sorted(names)
    assert all(len(text) > 30 for text in described.values()), described


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_serve_says_when_it_publishes_rolls_back_and_stops(tmp_path):
    pytest.importorskip("openai")
    from tests.serve_support import serving

    run_dir = tmp_path / "d"
    with serving(run_dir, "--batch-size", "2") as server:
        ids = [server.chat(f"hi {i}")[0].id for i in range(2)]
        assert server.post("/v1/feedback", [{"id": ids[0], "reward": 0}, {"id": ids[1], "reward": 1}]).is_success
        line = server.wait_for_output("published version 1")
        assert "of version 0" in line and "serving it now" in line
        assert server.post("/v1/admin/rollback", {"version": 0}).is_success
        assert "(was version 1)" in server.wait_for_output("rolled back to version 0")
        server.proc.send_signal(signal.SIGINT)
        stopped = server.wait_for_output("headrace serve: stopped")
        assert f"version 0 is saved in {run_dir}" in stopped and "--resume" in stopped
        assert server.proc.wait(60) == 0
    assert Path(run_dir / "versions.jsonl").is_file()
