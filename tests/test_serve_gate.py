"""The serve gate's paired test (``headrace/serve/paired.py``): exact sign-test figures, its
interval agreeing with its decision, and its false-accept rate and power on simulated rewards
(the real gate's, on the tiny model, are in benchmarks/RESULTS.md, "Serve round 2")."""

from __future__ import annotations

import math
import random

import pytest

from headrace.core.errors import ConfigError
from headrace.run.config import build_config
from headrace.serve.paired import lower_bound, paired_test, upper_tail


def test_exact_sign_test_figures():
    cand = [[1.0]] * 8 + [[0.0]] * 2 + [None]
    inc = [[0.0]] * 8 + [[0.0]] * 2 + [[1.0]]
    test = paired_test(cand, inc, 0.05, "improve")
    # 8 wins, 0 losses, 2 ties (the failed problem is left out): p = 2**-8
    assert (test["wins"], test["losses"], test["ties"], test["problems"]) == (8, 0, 2, 10)
    assert test["p_value"] == pytest.approx(1 / 256) and test["decision"] == "accept"
    assert test["effect"] == pytest.approx(0.8) and test["interval"][0] < 0.8 < test["interval"][1]
    same = paired_test(inc, inc, 0.05, "improve")  # identical: every problem ties, never accepted
    assert (same["ties"], same["decision"], same["effect"], same["interval"]) == (11, "reject", 0.0, [0.0, 0.0])
    assert paired_test(inc, inc, 0.05, "no_regress")["passed"]  # and not refused as a regression
    worse = paired_test(inc, cand, 0.05, "no_regress")
    assert worse["decision"] == "reject" and worse["p_value"] == pytest.approx(1 / 256)
    # samples per problem are averaged before the sign is taken
    mixed = paired_test([[1.0, 0.0], [1.0, 1.0]], [[0.0, 0.0], [1.0, 0.0]], 0.05, "improve")
    assert (mixed["wins"], mixed["effect"]) == (2, 0.5)


def test_the_interval_on_the_win_share_agrees_with_the_decision():
    for m in range(1, 31):
        for wins in range(m + 1):
            p = upper_tail(wins, m)
            assert p == pytest.approx(sum(math.comb(m, i) for i in range(wins, m + 1)) / 2**m)
            if abs(p - 0.05) > 1e-9:
                assert (lower_bound(wins, m, 0.05) > 0.5) == (p <= 0.05), (wins, m)


def test_false_accepts_stay_under_alpha_and_a_better_candidate_passes():
    rng = random.Random(0)

    def trial(p_inc: float, p_cand: float, problems: int = 32) -> bool:
        accuracy = [rng.random() for _ in range(problems)]  # problems differ in difficulty
        inc = [[float(rng.random() < a * p_inc * 2)] for a in accuracy]
        cand = [[float(rng.random() < a * p_cand * 2)] for a in accuracy]
        return paired_test(cand, inc, 0.05, "improve")["passed"]

    trials = 4000
    null = sum(trial(0.25, 0.25) for _ in range(trials)) / trials
    assert null <= 0.05  # exact test: at most alpha (the sign test with ties dropped is conservative)
    better = sum(trial(0.25, 0.45) for _ in range(1000)) / 1000
    assert better > 0.3  # measured 0.45 (32 problems, accuracy 0.25 -> 0.45)


def test_the_gate_options_are_checked():
    with pytest.raises(ConfigError, match="gate_improve"):
        build_config(overrides=["serve.gate=env", "serve.gate_env=arithmetic"])
    with pytest.raises(ConfigError, match="gate_alpha"):
        build_config(overrides=["serve.gate=env", "serve.gate_env=arithmetic", "serve.gate_alpha=0.7"])
    config = build_config(overrides=["serve.gate=env", "serve.gate_env=arithmetic", "serve.gate_improve=true"])
    assert config.section("serve").gate_alpha == 0.05
