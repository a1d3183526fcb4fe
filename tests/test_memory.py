"""Bounded memory: a slow learner backs the queues up to their bounds, no further, and resident
memory stays flat from 1x to 10x the steps (measured in fresh processes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

SCRIPT = r"""
import json, resource, sys, anyio
from headrace.engine.config import build_config
from headrace.engine.run import train

steps, run_dir = int(sys.argv[1]), sys.argv[2]
config = build_config(flags=dict(backend="sim", scheduler="async", max_steps_off_policy=2, steps=steps,
                                 batch_size=8, group_size=4, run_dir=run_dir, progress=False),
                      overrides=["sim.train_step_s=0.002", "advantages.filter_constant=false"])
summary = anyio.run(train, config)
actors = summary.actors
peaks = {q: max(r[f"queue/{q}_peak"] for r in summary.metrics) for q in ("rollout", "reward", "learner")}
bounds = {"rollout": actors.gate.outbox.maxsize, "reward": actors.rewards.inbox.maxsize, "learner": actors.learner.inbox.maxsize}
print(json.dumps({"rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "peaks": peaks, "bounds": bounds}))
"""


def measure(steps: int, tmp_path) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(steps), str(tmp_path / f"run{steps}")],
                         capture_output=True, text=True, timeout=170, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_queues_stay_bounded_and_rss_stays_flat(tmp_path):
    small, large = measure(200, tmp_path), measure(2000, tmp_path)
    print(f"peak RSS: {small['rss_mb']:.1f} MiB at 200 steps, {large['rss_mb']:.1f} MiB at 2000 steps")
    for name, peak in large["peaks"].items():
        assert peak <= large["bounds"][name], f"queue {name} grew past its bound"
    assert large["peaks"]["learner"] > 0, "the slow learner never backed the queues up"
    assert large["rss_mb"] < small["rss_mb"] * 1.10 + 4, f"memory grew: {small} -> {large}"
