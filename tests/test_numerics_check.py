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
