"""On-policy distillation (``headrace run --teacher``) on the tiny model (torch)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from helpers import run_argv

from headrace.app.cli import main, run_config_from_args
from headrace.core.errors import ConfigError
from headrace.run.distill import teacher_config
from headrace.run.train import train


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _argv(run: Path, *extra: str, **flags) -> list[str]:
    flags = dict(backend="torch", steps=2, batch_size=2, group_size=4, env="arithmetic") | flags
    return run_argv(*extra, run_dir=run, **flags)


@pytest.mark.parametrize("scheduler", ["sync", "stream", "async", "inflight"])
def test_a_teacher_of_the_same_weights_sees_no_gap_under_every_scheduler(tmp_path, scheduler):
    """The teacher is the tiny model from the same seed: the student's own weights at step 0, so
    the reverse KL of the tokens the student sampled is 0 there (the sampler's logprobs and the
    teacher's forward agree), and every scheduler carries it to the learner."""
    run = tmp_path / "run"
    argv = _argv(run, "--teacher", "tiny", scheduler=scheduler, num_minibatches=2)
    assert main(argv) == 0
    got = rows(run)
    assert len(got) == 2 and all("env/all/distill/reverse_kl" in r for r in got)
    assert abs(got[0]["env/all/distill/reverse_kl"]) < 1e-3
    # groups whose rewards are all equal train too: the teacher's signal is per token
    assert all(r.get("groups/filtered", 0) == 0 for r in got)


def test_multi_turn_episodes_are_scored_on_their_actions(tmp_path):
    run = tmp_path / "run"
    assert main(_argv(run, "--teacher", "tiny", env="guess_number", set={"distill.reward_coef": 1.0})) == 0
    assert all(abs(r["env/all/distill/reverse_kl"]) < 1e-3 for r in rows(run)[:1])


@pytest.mark.slow
def test_distilling_from_a_trained_run_dir_closes_the_gap(tmp_path):
    data = tmp_path / "d.jsonl"
    import random

    rng = random.Random(5)
    with data.open("w") as f:
        for _ in range(200):
            a, b = rng.randint(0, 4), rng.randint(0, 4)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "completion": str(a + b)}) + "\n")
    teacher = tmp_path / "teacher"
    sft = ["sft", "--data", str(data), "--renderer", "plain_text", "--run-dir", str(teacher), "--steps", "20"]
    assert main([*sft, "--batch-tokens", "256", "--lr", "1e-3", "--set", "sft.epochs=20"]) == 0
    run = tmp_path / "student"
    # the problems drawn as the teacher's SFT data was (operand by operand), 4 tokens: room to differ
    balanced = ("--set", "env_options.balanced=false")
    argv = _argv(run, "--teacher", str(teacher), *balanced, steps=20, batch_size=8, lr=1e-3, max_tokens=4)
    config = run_config_from_args(argv[1:])
    tconfig, checkpoint = teacher_config(config)
    assert checkpoint is not None and checkpoint.endswith("step_000020") and tconfig.renderer == "plain_text"
    summary = asyncio.run(train(config))
    kl = [r["env/all/distill/reverse_kl"] for r in summary.metrics]
    assert sum(kl[-5:]) / 5 < 0.8 * sum(kl[:5]) / 5  # the student moved toward the teacher


def test_a_teacher_run_dir_without_a_checkpoint_is_refused(tmp_path):
    empty = tmp_path / "teacher"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    config = run_config_from_args(_argv(tmp_path / "run", "--teacher", str(empty))[1:])
    with pytest.raises(ConfigError, match="without a checkpoint"):
        teacher_config(config)
