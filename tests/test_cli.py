"""The command line: names, config files, overrides, and clear errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import run_argv

from headrace.app.cli import main, run_config_from_args
from headrace.core.errors import ConfigError
from headrace.run.config import build_config

pytestmark = pytest.mark.timeout(60)


def test_config_precedence_file_then_flags_then_dotted_overrides(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('steps = 7\nscheduler = "async"\n[sampling]\ntemperature = 0.5\nmax_tokens = 5\n')
    config = run_config_from_args(["--config", str(cfg), "--steps", "9", "--set", "sampling.temperature=0.7"])
    assert (config.steps, config.scheduler, config.sampling.temperature, config.sampling.max_tokens) == (
        9,
        "async",
        0.7,
        5,
    )


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["group_size=0"], "group_size"),
        (["optim.learning_rate=-1"], "optim.learning_rate"),
        (["sampling.temprature=0.5"], "did you mean 'sampling.temperature'"),
        (["stepz=3"], "did you mean 'steps'"),
        (["optim.lr=0.1"], "valid here: beta1, beta2, eps, grad_clip_norm, learning_rate, weight_decay"),
    ],
)
def test_invalid_options_name_the_problem(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        build_config(overrides=overrides)


def test_config_file_that_does_not_parse(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        build_config(bad)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["run", "--env", "arithmatic", "--backend", "sim"], "Did you mean 'arithmetic'"),
        (["run", "--scheduler", "asyn", "--backend", "sim"], "Did you mean 'async'"),
        (["run", "--backend", "simm"], "Did you mean 'sim'"),
        (["run", "--backend", "sim", "--group-size", "0"], "group_size"),
    ],
)
def test_bad_input_exits_2_with_one_clear_line(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


def test_run_dir_holding_another_run_is_refused(tmp_path, capsys):
    args = run_argv(run_dir=tmp_path / "r", steps=2, group_size=None)
    assert main(args) == 0
    assert main(args) == 2
    assert "--resume" in capsys.readouterr().err


@pytest.mark.parametrize("scheduler", ["sync", "stream", "async"])
def test_python_m_headrace_run_writes_metrics(tmp_path, scheduler):
    run_dir = tmp_path / scheduler
    argv = run_argv(
        scheduler=scheduler,
        batch_size=4,
        group_size=2,
        num_minibatches=2,
        run_dir=run_dir,
        progress=True,
        set={"advantages.filter_constant": "false"},
    )
    cmd = [sys.executable, "-m", "headrace", *argv]  # so a run this short trains something
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and "run finished" in out.stdout


def test_listing_commands(capsys):
    assert main(["schedulers"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["async", "inflight", "stream", "sync"]
    assert main(["envs"]) == 0
    assert {"arithmetic", "guess_number"} <= set(capsys.readouterr().out.split())
