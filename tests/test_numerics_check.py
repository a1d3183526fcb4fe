"""``headrace check numerics`` (issue 24, item 4): the sampler's logprobs against the learner's."""

from __future__ import annotations

import math

import pytest

from headrace.app.cli import main
from headrace.bench.numerics import compare


def test_compare_reports_k1_k3_and_the_largest_gap_by_position():
    sampled = [[-1.0, -2.0, -0.5, -0.1, -0.2], [-1.0]]
    learned = [[-1.0, -2.1, -0.5, -0.1, -0.3], [-0.9]]
    report = compare(sampled, learned, "float32")
    assert report.tokens == 6 and report.episodes == 2
    assert report.max_gap == pytest.approx(0.1)
    # k1 = log p_s - log p_l: +0.1 at one token, +0.1 at another, -0.1 at a third
    assert report.k1 == pytest.approx(0.1 / 6)
    k3 = lambda log_r: math.expm1(log_r) - log_r  # noqa: E731
    assert report.k3 == pytest.approx((2 * k3(-0.1) + k3(0.1)) / 6)
    first, second = report.buckets
    assert first["positions"] == "0-3" and first["tokens"] == 5 and second["positions"] == "4-7"
    assert second["max_gap"] == pytest.approx(0.1)
    assert report.k3 >= 0 and "k1" in report.lines()[0]


@pytest.mark.timeout(120)
def test_the_check_on_tiny_finds_float32_sampler_and_learner_in_agreement(capsys):
    assert main(["check", "numerics", "--episodes", "16", "--group-size", "4", "--json"]) == 0
    import json

    report = json.loads(capsys.readouterr().out)
    assert report["dtype"] == "float32" and report["tokens"] > 16
    assert abs(report["k1"]) < 1e-4 and report["max_gap"] < 1e-3


@pytest.mark.timeout(180)
def test_the_check_samples_a_runs_trained_weights_with_its_options(tmp_path, capsys):
    import json
    import random

    data = tmp_path / "sums.jsonl"  # a few SFT steps: weights away from the untrained model's
    rng = random.Random(5)
    pairs = [(rng.randint(0, 4), rng.randint(0, 4)) for _ in range(64)]
    rows = ({"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in pairs)
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run_dir = tmp_path / "run"
    sft = ["sft", "--data", str(data), "--renderer", "plain_text", "--run-dir", str(run_dir), "--steps", "3"]
    assert main([*sft, "--lr", "1e-3", "--no-progress"]) == 0
    capsys.readouterr()
    check = ["check", "numerics", "--episodes", "16", "--group-size", "4", "--json"]
    assert main([*check, "--set", "renderer=plain_text"]) == 0  # the run's options, the untrained weights
    untrained = json.loads(capsys.readouterr().out)
    assert main([*check, "--run-dir", str(run_dir)]) == 0
    trained = json.loads(capsys.readouterr().out)
    latest = json.loads((run_dir / "checkpoints" / "latest").read_text())
    assert trained["checkpoint"] == latest["path"] and untrained["checkpoint"] is None
    # other weights drew other tokens (the same seeds, prompts and options)
    assert (trained["tokens"], trained["k1"]) != (untrained["tokens"], untrained["k1"])
    assert trained["dtype"] == "float32" and abs(trained["k1"]) < 1e-4 and trained["max_gap"] < 1e-3


@pytest.mark.timeout(60)
def test_a_run_dir_without_a_run_or_a_checkpoint_is_one_paragraph(tmp_path, capsys):
    assert main(["check", "numerics", "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds no run" in err and "leave --run-dir out" in err and "Traceback" not in err
    (tmp_path / "config.json").write_text("{}")
    assert main(["check", "numerics", "--run-dir", str(tmp_path)]) == 2
    assert "no checkpoint yet" in capsys.readouterr().err
